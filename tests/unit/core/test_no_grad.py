"""Message kinds declared no_grad: a weak client's handler never runs backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message, MessageKind
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)

BACKWARD_CALLS: list[str] = []
LOG: dict[str, Any] = {}  # what the algorithm saw, read by the test


class StrongWeakClient(ClientHalf):
    """Strong clients train the received linear model; weak clients only score it."""

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.model = nn.Linear(4, 1)  # scratch: loaded from every message
        self.log = LOG

    def handlers(self) -> dict[str, Any]:
        return {"train": self._train, "vote": self._vote, "sneak": self._sneak}

    def _load(self, msg: Message) -> nn.Module:
        self.model.load_state_dict(msg.arrays["w"])
        self.model.requires_grad_(True)  # the handler does not choose: the kind does
        return self.model

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        model = self._load(msg)
        x, y = ctx.data
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        return Message(
            "train", {"w": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        )

    def _vote(self, ctx: ClientContext, msg: Message) -> Message:
        model = self._load(msg)
        x, _ = ctx.data
        scores = model(x).squeeze(-1)  # a forward pass: fine without gradients
        self.log.setdefault("vote_requires_grad", []).append(scores.requires_grad)
        ctx.state.arrays["last_scores"] = scores
        return Message("vote", {"votes": {"hist": torch.histc(scores, bins=4)}})

    def _sneak(self, ctx: ClientContext, msg: Message) -> Message:
        model = self._load(msg)
        x, y = ctx.data
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()  # must fail: this kind computes no gradients
        return Message("sneak", meta={"grad": float(model.weight.grad.abs().sum())})


class StrongWeak(Algorithm):
    """Strong clients train a linear model; weak clients only score it (no backprop)."""

    Client = StrongWeakClient
    messages = (
        MessageKind("train", down_arrays=("w",), up_arrays=("w",), roles=("strong",)),
        MessageKind(
            "vote", down_arrays=("w",), up_arrays=("votes",), roles=("weak",), no_grad=True
        ),
        MessageKind("sneak", down_arrays=("w",), up_meta=("grad",), roles=("weak",), no_grad=True),
    )

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        model = nn.Linear(4, 1)
        self.w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.log = LOG

    def round(self, fed: Federation) -> dict[str, float]:
        weak, strong = fed.client_ids("weak"), fed.client_ids("strong")
        before = len(BACKWARD_CALLS)
        votes = fed.broadcast(Message("vote", {"w": self.w}), weak)
        self.log["backward_in_weak"] = len(BACKWARD_CALLS) - before
        for reply in votes.values():
            reply.arrays["votes"]["hist"].mul_(2.0)  # the server may update replies in place
        sneaks = fed.broadcast(Message("sneak", {"w": self.w}), weak)
        self.log["sneak_replies"] = len(sneaks)
        before = len(BACKWARD_CALLS)
        trained = fed.broadcast(Message("train", {"w": self.w}), strong)
        self.log["backward_in_strong"] = len(BACKWARD_CALLS) - before
        self.w = next(iter(trained.values())).arrays["w"]
        return {"votes": float(sum(r.arrays["votes"]["hist"].sum() for r in votes.values()))}


if "test-strong-weak" not in ALGORITHMS:
    ALGORITHMS.register("test-strong-weak", "test: no-grad weak clients")(StrongWeak)


def test_weak_clients_never_backpropagate(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.autograd.backward

    def monitored(*args: Any, **kwargs: Any) -> Any:
        BACKWARD_CALLS.append("call")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", monitored)
    cfg = load_config(
        {
            "name": "roles",
            "algorithm": "test-strong-weak",
            "rounds": 1,
            "eval_before": False,
            "task": {"kind": "toy", "num_clients": 4},
            "clients": {"roles": {"strong": 0.5, "weak": 0.5}},
            "out_dir": str(tmp_path),
            "plots": False,
        }
    )
    LOG.clear()
    run(cfg, progress=False)
    log = LOG
    assert log["backward_in_weak"] == 0  # the monitor saw no backward from the weak handlers
    assert log["vote_requires_grad"] == [False, False]  # their forward passes built no graph
    assert log["backward_in_strong"] == 2  # ...while it sees the strong clients' backward
    assert log["sneak_replies"] == 0  # a weak handler that tries backward fails
    failures = (tmp_path / "roles" / "failures.jsonl").read_text().splitlines()
    assert len(failures) == 2 and all('"kind": "sneak"' in f for f in failures)
    assert all("does not require grad" in f for f in failures)
