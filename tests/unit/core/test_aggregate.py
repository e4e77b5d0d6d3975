"""Streaming aggregation: running means equal the batch functions and the earlier formula."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import Tensor

from fedfm.algorithms.fedavg import FedAvg, FedAvgConfig
from fedfm.config import load_config
from fedfm.core.aggregate import (
    Buffered,
    ReplySum,
    RunningMean,
    aggregate_round,
    mean_delta,
    pseudo_gradient,
    weighted_mean,
)
from fedfm.core.fake import FakeFederation
from fedfm.core.messages import Message
from fedfm.core.optim import ScaffoldSums, scaffold_server_update
from fedfm.errors import TooFewClientsError
from helpers import toy


def _updates(dtype: torch.dtype, n: int = 7, seed: int = 0) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "a": (torch.randn(5, 3, generator=g) * 10).to(dtype),
            "b": torch.randn(4, generator=g).to(dtype),
        }
        for _ in range(n)
    ]


def _weights(n: int = 7) -> list[float]:
    return [
        float(w) for w in torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(1))
    ]


def _reference_pseudo_gradient(params, updates, weights) -> dict[str, Tensor]:
    """The formula before streaming: Σ_k (θ_k − θ)·(n_k/n), accumulated in float32/float64."""
    total = sum(weights)
    out = {}
    for name, p in params.items():
        cd = torch.promote_types(p.dtype, torch.float32)
        acc = torch.zeros(p.shape, dtype=cd)
        for u, w in zip(updates, weights, strict=True):
            acc += (u[name].to(cd) - p.to(cd)) * (w / total)
        out[name] = acc
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_streaming_equals_batch_exactly_and_the_earlier_formula_to_rounding(dtype) -> None:
    params, *updates = _updates(dtype, n=8)
    weights = _weights(7)
    acc = mean_delta(params)
    for u, w in zip(updates, weights, strict=True):  # one at a time, as replies arrive
        acc.add(u, w)
    streamed = acc.result()
    batch = pseudo_gradient(params, updates, weights)
    buffered = Buffered(params, pseudo_gradient)
    for u, w in zip(updates, weights, strict=True):
        buffered.add(u, w)
    ref = _reference_pseudo_gradient(params, updates, weights)
    eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    for name in params:
        assert torch.equal(streamed[name], batch[name])  # the same arithmetic, bit for bit
        assert torch.equal(buffered.result()[name], batch[name])
        assert streamed[name].dtype == ref[name].dtype
        scale = float(ref[name].abs().max()) + max(float(u[name].abs().max()) for u in updates)
        torch.testing.assert_close(streamed[name], ref[name], rtol=0, atol=16 * eps * scale)


def test_running_mean_keeps_dtypes_and_rounds_integers() -> None:
    ups = [
        {"w": torch.tensor([2.0]).bfloat16(), "n": torch.tensor([1])},
        {"w": torch.tensor([4.0]).bfloat16(), "n": torch.tensor([4])},
    ]
    acc = RunningMean("weighted_mean")
    for u, w in zip(ups, [1.0, 2.0], strict=True):
        acc.add(u, w)
    out = acc.result()
    # w: (1·2 + 2·4)/3 = 10/3 in bfloat16; n: (1·1 + 2·4)/3 = 3 after rounding
    assert out["w"].dtype == torch.bfloat16 and out["n"].tolist() == [3]
    assert all(torch.equal(out[k], weighted_mean(ups, [1.0, 2.0])[k]) for k in out)
    with pytest.raises(ValueError, match=r"weight 2 is -1\.0"):
        acc.add(ups[0], -1.0)
    with pytest.raises(ValueError, match=r"update 2 'w': shape \(2,\) does not match \(1,\)"):
        acc.add({"w": torch.zeros(2), "n": torch.tensor([1])}, 1.0)
    with pytest.raises(ValueError, match="no updates"):
        RunningMean("x").result()
    zero = RunningMean("x")
    zero.add({"w": torch.ones(1)}, 0.0)
    with pytest.raises(ValueError, match=r"total weight is 0\.0"):
        zero.result()


def test_scaffold_sums_equal_the_batch_update() -> None:
    x, *dys = _updates(torch.float32, n=5, seed=2)
    c, *dcs = _updates(torch.float32, n=5, seed=3)
    weights = _weights(4)
    sums = ScaffoldSums(x, c)
    for dy, dc, w in zip(dys, dcs, weights, strict=True):
        sums.add(dy, dc, w)
    got = sums.apply(num_clients_total=10, lr_global=0.5)
    want = scaffold_server_update(x, c, dys, dcs, weights, 10, 0.5)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_fedavg_holds_one_reply_at_a_time() -> None:
    """Each reply is released before the next one is made: the server streams."""
    cfg = load_config({"task": {"kind": "toy", "num_clients": 6}})
    algo = FedAvg(FedAvgConfig(), toy.ToyTask(toy.ToyConfig(num_clients=6), cfg), cfg)
    alive: list[weakref.ref] = []
    most = [0]

    def reply(cid: str, msg: Message) -> Message:
        most[0] = max(most[0], sum(r() is not None for r in alive))
        params = {k: v + 1.0 for k, v in msg.arrays["params"].items()}
        alive.extend(weakref.ref(t) for t in params.values())
        return Message("train", {"params": params}, {"num_examples": 2, "loss": 0.0})

    before = {k: v.clone() for k, v in algo.params.items()}
    algo.round(FakeFederation([str(i) for i in range(6)], reply, kinds=algo.messages))
    assert all(torch.allclose(algo.params[k], v + 1.0) for k, v in before.items())
    # While a reply is made, at most the previous one (the tensors of one client) is alive.
    assert most[0] <= len(before)


def _reply(w: float, n: int) -> Message:
    return Message("train", {"params": {"w": torch.tensor([w])}}, {"num_examples": n})


def test_the_one_aggregation_step_by_hand() -> None:
    # Δ = (1·(3 − 1) + 3·(−1 − 1))/4 = −1; a reply of another shape is a failure, not a term.
    base = {"w": torch.tensor([1.0])}
    answers = {"0": _reply(3.0, 1), "1": _reply(-1.0, 3), "2": Message("train", {"params": {}})}
    fed = FakeFederation(["0", "1", "2"], answers)
    msg = Message("train", {"params": base})
    seen: list[str] = []
    got = aggregate_round(
        fed, dict.fromkeys(answers, msg), "params", base, ReplySum(mean_delta(base)), 2,
        like={"params": base}, each=lambda cid, r: seen.append(cid),
    )  # fmt: skip
    assert got.result is not None and got.result["w"].tolist() == [-1.0]
    assert got.clients == seen == ["0", "1"] and got.metrics == {}
    assert [f["client"] for f in fed.failures] == ["2"]


def test_the_one_aggregation_step_requires_min_clients_and_leaves_an_empty_round() -> None:
    base = {"w": torch.tensor([1.0])}
    fed = FakeFederation(["0", "1"], {"0": _reply(3.0, 1)})  # "1" does not answer
    msgs = dict.fromkeys(["0", "1"], Message("train", {"params": base}))
    with pytest.raises(TooFewClientsError, match="round 1: only 1 of 2 clients answered"):
        aggregate_round(fed, msgs, "params", base, ReplySum(mean_delta(base)), 2)
    empty = aggregate_round(fed, {}, "params", base, ReplySum(mean_delta(base)), 2)
    assert empty.result is None and empty.clients == []  # nobody asked: the model stays
