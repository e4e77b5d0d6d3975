"""One poisoning client among ten: FedAvg against the robust aggregators.

The ``tabular-fedavg`` preset (breast-cancer diagnosis, 10 clients with Dirichlet label skew,
an MLP, 20 rounds) runs clean and with client 0 poisoning its update u = θ_0 − θ every round
(:mod:`fedfm.core.attacks`):

* scaled: u ← 1e30·u, huge but finite, so no NaN/Inf check rejects it;
* sign flip: u ← −10·u.

Each aggregator (``algo.aggregator``) runs under each attack for several seeds. The first
table gives the global model's test accuracy after the last round (mean over seeds); a run
that stops because too few clients' replies survive is shown as ``stop@rN`` (with the count
when only some seeds stop). The second table counts the replies rejected over all rounds and
seeds (a NaN reply from a client is rejected). The ratio printed last is the worst robust
accuracy under attack divided by the clean FedAvg accuracy.

Usage: .venv/bin/python benchmarks/poisoning.py [--seeds 0 1 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedfm.config import load_config
from fedfm.core.attacks import poison_handlers
from fedfm.engine import Engine
from fedfm.errors import TooFewClientsError
from fedfm.runtime.embedded import embedded_federation

ATTACKER = "0"
ATTACKS: dict[str, float | None] = {"clean": None, "scaled x1e30": 1e30, "sign flip x-10": -10.0}
AGGREGATORS: dict[str, list[str]] = {
    "fedavg (mean)": [],
    "mean + clip median": ["algo.aggregator.clip_norm=median"],
    "mean + clip 1.0": ["algo.aggregator.clip_norm=1.0"],
    "median": ["algo.aggregator.name=median"],
    "trimmed_mean 0.1": ["algo.aggregator.name=trimmed_mean"],
    "krum f=1": ["algo.aggregator.name=krum"],
    "multikrum f=1": ["algo.aggregator.name=multikrum"],
}


def poisoned_factory(factor: float | None) -> Any:
    """The embedded runtime, with client 0 scaling its updates by ``factor``."""

    def make(setup: Any, store: Any, ledger: Any) -> Any:
        fed = embedded_federation(setup, store, ledger)
        if factor is not None:
            fed.handlers = poison_handlers(fed.handlers, {ATTACKER}, factor)
        return fed

    return make


def run_one(out: Path, agg: list[str], factor: float | None, seed: int, rounds: int) -> dict:
    """One run; returns its final accuracy, rejected replies and the round it stopped at."""
    cfg = load_config(
        "tabular-fedavg",
        [
            "name=r",
            f"out_dir={out}",
            f"seed={seed}",
            f"rounds={rounds}",
            "plots=false",
            "algo.personal_eval=false",
            *agg,
        ],
    )
    stopped = None
    try:
        Engine(cfg, overwrite=True, progress=False, federation=poisoned_factory(factor)).run()
    except TooFewClientsError as e:
        stopped = int(str(e).split(":")[0].split()[-1])
    rows = [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    failures = out / "r" / "failures.jsonl"
    rejected = len(failures.read_text().splitlines()) if failures.exists() else 0
    acc = [r["acc"] for r in rows if "acc" in r][-1]
    return {"acc": acc, "rejected": rejected, "stopped": stopped}


def cell(results: list[dict]) -> str:
    done = [r["acc"] for r in results if r["stopped"] is None]
    stops = [r["stopped"] for r in results if r["stopped"] is not None]
    if not done:
        return f"stop@r{min(stops)}"
    text = f"{statistics.mean(done):.3f}"
    return text + (f" ({len(stops)}x stop)" if stops else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("fedfm").setLevel(logging.ERROR)  # rejected replies are counted below
    t0 = time.perf_counter()
    res: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for agg_name, agg in AGGREGATORS.items():
            for attack, factor in ATTACKS.items():
                res[(agg_name, attack)] = [
                    run_one(Path(tmp), agg, factor, s, args.rounds) for s in args.seeds
                ]
    wall = time.perf_counter() - t0
    print(
        f"tabular-fedavg, 10 clients, client {ATTACKER} poisons, {args.rounds} rounds,"
        f" seeds {args.seeds}; wall {wall:.0f} s"
    )
    head = f"| {'aggregator':<20} | " + " | ".join(f"{a:>16}" for a in ATTACKS) + " |"
    rule = "|" + "-" * 22 + "|" + "|".join("-" * 18 for _ in ATTACKS) + "|"
    for title, fmt in (
        ("test accuracy (mean over seeds)", cell),
        ("replies rejected (all rounds and seeds)", lambda rs: str(sum(r["rejected"] for r in rs))),
    ):
        print(f"\n{title}\n{head}\n{rule}")
        for agg_name in AGGREGATORS:
            cells = [fmt(res[(agg_name, a)]) for a in ATTACKS]
            print(f"| {agg_name:<20} | " + " | ".join(f"{c:>16}" for c in cells) + " |")
    clean = statistics.mean(r["acc"] for r in res[("fedavg (mean)", "clean")])
    worst = min(
        statistics.mean(r["acc"] for r in res[(agg_name, attack)])
        for agg_name in AGGREGATORS
        if agg_name != "fedavg (mean)"
        for attack in ATTACKS
        if attack != "clean"
    )
    print(f"\nworst robust accuracy under attack / clean FedAvg accuracy: {worst / clean:.3f}")


if __name__ == "__main__":
    main()
