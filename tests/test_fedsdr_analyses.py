"""FedSDR's analyses: the server's pairwise cosines of client updates (by hand) and
``fedfm analyze`` on a tiny finished run."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import toy
from fedfm.algorithms.fedavg import FedAvg, FedAvgFamilyConfig, Scaffold, ScaffoldConfig
from fedfm.config import load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.messages import Message
from fedfm.eval.compare import UpdateCosines

# Client deltas on nn.Linear(4, 1) (weight: 4 values, bias: 1), flattened over 5 values:
# "0": Δ = 1 everywhere; "1": Δ = 2 on the weight only; "2": Δ = −1 everywhere.
# cos(0, 1) = (2·4) / (√5 · √16) = 2/√5; cos(0, 2) = −1; cos(1, 2) = −2/√5.
DELTAS = {
    "0": {"weight": 1.0, "bias": 1.0},
    "1": {"weight": 2.0, "bias": 0.0},
    "2": {"weight": -1.0, "bias": -1.0},
}


def _fedavg(**algo: Any) -> FedAvg:
    run = load_config({"task": {"kind": "toy", "num_clients": 3}})
    task = toy.ToyTask(toy.ToyConfig(num_clients=3), run)
    return FedAvg(FedAvgFamilyConfig(**algo), task, run)


def _reply(cid: str, msg: Message) -> Message:
    params = {k: v + DELTAS[cid][k] for k, v in msg.arrays["params"].items()}
    return Message("train", {"params": params}, {"num_examples": 2, "loss": 0.0})


def test_update_cosines_of_a_fedavg_round_by_hand() -> None:
    algo = _fedavg(update_cosines=True)
    metrics = algo.round(FakeFederation(["0", "1", "2"], _reply, kinds=algo.messages))
    # (2/√5 − 1 − 2/√5) / 3 = −1/3
    assert metrics["update_cos/mean"] == pytest.approx(-1 / 3)
    assert metrics["update_cos/min"] == pytest.approx(-1.0)
    two = _fedavg(update_cosines=True)
    only = two.round(FakeFederation(["0", "1"], _reply, kinds=two.messages))
    assert only["update_cos/mean"] == pytest.approx(2 / math.sqrt(5))
    assert only["update_cos/min"] == only["update_cos/mean"]


def test_update_cosines_are_off_by_default_and_need_two_clients() -> None:
    algo = _fedavg()
    metrics = algo.round(FakeFederation(["0", "1"], _reply, kinds=algo.messages))
    assert not any(k.startswith("update_cos/") for k in metrics)
    ups = UpdateCosines({"w": torch.zeros(2)})
    ups.add("a", {"w": torch.ones(2)})
    assert ups.result() == {}


def test_scaffold_update_cosines_use_the_sent_deltas() -> None:
    run = load_config({"task": {"kind": "toy", "num_clients": 2}})
    task = toy.ToyTask(toy.ToyConfig(num_clients=2), run)
    algo = Scaffold(ScaffoldConfig(update_cosines=True), task, run)

    def reply(cid: str, msg: Message) -> Message:
        p: dict[str, Tensor] = msg.arrays["params"]
        dy = {k: torch.full_like(v, DELTAS[cid][k]) for k, v in p.items()}
        dc = {k: torch.zeros_like(v) for k, v in msg.arrays["control"].items()}
        return Message("train", {"delta_y": dy, "delta_c": dc}, {"num_examples": 2, "loss": 0.0})

    metrics = algo.round(FakeFederation(["0", "1"], reply, kinds=algo.messages))
    assert metrics["update_cos/mean"] == pytest.approx(2 / math.sqrt(5))
