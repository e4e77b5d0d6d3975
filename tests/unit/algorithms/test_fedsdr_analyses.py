"""FedSDR's analyses: the server's pairwise cosines of client updates (by hand) and
``fedfm analyze`` on a tiny finished run."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from fedfm.algorithms.fedavg import FedAvg, FedAvgFamilyConfig, Scaffold, ScaffoldConfig
from fedfm.analyze import client_answers
from fedfm.config import load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.messages import Message
from fedfm.eval.compare import UpdateCosines, js_divergence, tfidf_cosine
from fedfm.fm import FoundationModel
from fedfm.models.generation import Reply
from fedfm.runtime import run as run_experiment
from helpers import toy
from helpers.bases import FEDSDR
from helpers.cli import run_cli
from helpers.config import make_config

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


# ----------------------------------------------------------------------------- fedfm analyze


def _tiny_run(out: Path, name: str, fedsd: bool) -> Path:
    fedsd_cfg = {
        "enabled": fedsd,
        "decoding": {"max_new_tokens": 8},
        "cache_dir": str(out / "cache"),
    }
    algo = {"update_cosines": True, "fedsd": fedsd_cfg}
    run_experiment(
        load_config(make_config(FEDSDR, out, name=name, algorithm="fedavg", algo=algo)),
        progress=False,
    )
    return out / name


def _echo_teacher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrites that restate the reference after two filler words (kept by the filter)."""

    def generate(self: FoundationModel, prompts: Sequence[str], adapters: Any, **kw: Any) -> list:
        refs = [
            re.search(r"### Reference Answer:\n(.*?)\n\n### Response:", p, re.S) for p in prompts
        ]
        return [Reply(f"Well, basically {m.group(1) if m else ''}", False) for m in refs]

    monkeypatch.setattr(FoundationModel, "generate_replies", generate)


def test_analyze_prints_a_runs_analyses_from_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    _echo_teacher(monkeypatch)
    base = _tiny_run(tmp_path, "base", fedsd=False)
    sd = _tiny_run(tmp_path, "sd", fedsd=True)
    raw, dist = client_answers(sd)
    assert dist is not None and client_answers(base)[1] is None
    # Kept rewrites are the teacher's echo of the whole reference; fallbacks keep the
    # reference.
    pairs = [(d, r) for c in raw for d, r in zip(dist[c], raw[c], strict=True)]
    assert any(d != r for d, r in pairs)
    assert all(d == r or d == f"Well, basically {r}".strip() for d, r in pairs)
    code, out, err = run_cli(["analyze", str(base), str(sd)], monkeypatch, capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (sd / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:  # both rounds' cosines, as logged, in the run's column
        assert f"| {r['round']} | " in out
        assert f"{r['update_cos/mean']:.4f} / {r['update_cos/min']:.4f}" in out
    assert f"| rewrites kept | — | {rows[0]['fedsd/kept_share']:.3f} |" in out
    kept, cut = rows[0]["fedsd/kept_share/math"], rows[0]["fedsd/fallback_truncated/math"]
    assert f"| sd | math | {kept:.3f} | {cut:.3f} |" in out
    js = f"{js_divergence(raw):.4f}"
    assert f"| JS divergence, raw answers (bits) | {js} | {js} |" in out
    assert f"| JS divergence, distilled answers (bits) | — | {js_divergence(dist):.4f} |" in out
    assert f"| TF-IDF cosine, distilled answers | — | {tfidf_cosine(dist):.4f} |" in out
    assert "| sd | base |" in out  # the head-to-head row


def test_analyze_refuses_a_path_that_is_not_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, _, err = run_cli(["analyze", str(tmp_path / "nope")], monkeypatch, capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "run:" in err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.yaml").write_text("name: x\n")
    code, _, err = run_cli(["analyze", str(tmp_path / "half")], monkeypatch, capsys)
    assert code == 2 and "no metrics.jsonl" in err
