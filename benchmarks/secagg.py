"""What SecAgg+ costs a round: time, uplink bytes, and the error of the unmasked sum.

Four parts (``--parts``); every timing is a ratio of two runs made back to back in one
process, so a figure taken on a loaded machine still compares like with like. Each part
prints ``uptime``'s load beside its lines; a clean figure needs a quiet machine.

``round``: a round **with training** on the embedded runtime. The quickstart preset
(FedIT: SmolLM2-135M-Instruct, LoRA r = 8 on q, k, v, o: 921,600 parameters) with
``--clients`` clients (``partition: iid``, 12 training items each, ``--steps`` local AdamW
steps, the quickstart's 6 by default), built by the engine plain and under SecAgg+; each
of ``--repeats`` rounds is ``algo.round`` on the embedded federation (sampling, local
training, the exchange, aggregation, the server step; no evaluation, no run folder), timed;
printed: the median round, round 1's uplink bytes and the ratios.
``privacy.secagg.max_weight`` is 1, so every client weighs 1 inside the masked vector as in
the plain mean (the shards are equal). The largest error of round 1's
global adapter against the plain run's is printed beside its bound ``(b + c·b)/(n − b)``,
``b = n·2c/(Q−1)`` (the sum's and the weight's error; ``|Δ| ≤ c`` within range).

``exchange``: the exchange alone. Clients return a fixed update instead of training
(fedfm's client call path, message checks, audit ledger), plain and under SecAgg+
(:func:`fedfm.core.secagg.secure_round`); the same error and bound.

``ddg``: the exchange with client-side DP-FedAvg's distributed discrete Gaussian
(:mod:`fedfm.core.ddg`), fixed updates of norm above the clip ``C = 1``: with the noise off,
the largest L2 error of the unmasked sum against the plain sum of the clipped updates, beside
its bound ``n·γ·√D``; with ``z = 1`` over ``min_clients = n``, the decoded noise's std beside
the stated ``√n·σ`` (``σ = z·C/√n``), and the time against the plain exchange.

``deploy``: the quickstart round with training on Flower's deployment engine, 3 SuperNodes
on 127.0.0.1 (``benchmarks/deploy_overhead.py`` starts them the same way), plain and under
SecAgg+: round 1's time and the ratio.

Usage: .venv/bin/python benchmarks/secagg.py [--parts round exchange ddg deploy]
    [--clients 10 50] [--repeats 1] [--shares 1.0 12] [--threshold 0.6 7]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfm.config import load_config
from fedfm.core import ddg as G
from fedfm.core.aggregate import mean_delta
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientContext, dispatch
from fedfm.core.messages import Message, MessageKind
from fedfm.core.secagg import (
    ClientSecAgg,
    SecAgg,
    resolve,
    secure_kinds,
    secure_round,
    secure_sum,
)
from fedfm.core.settings import SecAggConfig
from fedfm.core.state import ClientState, ClientStateStore

TRAIN = MessageKind(
    "train", down_arrays=("params",), up_arrays=("params",), up_meta=("num_examples", "loss")
)
HIDDEN, KV, LAYERS, RANK = 576, 192, 30, 8  # SmolLM2-135M: GQA k/v project to 3×64


def adapter() -> dict[str, torch.Tensor]:
    """Zero LoRA A/B tensors of the quickstart's adapter (921,600 parameters)."""
    out = {}
    for layer in range(LAYERS):
        for mod, width in (("q", HIDDEN), ("k", KV), ("v", KV), ("o", HIDDEN)):
            out[f"{layer}.{mod}.A"] = torch.zeros(RANK, HIDDEN)
            out[f"{layer}.{mod}.B"] = torch.zeros(width, RANK)
    return out


