"""The federation interface and the embedded runtime carry every pattern the methods need."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import Tensor

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation, assign_roles
from fedfm.core.messages import Message, MessageKind
from fedfm.errors import TooFewClientsError
from fedfm.runtime import run
from helpers import flower  # noqa: F401  (registers the toy task and test-crashy)
from helpers.config import toy_config


def _rows(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _audit(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / name / "audit.jsonl").read_text().splitlines()]


class PatternsClient(ClientHalf):
    """The client half of :class:`Patterns`."""

    def handlers(self):
        return {
            "profile": lambda ctx, m: Message(
                "profile", meta={"n": self.task.num_examples(ctx.data)}
            ),
            "stats": self._stats,
            "train": self._train,
            "vote": lambda ctx, m: Message("vote", meta={"vote": float(ctx.data[1].mean())}),
            "final": lambda ctx, m: Message(
                "final", meta={"count": ctx.state.meta.get("count", 0)}
            ),
        }

    def _stats(self, ctx: ClientContext, msg: Message) -> Message:
        # Per-client state that persists across rounds: how often this client was asked.
        ctx.state.meta["count"] = ctx.state.meta.get("count", 0) + 1
        ctx.state.arrays["seen"] = msg.arrays["w"]["w"].clone()
        return Message(
            "stats", {"mean": {"x": ctx.data[0].mean(0)}}, {"count": ctx.state.meta["count"]}
        )

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        return Message("train", {"w": {"w": msg.arrays["w"]["w"] + 1.0}})


class Patterns(Algorithm):
    """Exercises: two exchanges per round, server training between them, roles, client state,
    a phase before round 1 and one after the last round."""

    Client = PatternsClient
    messages = (
        MessageKind("profile", up_meta=("n",)),
        MessageKind("stats", down_arrays=("w",), up_arrays=("mean",), up_meta=("count",)),
        MessageKind("train", down_arrays=("w",), up_arrays=("w",), roles=("strong",)),
        MessageKind("vote", down_arrays=("w",), up_meta=("vote",), roles=("weak",)),
        MessageKind("final", up_meta=("count",)),
    )

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.w = torch.zeros(4)
        self.log: list[str] = []
        self.profile: dict[str, int] = {}

    def setup(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("profile"), fed.client_ids())
        self.profile = {c: r.meta["n"] for c, r in replies.items()}
        return {"profiled": len(replies)}

    def round(self, fed: Federation) -> dict[str, float]:
        cids = fed.sample(0.5)
        r1 = fed.broadcast(Message("stats", {"w": {"w": self.w}}), cids)
        # Server-side training between the two exchanges: fit w to the received means.
        means = torch.stack([r.arrays["mean"]["x"] for r in r1.values()])
        w = self.w.clone().requires_grad_(True)
        opt = torch.optim.SGD([w], lr=0.5)
        for _ in range(5):
            opt.zero_grad()
            ((w - means.mean(0)) ** 2).sum().backward()
            opt.step()
        self.w = w.detach()
        strong = [c for c in cids if fed.role_of(c) == "strong"]
        weak = [c for c in cids if fed.role_of(c) == "weak"]
        r2 = fed.broadcast(Message("train", {"w": {"w": self.w}}), strong)
        r3 = fed.broadcast(Message("vote", {"w": {"w": self.w}}), weak)
        return {"stats": len(r1), "trained": len(r2), "votes": len(r3), "w0": float(self.w[0])}

    def finish(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("final"), fed.client_ids())
        return {c: r.meta["count"] for c, r in replies.items()}

    def state_dict(self):
        return {"w": self.w}, {"profile": self.profile}

    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.w = arrays["w"]
        self.profile = meta["profile"]


ALGORITHMS.register("test-patterns")(Patterns)

SIX = {"seed": 0, "num_clients": 6}  # six toy clients, fedfm's default seed
ROLES = {"roles": {"strong": 0.5, "weak": 0.5}}


@pytest.fixture
def patterns_run(tmp_path):
    cfg = load_config(toy_config(tmp_path, "test-patterns", rounds=4, clients=ROLES, **SIX))
    summary = run(cfg, progress=False)
    return tmp_path, summary


def test_several_exchanges_and_server_training_in_one_round(patterns_run):
    tmp_path, _ = patterns_run
    rows = _rows(tmp_path, "test-patterns")
    audit = _audit(tmp_path, "test-patterns")
    for r in rows[1:]:
        kinds = {a["kind"] for a in audit if a["round"] == r["round"]}
        assert {"stats"} <= kinds and r["stats"] == 3  # 50 % of 6 clients
        assert r["trained"] + r["votes"] == 3
    # The server moved w between the exchanges, and clients received the updated w.
    assert rows[1]["w0"] != 0.0


def test_one_off_phases_before_and_after(patterns_run):
    tmp_path, summary = patterns_run
    rows = _rows(tmp_path, "test-patterns")
    assert rows[0]["round"] == 0 and rows[0]["profiled"] == 6
    audit = _audit(tmp_path, "test-patterns")
    assert all(a["round"] == 0 for a in audit if a["kind"] == "profile")
    # finish() asked every client how often it was sampled: the state persisted across rounds.
    counts = summary["finish"]
    assert sum(counts.values()) == 4 * 3 and max(counts.values()) >= 2


def test_roles_split_and_are_enforced(tmp_path):
    infos = assign_roles([str(i) for i in range(10)], {"strong": 0.3}, seed=1)
    assert (
        sum(i.role == "strong" for i in infos) == 3 and sum(i.role == "default" for i in infos) == 7
    )
    assert infos == assign_roles([str(i) for i in range(10)], {"strong": 0.3}, seed=1)

    class WrongRole(Patterns):
        def round(self, fed):
            weak = [c for c in fed.client_ids() if fed.role_of(c) == "weak"]
            replies = fed.broadcast(Message("train", {"w": {"w": self.w}}), weak)
            return {"answered": len(replies)}

    ALGORITHMS.register("test-wrong-role")(WrongRole)
    cfg = load_config(toy_config(tmp_path, "test-wrong-role", rounds=1, clients=ROLES, **SIX))
    run(cfg, progress=False)
    row = _rows(tmp_path, "test-wrong-role")[1]
    assert row["answered"] == 0 and row["failed"] == 3
    fails = [
        json.loads(x)
        for x in (tmp_path / "test-wrong-role" / "failures.jsonl").read_text().splitlines()
    ]
    assert "role 'weak' does not handle message kind 'train'" in fails[0]["error"]


def test_sampling_by_fraction_is_seeded():
    from fedfm.runtime.embedded import EmbeddedFederation

    def fed(seed):
        from fedfm.core.federation import ClientInfo

        return EmbeddedFederation(
            [ClientInfo(str(i)) for i in range(20)], seed, {}, {}, None, None, None
        )

    a, b, c = fed(0), fed(0), fed(1)
    draws = []
    for rnd in range(1, 4):
        a.rnd = b.rnd = c.rnd = rnd
        sa = a.sample(0.25)
        assert sa == b.sample(0.25) and len(sa) == 5
        draws.append(tuple(sa))
        assert len(a.sample(0.01, min_clients=3)) == 3
    assert len(set(draws)) > 1  # rounds differ
    c.rnd = 1
    assert c.sample(0.25) != list(draws[0]) or c.sample(0.5) != fed(0).sample(0.5)


# test-crashy (clients failing in every way a reply can) lives in helpers.flower, which
# Flower processes import too.


def test_faulty_clients_are_logged_and_left_out(tmp_path):
    cfg = load_config(
        toy_config(tmp_path, "test-crashy", rounds=1, clients={"min_clients": 2}, **SIX)
    )
    run(cfg, progress=False)
    row = _rows(tmp_path, "test-crashy")[1]
    assert row["ok"] == 2 and row["failed"] == 4
    fails = {
        f["client"]: f["error"]
        for f in map(
            json.loads, (tmp_path / "test-crashy" / "failures.jsonl").read_text().splitlines()
        )
    }
    assert "RuntimeError: disk full" in fails["1"]
    assert "client 2: field p.w: contains NaN" in fails["2"]
    assert "shape (3,), expected (2,)" in fails["3"]
    assert "p.bias: unknown key" in fails["4"]
    # A failed client's state is not committed; a good client's is.
    from fedfm.core.checkpoint import latest_checkpoint, load_checkpoint

    ck = load_checkpoint(latest_checkpoint(tmp_path / "test-crashy" / "checkpoints"))
    assert "1" not in ck.client_meta and ck.client_meta["0"] == {"touched": True}


def test_too_few_survivors_fail_the_round_clearly(tmp_path):
    cfg = load_config(
        toy_config(tmp_path, "test-crashy", rounds=1, clients={"min_clients": 3}, **SIX)
    )
    with pytest.raises(
        TooFewClientsError, match="round 1: only 2 of 6 clients answered, min_clients=3"
    ):
        run(cfg, progress=False)


def test_state_persists_across_resume(tmp_path):
    cfg = load_config(toy_config(tmp_path, "test-patterns", rounds=4, clients=ROLES, **SIX))
    full = run(cfg, progress=False)
    cfg2 = load_config(
        toy_config(tmp_path, "test-patterns", name="part", rounds=2, clients=ROLES, **SIX)
    )
    run(cfg2, progress=False)
    cfg3 = load_config(
        toy_config(tmp_path, "test-patterns", name="part", rounds=4, clients=ROLES, **SIX)
    )
    resumed = run(cfg3, resume=True, progress=False)
    assert resumed["finish"] == full["finish"]  # per-client counters survived the restart
    assert _rows(tmp_path, "part")[-1]["w0"] == _rows(tmp_path, "test-patterns")[-1]["w0"]
