"""One poisoning client among ten tabular clients: FedAvg breaks, the robust aggregators hold.

A fast version of ``benchmarks/poisoning.py`` (one seed, 6 rounds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.config import load_config
from fedfm.core.attacks import poison_handlers, scale_update
from fedfm.engine import Engine
from fedfm.errors import TooFewClientsError
from fedfm.runtime.embedded import embedded_federation
from helpers import toy  # noqa: F401  (registers the toy task)

ROBUST = [
    ["algo.aggregator.clip_norm=median"],
    ["algo.aggregator.clip_norm=1.0"],
    ["algo.aggregator.name=median"],
    ["algo.aggregator.name=trimmed_mean"],
    ["algo.aggregator.name=krum"],
    ["algo.aggregator.name=multikrum"],
    ["algo.aggregator.name=median", "algo.server_opt.name=fedavgm"],
]


def _run(out: Path, factor: float | None, overrides: list[str]) -> dict[str, Any]:
    cfg = load_config(
        "tabular-fedavg",
        [
            "name=p",
            f"out_dir={out}",
            "rounds=6",
            "plots=false",
            "algo.personal_eval=false",
            *overrides,
        ],
    )

    def make(setup: Any, store: Any, ledger: Any) -> Any:
        fed = embedded_federation(setup, store, ledger)
        if factor is not None:
            fed.handlers = poison_handlers(fed.handlers, {"0"}, factor)
        return fed

    summary = Engine(cfg, overwrite=True, progress=False, federation=make).run()
    return {"acc": summary["final"]["acc"], "failed": summary["failed_clients"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> float:
    return _run(tmp_path_factory.mktemp("clean"), None, [])["acc"]


def test_attack_updates_are_scaled_against_what_was_sent():
    sent = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor([3])}
    got = {"w": torch.tensor([1.5, 0.0]), "n": torch.tensor([4])}
    assert scale_update(sent, got, -10)["w"].tolist() == [-4.0, 11.0]
    assert scale_update(sent, got, -10)["n"].tolist() == [4]  # integers are left alone
    scaled = scale_update(None, got, 1e30)["w"]  # no parameters sent: a delta, scaled as it is
    assert scaled.tolist() == pytest.approx([1.5e30, 0.0]) and scaled.dtype == torch.float32


def test_a_scaled_update_stops_fedavg_but_its_failures_are_logged(tmp_path, clean):
    assert clean > 0.9
    with pytest.raises(TooFewClientsError, match="round 2: only 0 of 10 clients answered"):
        _run(tmp_path, 1e30, [])
    fails = [json.loads(x) for x in (tmp_path / "p" / "failures.jsonl").read_text().splitlines()]
    assert len(fails) == 10 and all("'loss' must be finite" in f["error"] for f in fails)


def test_a_sign_flip_degrades_fedavg(tmp_path, clean):
    try:
        acc = _run(tmp_path, -10.0, [])["acc"]
    except TooFewClientsError:
        return  # it diverged: worse than degraded
    assert acc < clean - 0.05


@pytest.mark.parametrize("overrides", ROBUST, ids=lambda o: " ".join(o))
@pytest.mark.parametrize("factor", [1e30, -10.0], ids=["scaled", "sign-flip"])
def test_robust_aggregators_stay_near_the_clean_run(tmp_path, clean, overrides, factor):
    got = _run(tmp_path, factor, overrides)
    assert got["failed"] == 0  # no honest client was driven to NaN and rejected
    assert got["acc"] >= clean - 0.06


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold", "fedekd", "fedkd-ungated"])
def test_every_aggregating_algorithm_takes_the_aggregator(tmp_path, algorithm):
    """The same attack breaks the plain mean and not the median, whatever the algorithm."""

    def run(name: str, agg: dict[str, Any]) -> dict[str, Any]:
        cfg = load_config(
            {
                "name": name,
                "algorithm": algorithm,
                "algo": {"aggregator": agg},
                "rounds": 2,  # the poisoned mean of round 1 turns every round-2 reply NaN
                "task": {"kind": "toy"},
                "out_dir": str(tmp_path),
                "plots": False,
                "train": {"steps": 5, "batch_size": 8, "lr": 0.05},
            }
        )

        def make(setup: Any, store: Any, ledger: Any) -> Any:
            fed = embedded_federation(setup, store, ledger)
            fed.handlers = poison_handlers(fed.handlers, {"0"}, 1e30)
            return fed

        return Engine(cfg, progress=False, federation=make).run()

    try:
        plain = run("plain", {})["failed_clients"]
    except TooFewClientsError:
        plain = -1  # every client was driven to NaN
    assert plain != 0
    assert run("median", {"name": "median"})["failed_clients"] == 0