class Bench:
    """``n`` clients that answer a ``train`` message with a fixed update each."""

    def __init__(
        self, n: int, cfg: SecAggConfig, secure: bool, plan: Any = None, scale: float = 1e-3
    ) -> None:
        self.base = adapter()
        gen = torch.Generator().manual_seed(n)
        self.updates = [
            {k: scale * torch.randn(v.shape, generator=gen) for k, v in self.base.items()}
            for _ in range(n)
        ]
        self.sizes = [100 + 10 * i for i in range(n)]
        kinds = {"train": TRAIN.as_private() if plan is not None else TRAIN}
        if secure:
            kinds = secure_kinds(kinds, {"train": "params"}, dp=plan is not None)
        inner = {"train": self._train}
        client = ClientSecAgg(SecAgg(cfg, 0, 0, plan is None), plan)
        self.handlers = client.handlers(inner, kinds) if secure else inner
        self.kinds = kinds
        self.states = {str(i): ClientState() for i in range(n)}
        self.fed = FakeFederation(list(self.states), self._reply, kinds=kinds.values())

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        i, sent = int(ctx.cid), msg.arrays["params"]
        trained = {k: sent[k] + self.updates[i][k] for k in sent}
        return Message("train", {"params": trained}, {"num_examples": self.sizes[i], "loss": 0.0})

    def _reply(self, cid: str, msg: Message) -> Message:
        ctx = ClientContext(cid, "default", self.fed.rnd, 0, None, self.states[cid])  # type: ignore[arg-type]
        return dispatch(self.handlers, self.kinds, ctx, msg)

    def messages(self) -> dict[str, Message]:
        return {c: Message("train", {"params": self.base}) for c in self.states}

    def clipped_sum(self, clip: float) -> np.ndarray:
        """Σ of the updates clipped to ``clip`` in L2 (float64, flat)."""
        out = np.zeros(sum(v.numel() for v in self.base.values()))
        for u in self.updates:
            x = flat(u)
            out += x * min(1.0, clip / float(np.linalg.norm(x)))
        return out

    def plain_round(self) -> dict[str, torch.Tensor]:
        acc = mean_delta(self.base)
        msgs = {c: Message("train", {"params": self.base}) for c in self.states}
        for _, r in self.fed.stream(msgs, like={"params": self.base}):
            acc.add(r.arrays["params"], float(r.meta["num_examples"]))  # type: ignore[arg-type]
        return acc.result()

    def secure_round(self, sa: SecAgg) -> dict[str, torch.Tensor]:
        acc = mean_delta(self.base)
        msgs = {c: Message("train", {"params": self.base}) for c in self.states}
        secure_round(self.fed, sa, msgs, "params", self.base, acc)
        return acc.result()


def timed(fn, rnd: int, bench: Bench) -> tuple[float, dict[str, torch.Tensor], int]:  # type: ignore[no-untyped-def]
    bench.fed.rnd = rnd
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out, bench.fed.ledger.round_bytes(rnd)["bytes_up"]


