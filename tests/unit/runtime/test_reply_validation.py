"""Client replies are validated in full: a bad reply is that client's failure, never the run's."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.algorithms.base import ALGORITHMS
from fedfm.algorithms.fedavg import EVALUATE, TRAIN, FedAvg, FedAvgClient
from fedfm.config import load_config
from fedfm.core.messages import MAX_EXAMPLES, Message, MessageKind, MetaSpec
from fedfm.errors import MessageError, TooFewClientsError
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)
from helpers.config import make_config, toy_config
from helpers.grid import flower_run, same_run

# The in-memory Flower grid runs in this process: it needs a task identity (conftest.py).
pytestmark = pytest.mark.usefixtures("task_identity")

# ----------------------------------------------------------------------------- MessageKind


def _train(**meta: Any) -> Message:
    base = {"num_examples": 12, "loss": 0.5}
    base.update(meta)
    return Message(
        "train", {"params": {"w": torch.zeros(2)}}, {k: v for k, v in base.items() if v is not ...}
    )


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"num_examples": ...}, "meta field 'num_examples' is missing"),
        ({"num_examples": float("nan")}, "'num_examples' must be an integer, got float nan"),
        ({"num_examples": 12.0}, "'num_examples' must be an integer, got float"),
        ({"num_examples": True}, "'num_examples' must be an integer, got bool"),
        ({"num_examples": "12"}, "'num_examples' must be an integer, got str"),
        ({"num_examples": 0}, "'num_examples' 0 is below 1"),
        ({"num_examples": -5}, "'num_examples' -5 is below 1"),
        ({"num_examples": MAX_EXAMPLES + 1}, "'num_examples' 1.09951e+12 is above"),
        ({"loss": ...}, "meta field 'loss' is missing"),
        ({"loss": float("nan")}, "'loss' must be finite, got nan"),
        ({"loss": float("-inf")}, "'loss' must be finite, got -inf"),
        ({"loss": None}, "'loss' must be a number, got NoneType"),
        ({"loss": [0.5]}, "'loss' must be a number, got list"),
    ],
)
def test_train_reply_meta_is_checked_by_type_and_range(meta, reason):
    with pytest.raises(MessageError, match=re.escape(reason)):
        TRAIN.check(_train(**meta), "up")


def test_good_replies_pass():
    TRAIN.check(_train(), "up")
    TRAIN.check(_train(num_examples=MAX_EXAMPLES, loss=0), "up")
    # A local test split may be empty: evaluation replies may count 0 examples.
    EVALUATE.check(Message("evaluate", meta={"num_examples": 0, "metrics": {}}), "up")


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        ([0.5], "must be a mapping"),
        ({"acc": float("nan")}, "entry 'acc' must be finite"),
        ({"acc": "high"}, "entry 'acc' must be a number"),
    ],
)
def test_evaluation_metrics_are_finite_numbers(metrics, reason):
    with pytest.raises(MessageError, match=reason):
        EVALUATE.check(Message("evaluate", meta={"num_examples": 3, "metrics": metrics}), "up")


def test_fields_without_a_standard_spec_are_finite_and_declared_specs_apply():
    kind = MessageKind(
        "stats",
        up_meta=("info", "gate"),
        meta_specs={"gate": MetaSpec("float", ge=0, le=1)},
    )
    kind.check(Message("stats", meta={"info": {"a": [1.0, 2.0]}}), "up")  # both optional
    with pytest.raises(MessageError, match="'info' holds a non-finite number"):
        kind.check(Message("stats", meta={"info": {"a": [1.0, math.inf]}}), "up")
    with pytest.raises(MessageError, match=r"'gate' 1\.5 is above 1"):
        kind.check(Message("stats", meta={"gate": 1.5}), "up")


# ----------------------------------------------------------------------------- through a run

TAMPER = {
    "0": lambda r: Message(r.kind, r.arrays, {"loss": r.meta["loss"]}),
    "1": lambda r: Message(r.kind, r.arrays, {**r.meta, "num_examples": float("nan")}),
    "2": lambda r: Message(r.kind, r.arrays, {**r.meta, "num_examples": -5}),
    "3": lambda r: Message(r.kind, r.arrays, {**r.meta, "num_examples": 10**15}),
    "4": lambda r: Message(r.kind, r.arrays, {**r.meta, "loss": float("inf")}),
    "5": lambda r: Message(r.kind, {}, r.meta),  # the params the server expects are missing
}
EXPECTED = {
    "0": "meta field 'num_examples' is missing",
    "1": "meta field 'num_examples' must be an integer, got float nan",
    "2": "meta field 'num_examples' -5 is below 1",
    "3": "meta field 'num_examples' 1e+15 is above",
    "4": "meta field 'loss' must be finite, got inf",
    "5": "client 5: field params: missing array field",
}


class BadRepliesClient(FedAvgClient):
    """FedAvg's client half; clients 0-5 send malformed replies, 6 and 7 are honest."""

    def train(self, ctx, msg):
        reply = super().train(ctx, msg)
        return TAMPER.get(ctx.cid, lambda r: r)(reply)


class BadReplies(FedAvg):
    """FedAvg whose clients 0-5 send malformed replies; 6 and 7 are honest."""

    Client = BadRepliesClient


ALGORITHMS.register("test-bad-replies")(BadReplies)


# Eight toy clients, some of which send malformed replies.
BAD = toy_config("runs", "test-bad-replies", name="bad", num_clients=8)


def _failures(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "failures.jsonl").read_text().splitlines()]


def test_malformed_replies_are_logged_and_left_out(tmp_path):
    summary = run(
        load_config(make_config(BAD, tmp_path, clients={"min_clients": 2})), progress=False
    )
    rows = [json.loads(x) for x in (tmp_path / "bad" / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows[1:]] == [2, 2, 2] and [r["failed"] for r in rows] == [
        0,
        6,
        6,
        6,
    ]
    assert rows[-1]["rmse"] < rows[0]["rmse"]  # the honest clients still train the model
    fails = _failures(tmp_path / "bad")
    assert len(fails) == 18 and summary["failed_clients"] == 6  # clients, not messages
    assert summary["failed_messages"] == 18
    for f in fails:
        assert EXPECTED[f["client"]] in f["error"] and f["kind"] == "train", f


def test_failures_of_the_round_that_stops_the_run_are_logged(tmp_path):
    with pytest.raises(TooFewClientsError, match="round 1: only 2 of 8 clients answered"):
        run(load_config(make_config(BAD, tmp_path, clients={"min_clients": 3})), progress=False)
    fails = _failures(tmp_path / "bad")
    assert sorted(f["client"] for f in fails) == ["0", "1", "2", "3", "4", "5"]
    assert {f["round"] for f in fails} == {1}


def test_flower_runtime_rejects_the_same_replies_the_same_way(tmp_path):
    run(
        load_config(make_config(BAD, tmp_path, clients={"min_clients": 2}, rounds=2)),
        progress=False,
    )
    flw = {**make_config(BAD, tmp_path, clients={"min_clients": 2}, rounds=2), "name": "flw"}
    flower_run(flw, tmp_path / "nodes", options={"imports": ["helpers.flower", __name__]})
    same_run(tmp_path / "bad", tmp_path / "flw")
    assert len(_failures(tmp_path / "flw")) == 12
