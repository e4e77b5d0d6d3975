"""What an algorithm leaves in the run folder: privacy.json and its artefacts, across resume."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientHalf
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message, MessageKind
from fedfm.core.privacy import analytic_gaussian_sigma
from fedfm.report import compare
from fedfm.runtime import run
from helpers import toy  # noqa: F401  (registers the toy task)
from helpers.config import make_config


def _sigma(task: Any, run: Any) -> float:
    # Targets are clipped to [-4, 4]: one record moves a client's mean by <= 8 / n.
    n = task.num_examples(task.client_data("0"))
    return analytic_gaussian_sigma(1.0, run.privacy.delta, 8.0 / n)


class NoisyMeansClient(ClientHalf):
    """Sends a noisy mean of the client's targets."""

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.sigma = _sigma(task, run)

    def handlers(self) -> dict[str, Any]:
        return {"mean": self._mean}

    def _mean(self, ctx: ClientContext, msg: Message) -> Message:
        y = ctx.data[1].clamp(-4, 4)
        gen = torch.Generator().manual_seed(ctx.rng_seed("noise"))
        noisy = y.mean() + self.sigma * torch.randn((), generator=gen)
        return Message("mean", {"mean": {"y": noisy.reshape(1)}}, {"n": len(y)})


class NoisyMeans(Algorithm):
    """Each round, sampled clients send a noisy mean of their targets (analytic Gaussian)."""

    Client = NoisyMeansClient
    messages = (MessageKind("mean", up_arrays=("mean",), up_meta=("n",)),)
    stray = False

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.total = 0.0
        self.n = task.num_examples(task.client_data("0"))
        self.sigma = _sigma(task, run)

    def round(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("mean"), self.sample(fed))
        for cid in replies:
            self.privacy.add_gaussian(cid, self.sigma, 8.0 / self.n, name="mean", analytic=True)
        self.total += sum(float(r.arrays["mean"]["y"]) for r in replies.values())
        # Artefacts: a log that grows, a file rewritten each round, one written once.
        self.artefacts.append_jsonl(
            "log/means.jsonl", [{"round": fed.rnd, "clients": list(replies)}]
        )
        self.artefacts.write_json("latest.json", {"round": fed.rnd, "total": self.total})
        if fed.rnd == 3:
            self.artefacts.write_text("third.txt", f"{self.total:.6f}\n")
        if self.stray and fed.rnd == 3:  # in a process that dies before round 3's checkpoint
            self.artefacts.write_text("stray.txt", "from a round that never completed\n")
        return {"total": self.total}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"total": self.total}

    def load_state_dict(self, arrays: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.total = meta["total"]


if "test-noisy-means" not in ALGORITHMS:
    ALGORITHMS.register("test-noisy-means", "test: analytic Gaussian means")(NoisyMeans)


# The analytic Gaussian means of test-noisy-means on half of four toy clients (fedfm's defaults
# otherwise: seed 0, its own training settings).
RECORDS: dict[str, Any] = {
    "algorithm": "test-noisy-means",
    "rounds": 4,
    "task": {"kind": "toy", "num_clients": 4},
    "clients": {"fraction": 0.5},
    "plots": False,
}


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_privacy_json_summary_and_report(tmp_path: Path) -> None:
    summary = run(load_config(make_config(RECORDS, tmp_path, name="dp")), progress=False)
    report = _json(tmp_path / "dp" / "privacy.json")
    assert report["delta"] == 1e-5 and report["accountant"] == "rdp"
    counts = {c: 0 for c in "0123"}
    for e in report["entries"]:
        counts[e["client"]] += e["count"]
        assert e["kind"] == "analytic-gaussian" and e["name"] == "mean"
    assert sum(counts.values()) == 4 * 2  # rounds x sampled clients
    worst = max(report["clients"], key=lambda c: report["clients"][c]["epsilon"])
    assert report["run"] == {"epsilon": report["clients"][worst]["epsilon"], "worst_client": worst}
    assert summary["privacy"] == {
        "epsilon": report["run"]["epsilon"],
        "delta": 1e-5,
        "accountant": "rdp",
        "noise": "secret",
        "relation": "add or remove one record at one client",
    }
    run(
        load_config(make_config(RECORDS, tmp_path, name="tight", privacy={"accountant": "pld"})),
        progress=False,
    )
    tight = _json(tmp_path / "tight" / "privacy.json")
    assert tight["run"]["epsilon"] < report["run"]["epsilon"]
    table = compare([tmp_path / "dp", tmp_path / "tight"])
    assert "epsilon (delta)" in table.splitlines()[0]
    assert f"{report['run']['epsilon']:.3g} (1e-05)" in table


def test_the_ledger_is_checkpointed_and_resumed(tmp_path: Path) -> None:
    run(load_config(make_config(RECORDS, tmp_path, name="straight", rounds=5)), progress=False)
    run(load_config(make_config(RECORDS, tmp_path, name="resumed", rounds=2)), progress=False)
    run(
        load_config(make_config(RECORDS, tmp_path, name="resumed", rounds=5)),
        resume=True,
        progress=False,
    )
    straight = _json(tmp_path / "straight" / "privacy.json")
    assert _json(tmp_path / "resumed" / "privacy.json") == straight
    a = _json(tmp_path / "straight" / "summary.json")["privacy"]
    assert _json(tmp_path / "resumed" / "summary.json")["privacy"] == a


def _files(run: Path) -> dict[str, bytes]:
    folder = run / "artefacts"
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_artefacts_are_published_listed_and_survive_a_crash_before_the_checkpoint(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import hashlib

    import fedfm.engine as engine

    summary = run(load_config(make_config(RECORDS, tmp_path, name="straight")), progress=False)
    straight = _files(tmp_path / "straight")
    assert set(straight) == {"index.json", "log/means.jsonl", "latest.json", "third.txt"}
    log = [json.loads(x) for x in straight["log/means.jsonl"].decode().splitlines()]
    assert [r["round"] for r in log] == [1, 2, 3, 4]
    assert json.loads(straight["index.json"])["files"] == [
        "latest.json",
        "log/means.jsonl",
        "third.txt",
    ]
    listed = summary["artefacts"]
    assert set(listed) == {
        "artefacts/latest.json",
        "artefacts/log/means.jsonl",
        "artefacts/third.txt",
        "privacy.json",
    }
    for rel, info in listed.items():
        data = (tmp_path / "straight" / rel).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    # A run that dies after publishing round 3 but before checkpointing it.
    real = engine._checkpoint

    def dies_at_round_3(folder: Any, rnd: int, *args: Any) -> None:
        if rnd == 3:
            raise KeyboardInterrupt
        real(folder, rnd, *args)

    monkeypatch.setattr(engine, "_checkpoint", dies_at_round_3)
    monkeypatch.setattr(NoisyMeans, "stray", True)
    with contextlib.suppress(KeyboardInterrupt):
        run(load_config(make_config(RECORDS, tmp_path, name="crashed")), progress=False)
    crashed = tmp_path / "crashed"
    assert {"stray.txt", "third.txt"} <= set(_files(crashed))  # round 3 was published
    (crashed / "artefacts" / "notes.txt").write_text("the user's own file\n")
    monkeypatch.setattr(engine, "_checkpoint", real)
    monkeypatch.setattr(NoisyMeans, "stray", False)
    resumed = run(
        load_config(make_config(RECORDS, tmp_path, name="crashed")), resume=True, progress=False
    )
    files = _files(crashed)
    assert files.pop("notes.txt") == b"the user's own file\n"  # never written by fedfm: kept
    assert files == straight  # stray.txt removed, the log holds each round once
    assert resumed["artefacts"] == summary["artefacts"]


def test_artefact_names_are_checked_and_contents_readable() -> None:
    from fedfm.core.artefacts import Artefacts
    from fedfm.errors import FedfmError

    art = Artefacts()
    for bad in ("../x", "/etc/passwd", ".hidden", "index.json", "a//b", "", "a b"):
        try:
            art.write_text(bad, "x")
        except FedfmError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    art.append_jsonl("sel/c0.jsonl", [{"a": 1}])
    art.append_jsonl("sel/c0.jsonl", [{"a": 2}])
    assert art.read_bytes("sel/c0.jsonl") == b'{"a": 1}\n{"a": 2}\n'
    art.write_json("x.json", {"k": [1, 2]})
    assert art.read_json("x.json") == {"k": [1, 2]} and art.names() == ["sel/c0.jsonl", "x.json"]
    assert "x.json" in art and "y" not in art


def test_bytes_are_split_into_arrays_and_meta(tmp_path: Path) -> None:
    summary = run(
        load_config(make_config(RECORDS, tmp_path, name="bytes", rounds=2)), progress=False
    )
    rows = [json.loads(x) for x in (tmp_path / "bytes" / "metrics.jsonl").read_text().splitlines()]
    audit = [json.loads(x) for x in (tmp_path / "bytes" / "audit.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        # Two sampled clients each send one float32 tensor and {"n": 24} (2 bytes of JSON).
        assert (row["bytes_up_arrays"], row["bytes_up_meta"]) == (2 * 4, 2 * 2)
        assert row["bytes_up"] == row["bytes_up_arrays"] + row["bytes_up_meta"]
        assert (row["bytes_down"], row["bytes_down_arrays"], row["bytes_down_meta"]) == (0, 0, 0)
        for kind in ("arrays", "meta"):
            ledger = sum(
                a["bytes"]
                for a in audit
                if a["round"] == row["round"] and a["direction"] == "up" and a["type"] == kind
            )
            assert row[f"bytes_up_{kind}"] == ledger
    for key in ("bytes_up", "bytes_up_arrays", "bytes_up_meta", "bytes_down_meta"):
        assert summary[key] == sum(r[key] for r in rows)
