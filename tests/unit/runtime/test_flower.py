"""The Flower runtime: wire format, ClientApp, FlowerFederation, resume, simulation engine.

Most tests drive the real ServerApp body (``server_main``) and the real ClientApp through an
in-memory grid that serialises every record with Flower's own protobuf serde, so the whole
fedfm-on-Flower path runs in-process in seconds. One test runs Flower's simulation engine
(Ray) end to end. Runs on Flower must equal embedded runs exactly: same metrics, same audit
ledger, same failures (tolerance 0; the toy models are too small for thread-dependent
reductions).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
import torch

from fedfm.algorithms.base import ALGORITHMS
from fedfm.config import load_config
from fedfm.core.messages import Message
from fedfm.errors import ConfigError, MessageError, TooFewClientsError
from fedfm.runtime import run
from fedfm.runtime.flower import options as Opt
from fedfm.runtime.flower import server as S
from fedfm.runtime.flower import wire as W
from fedfm.runtime.flower.client import Snapshots
from fedfm.runtime.flower_app import make_client_app
from helpers import flower as fs
from helpers.config import toy_config
from helpers.grid import (
    ReversedGrid,
    embedded_run,
    flower_run,
    grid_payload,
    same_run,
    wire_trip,
)
from helpers.runfiles import untimed_rows

flwr_app = pytest.importorskip("flwr.app")
serde = pytest.importorskip("flwr.common.serde")


pytestmark = pytest.mark.usefixtures("task_identity")


# --------------------------------------------------------------------------- wire format


def test_tensors_and_meta_cross_the_wire_exactly():
    g = torch.Generator().manual_seed(0)
    arrays = {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 2, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.tensor([-(2**62), 0, 2**62]),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "empty_bf16": torch.zeros(0, dtype=torch.bfloat16),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
    }
    meta = {
        "n": 7,
        "loss": 0.1 + 0.2,
        "tiny": 1e-300,
        "flag": True,
        "name": "client 0",
        "ints": [1, 2],
        "mixed": [1, 2.5],
        "empty": [],
        "metrics": {"acc": 0.5, "per": {"a": 1}},
        "none": None,
        "nan": float("nan"),
    }
    msg = Message("select.features", {"p": arrays, "q": {}}, meta)
    back, head = W.records_to_message(wire_trip(W.message_to_records(msg, {"round": 4})))
    assert head["round"] == 4 and back.kind == "select.features"
    assert list(back.arrays) == ["p", "q"] and back.arrays["q"] == {}
    assert list(back.arrays["p"]) == list(arrays)
    for k, t in arrays.items():
        got = back.arrays["p"][k]
        assert got.dtype == t.dtype and got.shape == t.shape, k
        assert torch.equal(got, t), k
    assert list(back.meta) == list(meta)
    for k, v in meta.items():
        if k == "nan":
            assert math.isnan(back.meta[k])
        else:
            assert back.meta[k] == v and type(back.meta[k]) is type(v), k
    # Audit byte counts depend only on the message: identical after the trip.
    from fedfm.core.audit import AuditLedger

    a, b = AuditLedger(), AuditLedger()
    assert a.record(1, "0", "up", msg) == b.record(1, "0", "up", back)
    assert a.pending == b.pending


def test_a_message_is_a_few_flower_objects_whatever_its_tensor_count():
    # Each Flower object costs one HTTP request per hop on a deployment: a field's tensors
    # travel packed, small fields and the meta inside the header record.
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    def objects(msg: Message) -> int:
        fm = flwr_app.Message(W.message_to_records(msg, {"cid": "0"}), 5, W.MESSAGE_TYPE)
        return len(get_all_nested_objects(fm))

    small = {"w": torch.ones(2), "b": torch.zeros(3, dtype=torch.bfloat16)}
    lora = {f"l{i}.lora_{ab}": torch.randn(8, 64) for i in range(60) for ab in "AB"}
    assert len(W.pack_bytes(small)) <= W.INLINE_MAX_BYTES < len(W.pack_bytes(lora))
    assert objects(Message("evaluate", {"params": {}}, {"loss": 0.5})) == 3
    assert objects(Message("train", {"params": small, "control": small}, {"lr": 0.1})) == 3
    assert objects(Message("train", {"params": lora}, {"steps": [1, 2]})) == 6
    # a large field: an ArrayRecord, its packed Array and the Array's one chunk
    assert objects(Message("train", {"params": lora, "control": small})) == 6
    two = W.message_to_records(Message("t", {"p": lora, "q": small}), {"cid": "0"})
    back, _ = W.records_to_message(wire_trip(two))
    assert all(torch.equal(back.arrays["p"][k], t) for k, t in lora.items())
    assert all(torch.equal(back.arrays["q"][k], t) for k, t in small.items())
    # Clients sent the same large field share its objects (named by content) on the SuperLink.
    a, b = (W.message_to_records(Message("t", {"p": lora}), {"cid": c}) for c in "01")
    assert a[W.ARRAYS].object_id == b[W.ARRAYS].object_id
    assert a[W.HEADER].object_id != b[W.HEADER].object_id


def test_packed_arrays_refuse_what_they_cannot_read():
    from flwr.app import Array

    good = W.pack({"x": torch.arange(4.0)})
    cut = Array(
        dtype="uint8", shape=(len(good.data) - 1,), stype=W.PACKED_STYPE, data=good.data[:-1]
    )
    with pytest.raises(MessageError, match="tensor 'x' runs past the end"):
        W.unpack(cut)
    extra = Array(
        dtype="uint8", shape=(len(good.data) + 2,), stype=W.PACKED_STYPE, data=good.data + b"00"
    )
    with pytest.raises(MessageError, match="2 bytes left over"):
        W.unpack(extra)
    with pytest.raises(MessageError, match=r"stype 'numpy\.ndarray' is not a packed fedfm array"):
        W.unpack(Array.from_numpy_ndarray(torch.ones(2).numpy()))
    # Unpacked tensors own their storage (a handler may keep and save any one of them).
    back = W.unpack(W.pack({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}))
    ptrs = {t.untyped_storage().data_ptr() for t in back.values()}
    assert len(ptrs) == 2 and back["b"].dtype == torch.bfloat16


def test_a_message_of_another_wire_version_is_refused_by_name():
    rd = W.message_to_records(Message("k", meta={"n": 1}), {"round": 1})
    head = json.loads(str(rd[W.HEADER]["header"]))
    rd[W.HEADER]["header"] = json.dumps({**head, "wire": 1})
    with pytest.raises(MessageError, match="fedfm wire format 1 where this fedfm reads 2"):
        W.records_to_message(rd)


def test_malformed_records_and_payloads_are_refused():
    with pytest.raises(MessageError, match="malformed fedfm message"):
        W.records_to_message(flwr_app.RecordDict())
    with pytest.raises(ConfigError, match="fedfm-payload: missing from the Flower run config"):
        W.Payload.from_context({})
    with pytest.raises(ConfigError, match="not a fedfm payload"):
        W.Payload.decode("!!!")
    p = W.Payload({"name": "x"}, {"timeout_s": 3}, resume=True)
    assert W.Payload.decode(p.encode()) == p
    with pytest.raises(ConfigError, match=r"flower\.timeout_s"):
        Opt.load_options({"timeout_s": -1})
    with pytest.raises(ConfigError, match="cannot import 'no_such_plugin'"):
        Opt.import_plugins(["no_such_plugin"])


# --------------------------------------------------------------------------- client side


def _context(node_config: dict[str, Any], payload: W.Payload) -> Any:
    return flwr_app.Context(
        run_id=1,
        node_id=5,
        node_config=node_config,
        state=flwr_app.RecordDict(),
        run_config={W.PAYLOAD_KEY: payload.encode()},
    )


def _call(app: Any, ctx: Any, msg: Message, header: dict[str, Any]) -> Any:
    head = {"run_uid": "u", "session": 0, "lineage": [], "committed": 0, "like": {}, **header}
    fm = flwr_app.Message(W.message_to_records(msg, head), 5, W.MESSAGE_TYPE)
    fm.metadata.__dict__["_message_id"] = "m1"
    return app(message=fm, context=ctx)


def test_client_refuses_unknown_kinds_and_wrong_roles_with_named_errors(tmp_path):
    cfg = toy_config(tmp_path, "test-two-phase", clients={"roles": {"strong": 0.5, "weak": 0.5}})
    payload = grid_payload(cfg)
    app = make_client_app()
    ctx = _context({"partition-id": 0, "state-dir": str(tmp_path / "s")}, payload)
    reply = _call(app, ctx, Message("nope"), {"cid": "0", "round": 1})
    assert reply.has_error() and reply.error.code == W.CLIENT_ERROR_CODE
    assert reply.error.reason == "client 0: unknown message kind 'nope'"
    from fedfm.core.federation import assign_roles

    roles = {
        c.cid: c.role for c in assign_roles(["0", "1", "2", "3"], {"strong": 0.5, "weak": 0.5}, 3)
    }
    weak = next(c for c, r in roles.items() if r == "weak")
    ctx = _context({"partition-id": int(weak), "state-dir": str(tmp_path / "s")}, payload)
    w = {"w": {"w": torch.zeros(4)}}
    reply = _call(app, ctx, Message("step", w), {"cid": weak, "round": 1})
    assert reply.error.reason == f"client {weak}: role 'weak' does not handle message kind 'step'"
    # A message addressed to another client is refused too.
    reply = _call(app, ctx, Message("vote", w), {"cid": "9", "round": 1})
    assert f"message for client 9 reached client {weak}" in reply.error.reason
    # Nothing of a refused message reached the client's state.
    assert "fedfm.state.arrays" not in ctx.state or not ctx.state["fedfm.state.arrays"]


def test_client_state_commits_only_on_success(tmp_path):
    cfg = toy_config(tmp_path, "test-two-phase")
    payload = grid_payload(cfg)
    app = make_client_app()
    ctx = _context({"partition-id": 1, "state-dir": str(tmp_path / "s")}, payload)
    w = {"w": {"w": torch.ones(4)}}
    like = W.like_spec({"mean": {"x": torch.zeros(4)}})
    ok = _call(app, ctx, Message("stats", w), {"cid": "1", "round": 1, "like": like})
    assert ok.has_content()
    msg, _ = W.records_to_message(ok.content)
    assert msg.meta["count"] == 1 and msg.meta["info"] == {"rnd": 1.0, "norm": 2.0}
    # The server expects a 3-long mean: the reply is refused and the counter stays at 1.
    bad = W.like_spec({"mean": {"x": torch.zeros(3)}})
    err = _call(app, ctx, Message("stats", w), {"cid": "1", "round": 2, "like": bad})
    assert err.error.reason == "update rejected: client 1: field mean.x: shape (4,), expected (3,)"
    ok = _call(app, ctx, Message("stats", w), {"cid": "1", "round": 3, "like": like})
    assert W.records_to_message(ok.content)[0].meta["count"] == 2
    # Snapshots on disk: round 3 (in progress) and the newest committed one (round 1).
    snaps = sorted(p.name for p in (tmp_path / "s" / "u" / "1").glob("*.json"))
    assert snaps == ["s0000-r00001.json", "s0000-r00003.json"]


def test_handshake_checks_the_partition(tmp_path):
    payload = grid_payload(toy_config(tmp_path, "test-two-phase"))
    app = make_client_app()
    hello = flwr_app.Message(flwr_app.RecordDict(), 5, W.HELLO_TYPE)
    hello.metadata.__dict__["_message_id"] = "h"
    for conf, reason in [
        ({"partition-id": 2}, None),
        ({}, "partition-id: missing from the SuperNode's node config"),
        ({"partition-id": 4}, "partition-id: 4 is out of range for 4 clients"),
        ({"partition-id": 0, "num-partitions": 3}, "num-partitions: SuperNode says 3"),
    ]:
        reply = app(message=hello, context=_context(conf, payload))
        if reason is None:
            assert json.loads(reply.content["fedfm"]["header"]) == {"cid": "2"}
        else:
            assert reason in reply.error.reason


def test_snapshot_validity_follows_the_session_history(tmp_path):
    from fedfm.core.federation import ClientState

    s = Snapshots(tmp_path, "run", "0")
    for sess, rnd in [(0, 1), (0, 2), (0, 3), (1, 3), (1, 4)]:
        s.save(ClientState(meta={"at": [sess, rnd]}), sess, rnd)
    # Session 1 resumed from round 2: session 0's round-3 snapshot is stale.
    assert s.latest(1, [[0, 2]]).meta == {"at": [1, 4]}
    # Session 2 resumed from round 3 (written by session 1): (1, 3) wins over (0, 3).
    assert s.latest(2, [[0, 2], [1, 3]]).meta == {"at": [1, 3]}
    # Session 2 resumed from round 2 after session 1 crashed early: back to (0, 2).
    assert s.latest(2, [[0, 2], [1, 2]]).meta == {"at": [0, 2]}
    s.prune(2, [[0, 2], [1, 2]], committed=2)
    assert sorted(p.name for p in s.folder.glob("*.json")) == ["s0000-r00002.json"]
    hist = S.run_sessions(tmp_path, -1)
    assert hist["session"] == 0 and hist["lineage"] == []
    hist2 = S.run_sessions(tmp_path, 5)
    assert hist2 == {"run_uid": hist["run_uid"], "session": 1, "lineage": [[0, 5]]}
    assert S.run_sessions(tmp_path, -1)["run_uid"] != hist["run_uid"]  # a fresh start


# --------------------------------------------------------------------------- server side


def test_fedavg_over_flower_equals_embedded(tmp_path):
    cfg = toy_config(tmp_path, "fedavg", name="emb", algo={"personal_eval": True})
    embedded_run(cfg)
    summary = flower_run({**cfg, "name": "flw", "runtime": "flower"}, tmp_path / "nodes")
    same_run(tmp_path / "emb", tmp_path / "flw")
    assert summary["bytes_up"] > 0 and summary["failed_clients"] == 0


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_replies_arriving_out_of_order_aggregate_as_on_embedded(tmp_path, algorithm):
    """Replies are folded in as they come, yet in the order of the messages on every runtime."""
    algo = {"server_opt": {"name": "fedadam", "lr": 0.05}} if algorithm == "fedavg" else {}
    cfg = toy_config(tmp_path, algorithm, name="emb", rounds=2, num_clients=5, algo=algo)
    embedded_run(cfg)
    flower_run({**cfg, "name": "flw"}, tmp_path / "nodes", grid_cls=ReversedGrid)
    same_run(tmp_path / "emb", tmp_path / "flw")


@pytest.mark.parametrize("algorithm", ["test-two-phase", "scaffold"])
def test_stateful_multi_exchange_algorithms_equal_embedded(tmp_path, algorithm):
    roles = {"roles": {"strong": 0.5, "weak": 0.25}, "fraction": 0.75}
    cfg = toy_config(tmp_path, algorithm, name="emb", rounds=3, clients=roles)
    emb = embedded_run(cfg)
    flw = flower_run({**cfg, "name": "flw"}, tmp_path / "nodes")
    same_run(tmp_path / "emb", tmp_path / "flw")
    assert emb.get("finish") == flw.get("finish")


def test_failing_clients_fail_as_on_embedded(tmp_path):
    # helpers.flower registers test-crashy in this process

    assert "test-crashy" in ALGORITHMS
    cfg = toy_config(tmp_path, "test-crashy", name="emb", rounds=1, num_clients=6)
    cfg["clients"] = {"min_clients": 2}
    embedded_run(cfg)
    flower_run(
        {**cfg, "name": "flw"},
        tmp_path / "nodes",
        options={"imports": ["helpers.flower"]},
    )
    same_run(tmp_path / "emb", tmp_path / "flw")
    fails = untimed_rows(tmp_path / "flw" / "failures.jsonl")
    assert {f["client"] for f in fails} == {"1", "2", "3", "4"}
    # Client 1 crashed: its "touched" flag was never committed on its node.
    assert not list((tmp_path / "nodes" / "node1").rglob("*.json"))
    assert list((tmp_path / "nodes" / "node0").rglob("*.json"))


def test_dead_and_missing_supernodes_are_failed_clients(tmp_path, caplog):
    cfg = toy_config(tmp_path, "fedavg", name="flw", rounds=2, num_clients=4)
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        flower_run(cfg, tmp_path / "nodes", dead={1}, num_nodes=3, options={"timeout_s": 0.5})
    fails = untimed_rows(tmp_path / "flw" / "failures.jsonl")
    by = {(f["round"], f["client"]): f["error"] for f in fails}
    assert by[(1, "1")].startswith("client 1: no reply within")
    assert by[(1, "3")] == "client 3: no SuperNode serves this client"
    rows = untimed_rows(tmp_path / "flw" / "metrics.jsonl")
    assert [r.get("clients") for r in rows[1:]] == [2, 2] and rows[2]["failed"] == 2
    # The ledger holds only messages that reached their client: neither the missing client's
    # nor the dead node's (never answered, so never shown to have arrived).
    audit = untimed_rows(tmp_path / "flw" / "audit.jsonl")
    assert {(a["client"], a["direction"]) for a in audit if a["round"] == 1} == {
        (c, d) for c in "02" for d in ("down", "up")
    }
    for r in rows:
        down = sum(
            a["bytes"] for a in audit if a["round"] == r["round"] and a["direction"] == "down"
        )
        assert r["bytes_down"] == down
    # The undelivered messages are in failures.jsonl, with why and their size.
    sent = {a["client"]: a["bytes"] for a in audit if a["round"] == 1 and a["direction"] == "down"}
    assert {(f["client"], f["delivery"]) for f in fails if f["round"] == 1} == {
        ("1", "unconfirmed"),
        ("3", "not sent"),
    }
    assert all(f["bytes"] == sent["0"] > 0 for f in fails if f["round"] == 1)
    # The run ends with who never took part, also kept in the session history.
    sessions = json.loads((tmp_path / "flw" / "flower_sessions.json").read_text())
    assert sessions["sessions"][-1]["absent"] == {
        "1": "connected, never answered",
        "3": "never connected",
    }
    assert "clients that took no part in this session: 1 (connected, never answered), 3" in (
        caplog.text
    )


def test_failed_counts_clients_and_failed_messages_counts_what_they_missed(tmp_path):
    """A dead SuperNode misses both exchanges of every round: one failed client a round
    (not two), and the two messages it missed counted apart; the summary counts the client
    once for the run."""
    cfg = toy_config(tmp_path, "fedavg", name="flw", rounds=2, num_clients=3)
    cfg["algo"] = {"personal_eval": True}  # train, then evaluate on every client
    flower_run(cfg, tmp_path / "nodes", dead={1}, num_nodes=3, options={"timeout_s": 0.5})
    rows = untimed_rows(tmp_path / "flw" / "metrics.jsonl")
    assert [(r["failed"], r["failed_messages"]) for r in rows] == [(1, 1), (1, 2), (1, 2)]
    summary = json.loads((tmp_path / "flw" / "summary.json").read_text())
    assert summary["failed_clients"] == 1 and summary["failed_messages"] == 5  # round 0: 1


def test_a_restarted_supernode_serves_its_client_again_with_its_state(tmp_path):
    cfg = toy_config(tmp_path, "test-two-phase", name="flw", rounds=3, num_clients=3)
    # Events fire as a round's first message is pushed and act from the next exchange on:
    # partition 1's SuperNode goes offline after round 1 and is back (a new node) for round 3.
    events = {1: lambda g: g.offline.add(101), 2: lambda g: g.restart(101, 201)}
    summary = flower_run(cfg, tmp_path / "nodes", events=events)
    fails = untimed_rows(tmp_path / "flw" / "failures.jsonl")
    assert [(f["round"], f["client"], f["error"]) for f in fails] == [
        (2, "1", "client 1: no SuperNode serves this client")
    ]
    # Client 1 answered in rounds 1 and 3: its counter came back from the node's disk.
    assert summary["finish"] == {"0": 3, "1": 2, "2": 3}


def test_too_few_survivors_end_the_run_clearly(tmp_path):
    cfg = toy_config(tmp_path, "fedavg", name="flw", rounds=1, num_clients=2)
    cfg["clients"] = {"min_clients": 2}
    with pytest.raises(TooFewClientsError, match="round 1: only 1 of 2 clients answered"):
        flower_run(cfg, tmp_path / "nodes", dead={0}, options={"timeout_s": 0.2})


def test_resume_after_a_crash_mid_round_equals_an_uninterrupted_run(tmp_path):
    roles = {"roles": {"strong": 0.5, "weak": 0.5}}
    cfg = toy_config(tmp_path, "test-two-phase", name="full", rounds=4, clients=roles)
    full = flower_run(cfg, tmp_path / "nodes_full")
    part = {**cfg, "name": "part"}
    # Pushes: 1 handshake + 1 profile, then 3 exchanges per round: the crash hits round 3
    # after its first exchange, once clients have written round-3 state.
    with pytest.raises(KeyboardInterrupt):
        flower_run(part, tmp_path / "nodes", crash_after=2 + 2 * 3 + 1)
    stale = list((tmp_path / "nodes").rglob("s0000-r00003.json"))
    assert stale  # clients did change state in the interrupted round
    resumed = flower_run(part, tmp_path / "nodes", resume=True)
    same_run(tmp_path / "full", tmp_path / "part")
    assert resumed["finish"] == full["finish"]
    sessions = json.loads((tmp_path / "part" / "flower_sessions.json").read_text())
    assert [s["resumed_from"] for s in sessions["sessions"]] == [-1, 2]


# --------------------------------------------------------------------------- simulation


def test_simulation_engine_equals_embedded(tmp_path):
    """Flower's simulation engine (Ray actors) end to end, against the embedded runtime."""
    roles = {"roles": {"strong": 0.5, "weak": 0.5}}
    cfg = toy_config(tmp_path, "test-two-phase", name="emb", rounds=2, clients=roles)
    emb = embedded_run(cfg)
    sim_cfg = load_config({**cfg, "name": "sim", "runtime": "flower-sim"})
    # Ray starts its actors slowly on a loaded machine (the suite runs a worker per core).
    opts = {"imports": ["helpers.flower"], "sim_cpus": 2, "node_wait_s": 600}
    sim = run(sim_cfg, progress=False, options=opts)
    same_run(tmp_path / "emb", tmp_path / "sim")
    assert sim["finish"] == emb["finish"]
    # Client states were kept per node for resume, inside the run folder.
    assert list((tmp_path / "sim" / "flower_client_states").rglob("*.safetensors"))


