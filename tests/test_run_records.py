"""What an algorithm leaves in the run folder: privacy.json and its artefacts, across resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import toy  # noqa: F401  (registers the toy task)
from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message, MessageKind
from fedfm.core.privacy import analytic_gaussian_sigma
from fedfm.engine import Engine
from fedfm.report import compare


class NoisyMeans(Algorithm):
    """Each round, sampled clients send a noisy mean of their targets (analytic Gaussian)."""

    messages = (MessageKind("mean", up_arrays=("mean",), up_meta=("n",)),)

    def __init__(self, cfg: AlgoConfig, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.total = 0.0
        # Targets are clipped to [-4, 4]: one record moves a client's mean by <= 8 / n.
        self.n = task.num_examples(task.client_data("0"))
        self.sigma = analytic_gaussian_sigma(1.0, run.privacy.delta, 8.0 / self.n)

    def handlers(self) -> dict[str, Any]:
        return {"mean": self._mean}

    def _mean(self, ctx: ClientContext, msg: Message) -> Message:
        y = ctx.data[1].clamp(-4, 4)
        gen = torch.Generator().manual_seed(ctx.rng_seed("noise"))
        noisy = y.mean() + self.sigma * torch.randn((), generator=gen)
        return Message("mean", {"mean": {"y": noisy.reshape(1)}}, {"n": len(y)})

    def round(self, fed: Federation) -> dict[str, float]:
        replies = fed.broadcast(Message("mean"), self.sample(fed))
        for cid in replies:
            self.privacy.add_gaussian(cid, self.sigma, 8.0 / self.n, name="mean", analytic=True)
        self.total += sum(float(r.arrays["mean"]["y"]) for r in replies.values())
        return {"total": self.total}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"total": self.total}

    def load_state_dict(self, arrays: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.total = meta["total"]


if "noisy-means" not in ALGORITHMS:
    ALGORITHMS.register("noisy-means", "test: analytic Gaussian means")(NoisyMeans)


def _cfg(out: Path, name: str, rounds: int = 4, **kw: Any) -> Any:
    return load_config(
        {
            "name": name,
            "algorithm": "noisy-means",
            "rounds": rounds,
            "task": {"kind": "toy", "num_clients": 4},
            "clients": {"fraction": 0.5},
            "out_dir": str(out),
            "plots": False,
            **kw,
        }
    )


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_privacy_json_summary_and_report(tmp_path: Path) -> None:
    summary = Engine(_cfg(tmp_path, "dp"), progress=False).run()
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
    }
    Engine(_cfg(tmp_path, "tight", privacy={"accountant": "pld"}), progress=False).run()
    tight = _json(tmp_path / "tight" / "privacy.json")
    assert tight["run"]["epsilon"] < report["run"]["epsilon"]
    table = compare([tmp_path / "dp", tmp_path / "tight"])
    assert "epsilon (delta)" in table.splitlines()[0]
    assert f"{report['run']['epsilon']:.3g} (1e-05)" in table


def test_the_ledger_is_checkpointed_and_resumed(tmp_path: Path) -> None:
    Engine(_cfg(tmp_path, "straight", rounds=5), progress=False).run()
    Engine(_cfg(tmp_path, "resumed", rounds=2), progress=False).run()
    Engine(_cfg(tmp_path, "resumed", rounds=5), resume=True, progress=False).run()
    straight = _json(tmp_path / "straight" / "privacy.json")
    assert _json(tmp_path / "resumed" / "privacy.json") == straight
    a = _json(tmp_path / "straight" / "summary.json")["privacy"]
    assert _json(tmp_path / "resumed" / "summary.json")["privacy"] == a
