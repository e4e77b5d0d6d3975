"""Message codecs: each round trip within its stated bound; the audit counts encoded bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedfm.config import load_config
from fedfm.core.audit import AuditLedger
from fedfm.core.codec import BLOCK, CODECS, NF4_CODE, NF4_HALF_GAP, Wire, parts_bytes
from fedfm.core.messages import Message, MessageKind
from fedfm.errors import ConfigError
from fedfm.runtime import run
from helpers.cli import run_cli
from helpers.config import toy_config

# Bytes of n values: tensor data plus one float32 scale per block for the blockwise codecs.
SIZES = {
    "float32": lambda n: 4 * n,
    "bfloat16": lambda n: 2 * n,
    "float16": lambda n: 2 * n,
    "int8": lambda n: n + 4 * math.ceil(n / BLOCK),
    "nf4": lambda n: math.ceil(n / 2) + 4 * math.ceil(n / BLOCK),
}


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("shape", [(3, 50), (129,), (1,), (7, 64)])
def test_round_trip_within_bound_and_size(name: str, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(5)
    t = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    codec = CODECS.get(name)
    back, nbytes = codec.round_trip(t)
    assert back.shape == t.shape and back.dtype == t.dtype
    err = (back.double() - t.double()).abs()
    assert bool((err <= codec.bound(t) * (1 + 1e-6) + 1e-30).all()), float(err.max())
    assert nbytes == SIZES[name](t.numel()) == parts_bytes(codec.encode(t))


def test_int8_bound_by_hand() -> None:
    # One block, absmax 2: the step is 2/127, the bound half of it (1/127).
    t = torch.tensor([2.0, 1.0, -0.5, 0.0])
    back, _ = CODECS.get("int8").round_trip(t)
    torch.testing.assert_close(back, torch.round(t / 2 * 127) * 2 / 127)
    torch.testing.assert_close(CODECS.get("int8").bound(t), torch.full((4,), 1 / 127.0).double())


def test_nf4_hits_its_code_values_exactly() -> None:
    t = torch.tensor(NF4_CODE) * 3.0  # every NF4 value scaled by the block's absmax (3)
    back, nbytes = CODECS.get("nf4").round_trip(t)
    torch.testing.assert_close(back, t)
    assert nbytes == 8 + 4  # 16 codes in 8 bytes, one scale
    assert pytest.approx((1.0 - 0.6961928009986877) / 2) == NF4_HALF_GAP  # from -1 to -0.696


def test_zero_block_stays_zero() -> None:
    for name in ("int8", "nf4"):
        back, _ = CODECS.get(name).round_trip(torch.zeros(70))
        assert float(back.abs().sum()) == 0.0


def test_wire_codes_only_named_fields_and_the_ledger_counts_encoded_bytes() -> None:
    wire = Wire.of("int8", None, ["train.params"])
    msg = Message("train", {"params": {"w": torch.randn(100)}, "other": {"x": torch.ones(3)}})
    got, sizes = wire.round_trip(msg, "up")
    assert sizes == {"params": ("int8", 100 + 4 * 2)}
    assert got.arrays["other"]["x"] is msg.arrays["other"]["x"]  # not coded
    ledger = AuditLedger()
    total = ledger.record(1, "c0", "up", got, sizes)
    rows = {r["field"]: r for r in ledger.pending}
    assert rows["params"]["bytes"] == 108 and rows["params"]["codec"] == "int8"
    assert rows["other"]["bytes"] == 12 and "codec" not in rows["other"]
    assert total == 120
    _, down = wire.round_trip(msg, "down")
    assert down == {}


def test_a_codec_on_a_non_floating_field_names_the_field() -> None:
    msg = Message("train", {"ids": {"tok": torch.arange(4)}})
    with pytest.raises(ConfigError, match=r"comm\.uplink.*'train\.ids'.*int64"):
        Wire.of("nf4", None, None).round_trip(msg, "up")


@pytest.mark.parametrize(
    ("over", "field", "why"),
    [
        # SecAgg+'s key material and ciphertexts travel down as bytes.
        (["privacy.secure_aggregation=secagg+", "comm.downlink=int8"], "comm.downlink", "integer"),
        (["privacy.secure_aggregation=secagg+", "comm.uplink=nf4"], "comm.uplink", "integer"),
        (["comm.uplink=int8", "comm.fields=[train.parms]"], "comm.fields", "train.parms"),
    ],
)
def test_a_wire_the_messages_cannot_travel_in_exits_2_before_the_disk(
    tmp_path, monkeypatch, capsys, over: list[str], field: str, why: str
) -> None:
    argv = ["run", "tabular-fedavg", f"out_dir={tmp_path}", "name=bad", "rounds=1", *over]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, out + err
    assert len((out + err).strip().splitlines()) == 1 and field in err and why in err, out + err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_wire_check_names_integer_fields_only_where_a_codec_codes_them() -> None:
    kinds = {
        "k": MessageKind("k", down_arrays=("ids", "w"), up_arrays=("w",), integer_arrays=("ids",))
    }
    Wire.of("int8", None, None).check(kinds)  # ids goes down only
    Wire.of(None, "nf4", ["k.w"]).check(kinds)  # ids not among the coded fields
    with pytest.raises(ConfigError, match=r"comm\.downlink.*'k\.ids'"):
        Wire.of(None, "nf4", None).check(kinds)


def test_unknown_codec_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"comm\.uplink"):
        load_config(toy_config("/tmp/never", comm={"uplink": "int3"}))


def test_run_audit_bytes_equal_encoded_sizes(tmp_path) -> None:
    cfg = load_config(toy_config(tmp_path, comm={"uplink": "nf4", "downlink": "bfloat16"}))
    run(cfg, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "audit.jsonl").read_text().splitlines()]
    arrays = [r for r in rows if r["type"] == "arrays" and r["kind"] == "train"]
    assert arrays
    for r in arrays:
        assert r["codec"] == ("nf4" if r["direction"] == "up" else "bfloat16")
        if r["tensors"] == 1:
            assert r["bytes"] == SIZES[r["codec"]](r["numel"])
        else:  # one rounding per tensor: at most one extra byte and block each
            low = SIZES[r["codec"]](r["numel"])
            assert low <= r["bytes"] <= low + r["tensors"] * 5