# --------------------------------------------------------------------------- commands


def test_commands_check_their_arguments(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedfm.cli import app
    from fedfm.runtime.flower import deploy as D

    runner = CliRunner()
    for cmd in ("serve", "client", "flower-certs"):
        assert runner.invoke(app, [cmd, "--help"]).exit_code == 0
    res = runner.invoke(app, ["serve", "tabular-fedavg"])
    assert isinstance(res.exception, ConfigError) and "--insecure to run without TLS" in str(
        res.exception
    )
    res = runner.invoke(app, ["client", "--superlink", "h:1", "--partition-id", "2",
                              "--num-partitions", "2", "--insecure"])  # fmt: skip
    assert "partition-id: 2 is not in 0..1" in str(res.exception)
    res = runner.invoke(app, ["client", "--superlink", "h:1", "--partition-id", "0",
                              "--num-partitions", "2"])  # fmt: skip
    assert "give --root-certificates CA_FILE, or --insecure" in str(res.exception)
    # flower-certs writes a CA, a SuperLink certificate valid for the hosts, and node keys.
    assert runner.invoke(app, ["flower-certs", str(tmp_path), "--nodes", "2"]).exit_code == 0
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert (tmp_path / "node1.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    # serve passes validated options and TLS files through to the deployment engine.
    seen = {}
    monkeypatch.setattr(D, "serve", lambda cfg, **kw: seen.update(cfg=cfg, **kw) or {
        "name": cfg.name, "primary": "acc", "final": {"acc": 1.0}, "rounds": 2})  # fmt: skip
    res = runner.invoke(app, ["serve", "tabular-fedavg", "rounds=2", "--certificates",
                              str(tmp_path), "--flower", "timeout_s=30", "--node-key",
                              str(tmp_path / "node0.pub")])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert seen["cfg"].rounds == 2 and seen["cfg"].runtime == "flower"
    assert seen["options"] == {"timeout_s": 30} and seen["tls"].ca_cert == tmp_path / "ca.crt"
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="node authentication needs TLS"):
        D.serve(seen["cfg"], node_keys=[tmp_path / "node0.pub"])
    with pytest.raises(ConfigError, match="runs across machines"):
        run(seen["cfg"])


# --------------------------------------------------------------------------- every algorithm


def _registered() -> list[str]:
    fs.import_algorithms()
    return sorted(n for n, _ in ALGORITHMS.describe() if not n.startswith("test-"))


@pytest.mark.parametrize("algorithm", _registered())
def test_every_algorithm_runs_unchanged_on_flower(tmp_path, algorithm):
    """Each registered algorithm gives the embedded run's metrics, audit and failures."""
    if algorithm in fs.COVERED_ELSEWHERE:
        pytest.skip(f"{algorithm} on Flower: {fs.COVERED_ELSEWHERE[algorithm]}")
    cfg = fs.algorithm_config(tmp_path, algorithm)
    assert cfg is not None, f"no Flower test config for '{algorithm}' in helpers/flower.py"
    emb = embedded_run({**cfg, "name": "emb"})
    imports = {"imports": ["helpers.flower", *fs.ALGORITHM_MODULES]}
    flw = flower_run({**cfg, "name": "flw"}, tmp_path / "nodes", options=imports)
    same_run(tmp_path / "emb", tmp_path / "flw")
    assert emb.get("finish") == flw.get("finish")