def flat(arrays: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([arrays[k].double().flatten().numpy() for k in sorted(arrays)])


def secagg_config(shares: float, threshold: float, **kw: Any) -> SecAggConfig:
    """``privacy.secagg`` with a share count and threshold (integers, or fractions)."""
    return SecAggConfig(
        num_shares=int(shares) if shares > 1 else shares,
        reconstruction_threshold=int(threshold) if threshold > 1 else threshold,
        **kw,
    )


def load() -> str:
    """``uptime``'s load averages."""
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def exchange(n: int, shares: float, threshold: float, repeats: int) -> None:
    """Prints the plain and secure exchanges of ``n`` clients (fixed updates, no training)."""
    cfg = secagg_config(shares, threshold)
    sa = resolve(cfg, n, n, weighted=True)
    plain, secure = Bench(n, cfg, False), Bench(n, cfg, True)
    pt, st = [], []
    for rep in range(1, repeats + 1):
        t, p_delta, p_bytes = timed(plain.plain_round, rep, plain)
        pt.append(t)
        t, s_delta, s_bytes = timed(lambda: secure.secure_round(sa), rep, secure)
        st.append(t)
    p, s = statistics.median(pt), statistics.median(st)
    r = np.array([min(1.0, x / cfg.max_weight) for x in plain.sizes])
    want = flat(p_delta)
    err = float(np.abs(flat(s_delta) - want).max())
    b = sa.bound(n)
    bound = (b + np.abs(want).max() * b) / (r.sum() - b)
    d = sum(v.numel() for v in plain.base.values())
    print(
        f"exchange: {n} clients, {d:,} parameters, shares={sa.shares} t={sa.threshold}:"
        f" plain {p:.3f} s, secagg+ {s:.3f} s (x{s / p:.2f});"
        f" uplink plain {p_bytes:,} B, secagg+ {s_bytes:,} B (x{s_bytes / p_bytes:.3f});"
        f" max |Δ_secagg − Δ_plain| = {err:.3g} (bound {bound:.3g})"
    )


# ----------------------------------------------------------------------------- ddg


class FixedPlan:
    """A client's discrete Gaussian plan (as :meth:`fedfm.core.userdp.UserDP.ddg_plan`)."""

    noise = "secret"

    def __init__(self, ddg: G.DDG) -> None:
        self.ddg = ddg

    def ddg_plan(self, dim: int) -> G.DDG:
        return self.ddg


def ddg(n: int, shares: float, threshold: float, repeats: int) -> None:
    """Prints the DDG exchange of ``n`` clients: its error with the noise off and on."""
    cfg = secagg_config(shares, threshold)
    d = sum(v.numel() for v in adapter().values())
    for sigma in (0.0, 1.0 / math.sqrt(n)):  # z = 1, C = 1, min_clients = n
        plan = G.plan(1.0, sigma, cfg.modulus_range, d, n, n)
        sa = replace_ddg(resolve(cfg, n, n, weighted=False, ddg=True), plan)
        bench = Bench(n, cfg, True, plan=FixedPlan(plan), scale=0.01)
        plain = Bench(n, cfg, False, scale=0.01)
        times, ptimes = [], []
        for rep in range(1, repeats + 1):
            bench.fed.rnd = plain.fed.rnd = rep
            t0 = time.perf_counter()
            plain.plain_round()
            ptimes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = secure_sum(bench.fed, sa, bench.messages(), bench.base)
            times.append(time.perf_counter() - t0)
        err = flat(got.total) - bench.clipped_sum(1.0)
        p, s = statistics.median(ptimes), statistics.median(times)
        head = (
            f"ddg: {n} clients, d={d:,} (D={plan.rotated:,}), gamma={plan.gamma:.3g},"
            f" plain {p:.3f} s, secagg+ ddg {s:.3f} s (x{s / p:.2f});"
        )
        if sigma == 0:
            bound = n * plan.gamma * math.sqrt(plan.rotated)
            print(f"{head} noise off: |sum_ddg - sum_clipped|_2 = {np.linalg.norm(err):.3g}"
                  f" (bound n*gamma*sqrt(D) = {bound:.3g})")  # fmt: skip
        else:
            want = math.sqrt(n * (sigma**2 + plan.gamma**2 / 4))
            print(f"{head} z=1: std(sum_ddg - sum_clipped) = {err.std():.5g}"
                  f" (stated sqrt(n*(sigma^2 + gamma^2/4)) = {want:.5g}),"
                  f" max |error| = {np.abs(err).max():.3g}")  # fmt: skip


def replace_ddg(sa: SecAgg, plan: G.DDG) -> SecAgg:
    from dataclasses import replace

    return replace(sa, ddg=plan)


# ----------------------------------------------------------------------------- rounds


def round_overrides(
    out: Path, name: str, n: int, secure: bool, cfg: SecAggConfig, steps: int = 6
) -> list[str]:
    """The quickstart with ``n`` iid clients of 12 items each."""
    over = [
        f"name={name}",
        f"out_dir={out}",
        "rounds=2",
        "eval_every=1000",
        "eval_before=false",
        "task.max_eval=4",
        "partition.scheme=iid",
        f"partition.num_clients={n}",
        f"task.source_options.per_domain_train={3 * n}",
        f"train.steps={steps}",
        "clients.min_clients=1",
        "plots=false",
        "log.html=false",
    ]
    if secure:
        over += [
            "privacy.secure_aggregation=secagg+",
            f"privacy.secagg.num_shares={cfg.num_shares}",
            f"privacy.secagg.reconstruction_threshold={cfg.reconstruction_threshold}",
            "privacy.secagg.max_weight=1",
        ]
    return over


def round_row(folder: Path, rnd: int = 1) -> dict[str, Any]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["round"] == rnd)


def timed_rounds(over: list[str], repeats: int, tmp: Path) -> tuple[list[float], int, np.ndarray]:
    """Rounds 1..``repeats`` of a built run, each timed; round 1's uplink and adapter.

    The engine's own steps (the run's build, its federation, ``algo.round``) without the
    run folder's logs and evaluation, so that each time is one round with training.
    """
    from fedfm.core.audit import AuditLedger
    from fedfm.engine import build
    from fedfm.runtime.embedded import embedded_federation

    setup = build(load_config("quickstart", over))
    ledger = AuditLedger(None)
    fed = embedded_federation(setup, ClientStateStore(tmp / "states"), ledger)
    fed.rnd = 0
    setup.algo.setup(fed)
    times, adapter1, up = [], np.zeros(0), 0
    for rnd in range(1, repeats + 1):
        fed.rnd = rnd
        t0 = time.perf_counter()
        setup.algo.round(fed)
        times.append(time.perf_counter() - t0)
        if rnd == 1:
            up = int(ledger.round_bytes(1)["bytes_up"])
            adapter1 = flat(setup.algo.secure_base() or {})
    close = getattr(fed, "close", None)
    if close is not None:
        close()
    return times, up, adapter1


