"""Server halves alone: algorithms against a FakeFederation, aggregates checked by hand.

No engine and no runtime: each test builds an algorithm on the toy task, sets its server
state to small numbers, lets canned clients answer one round and checks the result.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fedfm.algorithms.fedavg import FedAvg, FedAvgConfig, Scaffold, ScaffoldConfig
from fedfm.algorithms.fedekd import FedeKD, FedeKDConfig
from fedfm.config import load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientInfo
from fedfm.core.messages import Message
from fedfm.errors import MessageError, TooFewClientsError
from helpers import toy


def _setup(**run: Any) -> tuple[Any, Any]:
    cfg = load_config({"task": {"kind": "toy", "num_clients": 4}, **run})
    return toy.ToyTask(toy.ToyConfig(num_clients=4), cfg), cfg


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs)


def _train_reply(w: torch.Tensor, n: int, loss: float) -> Message:
    return Message("train", {"params": {"w": w}}, {"num_examples": n, "loss": loss})


def test_fedavg_round_by_hand() -> None:
    task, run = _setup()
    algo = FedAvg(FedAvgConfig(), task, run)
    algo.params = {"w": t(1.0, 2.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    answers = {"0": _train_reply(t(3.0, 2.0), 1, 0.5), "1": _train_reply(t(1.0, 6.0), 3, 1.0)}

    def reply(cid: str, msg: Message) -> Message:
        if cid == "2":
            raise RuntimeError("disk full")
        if cid == "3":  # a reply of the wrong shape is refused
            return _train_reply(t(1.0, 2.0, 3.0), 5, 0.0)
        return answers[cid]

    fed = FakeFederation(["0", "1", "2", "3"], reply, kinds=algo.messages)
    metrics = algo.round(fed)
    # Δ = 1/4·([3,2]−[1,2]) + 3/4·([1,6]−[1,2]) = 1/4·[2,0] + 3/4·[0,4] = [0.5, 3]; θ + Δ
    torch.testing.assert_close(algo.params["w"], t(1.5, 5.0))
    # train_loss = (1·0.5 + 3·1.0) / 4; update_norm = ‖[1.5, 5] − [1, 2]‖ = √(0.5² + 3²)
    assert metrics == {"train_loss": 0.875, "clients": 2, "update_norm": pytest.approx(9.25**0.5)}
    assert {f["client"]: f["error"] for f in fed.failures} == {
        "2": "RuntimeError: disk full",
        "3": "update rejected: client 3: field params.w: shape (3,), expected (2,)",
    }
    # Every client was sent the global parameters of the round.
    assert [(c, m.kind) for _, c, m in fed.sent] == [(c, "train") for c in "0123"]
    assert all(torch.equal(m.arrays["params"]["w"], t(1.0, 2.0)) for _, _, m in fed.sent)
    # The audit ledger holds the downlink of all four, the uplink of the two valid clients
    # (one row per field: params, num_examples, loss).
    rows = [(r["client"], r["direction"]) for r in fed.ledger.pending]
    assert {r for r in rows if r[1] == "up"} == {("0", "up"), ("1", "up")}
    assert rows.count(("0", "up")) == 3 and {c for c, d in rows if d == "down"} == set("0123")


def test_fedavg_with_server_momentum_by_hand() -> None:
    task, run = _setup()
    cfg = FedAvgConfig.model_validate({"server_opt": {"name": "fedavgm", "momentum": 0.5}})
    algo = FedAvg(cfg, task, run)
    algo.params = {"w": t(1.0, 2.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    answers = {"0": _train_reply(t(3.0, 2.0), 1, 0.5), "1": _train_reply(t(1.0, 6.0), 3, 1.0)}
    fed = FakeFederation(["0", "1"], answers, kinds=algo.messages)
    algo.round(fed)
    # m = Δ = [0.5, 3]; θ = [1.5, 5]
    torch.testing.assert_close(algo.params["w"], t(1.5, 5.0))
    fed.rnd = 2
    algo.round(fed)  # the same replies: Δ = [3,2]·1/4 + [1,6]·3/4 − [1.5,5] = [0, 0]
    # m = 0.5·[0.5, 3] + [0, 0] = [0.25, 1.5]; θ = [1.75, 6.5]: momentum carries on
    torch.testing.assert_close(algo.params["w"], t(1.75, 6.5))


def test_too_few_replies_and_undeclared_fields_are_refused() -> None:
    task, run = _setup(clients={"min_clients": 2})
    algo = FedAvg(FedAvgConfig(), task, run)
    fed = FakeFederation(["0", "1"], {"0": _train_reply(t(1.0), 1, 0.0)}, kinds=algo.messages)
    algo.params = {"w": t(0.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    with pytest.raises(TooFewClientsError, match="only 1 of 2 clients answered"):
        algo.round(fed)
    assert fed.failures[0]["error"] == "client 1: no canned reply to 'train'"
    with pytest.raises(MessageError, match="undeclared array field 'extra'"):
        fed.send({"0": Message("train", {"extra": {}})})


def test_scaffold_round_by_hand() -> None:
    task, run = _setup()
    algo = Scaffold(ScaffoldConfig(lr_global=1.0), task, run)
    algo.params, algo.control = {"w": t(1.0, 2.0)}, {"w": t(0.0, 0.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0

    def reply(cid: str, msg: Message) -> Message:
        if cid in ("2", "3"):
            raise RuntimeError("offline")
        dy, dc, n = {"0": (t(2.0, 0.0), t(1.0, 1.0), 1), "1": (t(0.0, 4.0), t(3.0, -1.0), 3)}[cid]
        return Message(
            "train", {"delta_y": {"w": dy}, "delta_c": {"w": dc}}, {"num_examples": n, "loss": 1.0}
        )

    fed = FakeFederation(["0", "1", "2", "3"], reply, kinds=algo.messages)
    metrics = algo.round(fed)
    # x ← x + η_g·Σ (n_i/n)·Δy_i = [1,2] + 1/4·[2,0] + 3/4·[0,4] = [1.5, 5]
    torch.testing.assert_close(algo.params["w"], t(1.5, 5.0))
    # c ← c + (|S|/N)·mean Δc_i = 0 + (2/4)·([1,1] + [3,−1])/2 = [1, 0]
    torch.testing.assert_close(algo.control["w"], t(1.0, 0.0))
    assert metrics["clients"] == 2
    _, _, sent = fed.sent[0]
    assert set(sent.arrays) == {"params", "control"}


def test_fedekd_round_by_hand() -> None:
    task, run = _setup()
    algo = FedeKD(FedeKDConfig(), task, run)
    algo.proxy = {"w": t(1.0, 2.0)}
    proxies = {"0": (t(3.0, 2.0), 1), "1": (t(1.0, 6.0), 3)}
    backward = {"0": (0.2, 0.5, 0.1, 0.9), "1": (0.6, 1.5, 0.3, 0.7)}  # loss, energy, gates

    def reply(cid: str, msg: Message) -> Message:
        if cid == "2":
            raise RuntimeError("crashed")
        w, n = proxies[cid]
        if msg.kind == "forward":
            return Message("forward", {"proxy": {"w": w}}, {"num_examples": n, "loss": float(n)})
        loss, energy, lo, hi = backward[cid]
        meta = {"num_examples": n, "loss": loss, "energy": energy, "gate_min": lo, "gate_max": hi}
        return Message("backward", meta=meta)

    fed = FakeFederation(["0", "1", "2"], reply, kinds=algo.messages)
    metrics = algo.round(fed)
    # The global proxy is the example-weighted mean: [1,2] + [0.5, 3] = [1.5, 5] ...
    torch.testing.assert_close(algo.proxy["w"], t(1.5, 5.0))
    # ... and the backward stage goes, with it, to the clients whose forward reply came.
    assert [(c, m.kind) for _, c, m in fed.sent] == [
        ("0", "forward"), ("1", "forward"), ("2", "forward"), ("0", "backward"), ("1", "backward"),
    ]  # fmt: skip
    torch.testing.assert_close(fed.sent[-1][2].arrays["proxy"]["w"], t(1.5, 5.0))
    assert metrics == pytest.approx(
        {
            "forward_loss": (1 * 1.0 + 3 * 3.0) / 4,
            "train_loss": (1 * 0.2 + 3 * 0.6) / 4,
            "energy": (1 * 0.5 + 3 * 1.5) / 4,
            "gate_min": 0.1,
            "gate_max": 0.9,
            "clients": 2,
        }
    )


def test_fake_federation_roles_and_canned_replies_by_kind() -> None:
    fed = FakeFederation(
        [ClientInfo("a", "strong"), "b"],
        {("a", "ping"): Message("ping", meta={"x": 1}), "b": Message("ping", meta={"x": 2})},
    )
    assert fed.client_ids("strong") == ["a"] and fed.role_of("b") == "default"
    out = fed.broadcast(Message("ping"), ["a", "b"])
    assert {c: r.meta["x"] for c, r in out.items()} == {"a": 1, "b": 2}
    assert [c for c, _ in fed.stream({"b": Message("ping"), "a": Message("ping")})] == ["b", "a"]
