"""Byte accounting: meta values count as the UTF-8 bytes of their compact JSON, the text that
travels; ``summary.json`` and ``metrics.jsonl`` totals are sums of the audit ledger."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.config import load_config
from fedfm.core.audit import AuditLedger
from fedfm.core.messages import Message, meta_bytes
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)

# value, bytes by hand
META_CASES: list[tuple[Any, int]] = [
    (7, 1),  # 7
    (1234567, 7),  # 1234567
    (-3, 2),  # -3
    (True, 4),  # true
    (None, 4),  # null
    (0.5, 3),  # 0.5
    (0.1 + 0.2, 19),  # 0.30000000000000004
    (1e-300, 6),  # 1e-300
    ("ok", 4),  # "ok"
    ("héllo wörld", 15),  # "h é llo w ö rld": 13 characters, é and ö 2 bytes each in UTF-8
    ("数据", 8),  # 2 quotes + 2 characters of 3 bytes each
    ('a"b', 6),  # "a\"b": the escaped quote is 2 bytes
    ([1, 2.5, 3], 9),  # [1,2.5,3]  (with spaces after commas it would be 11)
    (["x", "é"], 10),  # ["x","é"]
    ([], 2),  # []
    ({"acc": 0.5, "f1": 1}, 18),  # {"acc":0.5,"f1":1}  (with spaces, 20)
    ({"per": {"a": 1}}, 15),  # {"per":{"a":1}}
]


@pytest.mark.parametrize(("value", "nbytes"), META_CASES)
def test_meta_values_count_the_utf8_bytes_of_their_compact_json(value: Any, nbytes: int) -> None:
    assert meta_bytes(value) == nbytes


def test_the_ledger_counts_each_meta_field_and_the_tensor_bytes() -> None:
    led = AuditLedger()
    meta = {name: value for name, (value, _) in zip("abcdefghijklmnopq", META_CASES, strict=True)}
    params = {"w": torch.zeros(3, 2), "h": torch.zeros(5, dtype=torch.float16)}
    total = led.record(1, "0", "up", Message("k", {"params": params}, meta))
    rows = {r["field"]: r["bytes"] for r in led.pending}
    assert rows == {
        "params": 3 * 2 * 4 + 5 * 2,
        **{n: b for n, (_, b) in zip(meta, META_CASES, strict=True)},
    }
    assert total == sum(rows.values())
    assert led.round_bytes(1)["bytes_up_meta"] == sum(b for _, b in META_CASES)


def test_meta_that_travels_as_json_on_flower_is_exactly_the_counted_bytes() -> None:
    pytest.importorskip("flwr.app")
    from flwr.common import serde

    from fedfm.runtime.flower import wire as W

    meta = {f"m{i}": v for i, (v, _) in enumerate(META_CASES)}
    rd = W.message_to_records(Message("k", meta=meta), {"round": 1})
    proto = serde.recorddict_to_proto(rd)
    back = serde.recorddict_from_proto(type(proto).FromString(proto.SerializeToString()))
    record = back.config_records[W.HEADER]
    as_json = set(json.loads(str(record["header"]))["meta_json"])
    for name, value in meta.items():
        sent = str(record[W.META_PREFIX + name]).encode("utf-8")
        if name in as_json:  # lists, dicts, None: the record holds the counted text itself
            assert len(sent) == meta_bytes(value), name
        elif isinstance(value, str) and '"' not in value:
            # A string travels natively as its UTF-8 bytes; the ledger counts its JSON form,
            # 2 quotes more (and a backslash per escaped character, as for 'a"b').
            assert len(sent) + 2 == meta_bytes(value), name
    assert as_json == {n for n, v in meta.items() if isinstance(v, list | dict) or v is None}
    msg, _ = W.records_to_message(back)
    assert msg.meta == meta


# ----------------------------------------------------------------------------- run totals


def _run(tmp_path: Path, algorithm: str, **kw: Any) -> tuple[dict[str, Any], list, list]:
    cfg = {
        "name": algorithm,
        "algorithm": algorithm,
        "rounds": 3,
        "seed": 2,
        "task": {"kind": "toy", "num_clients": 4},
        "clients": {"fraction": 0.5},
        "train": {"steps": 2, "batch_size": 8, "lr": 0.05},
        "out_dir": str(tmp_path),
        "plots": False,
        **kw,
    }
    summary = run(load_config(cfg), progress=False)
    folder = tmp_path / algorithm
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    audit = [json.loads(x) for x in (folder / "audit.jsonl").read_text().splitlines()]
    return summary, rows, audit


@pytest.mark.parametrize(
    ("algorithm", "algo"), [("fedavg", {"personal_eval": True}), ("scaffold", {})]
)
def test_summary_and_round_totals_are_sums_of_the_audit_ledger(
    tmp_path: Path, algorithm: str, algo: dict[str, Any]
) -> None:
    summary, rows, audit = _run(tmp_path, algorithm, algo=algo)
    by: dict[tuple[int, str, str], int] = defaultdict(int)
    for a in audit:
        by[(a["round"], a["direction"], a["type"])] += a["bytes"]
    for row in rows:
        for d in ("up", "down"):
            arrays, meta = by[(row["round"], d, "arrays")], by[(row["round"], d, "meta")]
            assert (row[f"bytes_{d}_arrays"], row[f"bytes_{d}_meta"]) == (arrays, meta)
            assert row[f"bytes_{d}"] == arrays + meta
    for d in ("up", "down"):
        for part in ("arrays", "meta"):
            assert summary[f"bytes_{d}_{part}"] == sum(
                v for k, v in by.items() if k[1:] == (d, part)
            )
        assert summary[f"bytes_{d}"] == sum(v for k, v in by.items() if k[1] == d)
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > 0


def test_ledger_rows_of_a_fedavg_round_by_hand(tmp_path: Path) -> None:
    _, _, audit = _run(tmp_path, "fedavg", rounds=1)
    train = [a for a in audit if a["round"] == 1 and a["kind"] == "train"]
    # Linear(4, 1): 4 + 1 float32 = 20 bytes each way; 2 of 4 clients sampled.
    down = [a for a in train if a["direction"] == "down"]
    assert [(a["field"], a["bytes"], a["numel"], a["dtype"]) for a in down] == [
        ("params", 20, 5, "float32")
    ] * 2
    up = [a for a in train if a["direction"] == "up"]
    assert (
        sorted(a["field"] for a in up)
        == ["loss", "loss", "num_examples", "num_examples"] + ["params"] * 2
    )
    # num_examples = 24 -> "24", 2 bytes; the loss is a float's shortest repr.
    assert {a["bytes"] for a in up if a["field"] == "num_examples"} == {2}
    assert {a["bytes"] for a in up if a["field"] == "params"} == {20}
