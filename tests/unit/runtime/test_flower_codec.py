"""Coded fields on the Flower runtime: encoded on the wire, decoded as on embedded."""

from __future__ import annotations

import json

import pytest
import torch

from fedfm.core.codec import CODECS, Wire
from fedfm.core.messages import Message
from fedfm.runtime.flower import wire as W
from helpers.config import toy_config
from helpers.grid import embedded_run, flower_run, same_run

pytest.importorskip("flwr.app")
pytestmark = pytest.mark.usefixtures("task_identity")


def test_a_coded_field_travels_encoded_and_decodes_as_the_codec_does():
    t = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    msg = Message("train", {"params": {"w": t}, "other": {"x": torch.ones(3)}}, {"n": 1})
    wire = Wire.of(None, "nf4", ["train.params"])
    rd = W.message_to_records(msg, {}, wire, "down")
    head = json.loads(str(rd.config_records[W.HEADER]["header"]))
    assert head["coded"] == {"params": ["nf4", {"w": ["float32", [4, 40]]}]}
    packed = rd.config_records[W.HEADER][W.ARRAYS_PREFIX + "params"]
    assert len(packed) < t.numel()  # 80 bytes of codes and 12 of scales, plus the index
    back, _ = W.records_to_message(rd)
    torch.testing.assert_close(back.arrays["params"]["w"], CODECS.get("nf4").round_trip(t)[0])
    assert torch.equal(back.arrays["other"]["x"], torch.ones(3))


def test_coded_fedavg_over_flower_equals_embedded(tmp_path):
    comm = {"uplink": "int8", "downlink": "nf4"}
    cfg = toy_config(tmp_path, "fedavg", name="emb", rounds=2, comm=comm)
    embedded_run(cfg)
    flower_run({**cfg, "name": "flw", "runtime": "flower"}, tmp_path / "nodes")
    same_run(tmp_path / "emb", tmp_path / "flw")
    rows = [json.loads(x) for x in (tmp_path / "flw" / "audit.jsonl").read_text().splitlines()]
    assert {r.get("codec") for r in rows if r["type"] == "arrays"} == {"int8", "nf4"}
