"""What SecAgg+ costs a round: time, uplink bytes, and the error of the unmasked sum.

One FedAvg exchange over the quickstart's LoRA adapter (SmolLM2-135M, r = 8 on q, k, v and
o of 30 layers: 921,600 parameters, float32) from ``--clients`` clients, each through
fedfm's client call path (:func:`fedfm.core.federation.dispatch`, the message checks, the
audit ledger), plain and under SecAgg+ (:func:`fedfm.core.secagg.secure_round`). Clients
return a fixed update instead of training, so the time is the exchange and aggregation
alone: the protocol's overhead against the cheapest plain round (a LoRA client's local
training, the same in both, comes on top of both). Printed per client count: seconds per
round (median of ``--repeats``), uplink bytes per round from the audit ledger, their ratios,
and the largest error of the unmasked weighted mean Δ against the plain one beside the bound
that follows from ``n·2c/(Q−1)`` on the sum. Run ``uptime`` beside it: timings on a loaded
machine compare only within one run.

Usage: .venv/bin/python benchmarks/secagg.py [--clients 10 50] [--repeats 1]
    [--shares 1.0 12] [--threshold 0.6 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fedfm.core.aggregate import mean_delta
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientContext, dispatch
from fedfm.core.messages import Message, MessageKind
from fedfm.core.secagg import ClientSecAgg, SecAgg, resolve, secure_kinds, secure_round
from fedfm.core.settings import SecAggConfig
from fedfm.core.state import ClientState

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

    def __init__(self, n: int, cfg: SecAggConfig, secure: bool) -> None:
        self.base = adapter()
        gen = torch.Generator().manual_seed(n)
        self.updates = [
            {k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in self.base.items()}
            for _ in range(n)
        ]
        self.sizes = [100 + 10 * i for i in range(n)]
        kinds = {"train": TRAIN}
        if secure:
            kinds = secure_kinds(kinds, {"train": "params"}, dp=False)
        inner = {"train": self._train}
        client = ClientSecAgg(SecAgg(cfg, 0, 0, True))
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


def one(n: int, shares: float, threshold: float, repeats: int) -> None:
    """Prints the plain and secure rounds of ``n`` clients."""
    cfg = SecAggConfig(
        num_shares=int(shares) if shares > 1 else shares,
        reconstruction_threshold=int(threshold) if threshold > 1 else threshold,
    )
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
        f"{n} clients, {d:,} parameters, shares={sa.shares} t={sa.threshold}:"
        f" plain {p:.3f} s, secagg+ {s:.3f} s (x{s / p:.2f});"
        f" uplink plain {p_bytes:,} B, secagg+ {s_bytes:,} B (x{s_bytes / p_bytes:.3f});"
        f" max |Δ_secagg − Δ_plain| = {err:.3g} (bound {bound:.3g})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 12])
    ap.add_argument("--threshold", type=float, nargs="+", default=[0.6, 7])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    for n, k, t in zip(args.clients, args.shares, args.threshold, strict=True):
        one(n, k, t, args.repeats)


if __name__ == "__main__":
    main()