def training_round(n: int, shares: float, threshold: float, repeats: int, steps: int) -> None:
    """Prints rounds with training of the quickstart with ``n`` clients, plain and SecAgg+."""
    cfg = secagg_config(shares, threshold, max_weight=1.0)
    sa = resolve(cfg, n, n, weighted=True)
    got = {}
    with tempfile.TemporaryDirectory(prefix="fedfm-secagg-round-") as tmp:
        for secure in (False, True):
            name = "secure" if secure else "plain"
            over = round_overrides(Path(tmp), name, n, secure, cfg, steps)
            got[secure] = timed_rounds(over, repeats, Path(tmp) / name)
    (pt, up_p, plain_ad), (st, up_s, secure_ad) = got[False], got[True]
    p, s = statistics.median(pt), statistics.median(st)
    b = sa.bound(n)  # |Δ| ≤ clipping_range for a sum within the bound
    bound = (b + cfg.clipping_range * b) / (n - b)
    print(
        f"round: {n} clients, quickstart LoRA ({plain_ad.size:,} parameters), {steps} local"
        f" steps, shares={sa.shares} t={sa.threshold}: round plain {p:.2f} s, secagg+"
        f" {s:.2f} s (x{s / p:.3f}; median of {repeats}: plain {pt}, secagg+ {st});"
        f" uplink plain {up_p:,} B, secagg+ {up_s:,} B (x{up_s / up_p:.4f});"
        f" max |adapter_secagg - adapter_plain| after round 1 ="
        f" {np.abs(secure_ad - plain_ad).max():.3g} (bound {bound:.3g}) [{load()}]"
    )


# ----------------------------------------------------------------------------- deploy


def deploy_round(nodes: int, shares: float, threshold: float) -> None:
    """Prints round 1 of the quickstart on 3 loopback SuperNodes, plain and under SecAgg+."""
    from fedfm.runtime.flower import deploy as D
    from fedfm.runtime.flower import deploy_client as DC
    from fedfm.runtime.flower import processes as P

    cfg = secagg_config(shares, threshold, max_weight=1.0)
    took: dict[bool, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedfm-secagg-deploy-") as tmp:
        out = Path(tmp)
        for secure in (False, True):
            name = "secure" if secure else "plain"
            work, port, procs = out / f"work-{name}", P.free_port(), []
            try:
                for i in range(nodes):
                    procs += DC.start_client(
                        f"127.0.0.1:{port}", i, nodes, work / f"node{i}", work / "logs"
                    )
                over = [*round_overrides(out, name, nodes, secure, cfg), "runtime=flower"]
                D.serve(
                    load_config("quickstart", over),
                    overwrite=True,
                    options={"node_wait_s": 600, "timeout_s": 1200},
                    host="127.0.0.1",
                    port=port,
                    echo=False,
                    work_dir=work / "serve",
                    progress=False,
                )
            finally:
                P.stop(procs)
            took[secure] = float(round_row(out / name)["time_s"])
    p, s = took[False], took[True]
    print(
        f"deploy: {nodes} SuperNodes on 127.0.0.1, quickstart LoRA: round 1 plain {p:.2f} s,"
        f" secagg+ {s:.2f} s (x{s / p:.3f}) [{load()}]"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts", nargs="+", default=["round", "exchange", "ddg", "deploy"],
        choices=["round", "exchange", "ddg", "deploy"],
    )  # fmt: skip
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 12])
    ap.add_argument("--threshold", type=float, nargs="+", default=[0.6, 7])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="local steps (the quickstart's 6)")
    args = ap.parse_args()
    print(f"start [{load()}]")
    for part in args.parts:
        if part == "deploy":
            deploy_round(args.nodes, 1.0, 0.6)
            continue
        for n, k, t in zip(args.clients, args.shares, args.threshold, strict=True):
            if part == "round":
                training_round(n, k, t, args.repeats, args.steps)
            else:
                {"exchange": exchange, "ddg": ddg}[part](n, k, t, args.repeats)


if __name__ == "__main__":
    main()
