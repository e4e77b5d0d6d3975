"""The LLM algorithm of docs/design.md runs as printed, on a tiny Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedfm.algorithms.base import ALGORITHMS, Algorithm, ClientHalf
from fedfm.config import load_config
from fedfm.core.messages import Message, MessageKind
from fedfm.core.optim import ServerOptimizer
from fedfm.core.train import local_train
from fedfm.runtime import run as run_experiment
from helpers import REPO

DOC = REPO / "docs" / "design.md"


def _example() -> type:
    section = DOC.read_text().split("## Writing an LLM algorithm", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    names = {
        "Algorithm": Algorithm,
        "ClientHalf": ClientHalf,
        "Message": Message,
        "MessageKind": MessageKind,
        "ServerOptimizer": ServerOptimizer,
        "local_train": local_train,
    }
    exec(compile(code, str(DOC), "exec"), names)
    return names["DualAdapters"]


def test_the_documented_llm_algorithm_runs(tmp_path: Path) -> None:
    if "dual-adapters" not in ALGORITHMS:
        ALGORITHMS.register("dual-adapters", "docs example")(_example())
    cfg = load_config(
        {
            "name": "dual",
            "algorithm": "dual-adapters",
            "rounds": 2,
            "eval_before": False,
            "out_dir": str(tmp_path),
            "plots": False,
            "task": {
                "kind": "instruction",
                "model": "tiny-llama",
                "model_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 8},
                "source_options": {"per_domain_train": 6, "per_domain_test": 2},
                "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                "prompt": {"max_length": 96, "max_prompt_length": 64},
            },
            "partition": {"scheme": "iid", "num_clients": 2},
            "train": {"steps": 2, "batch_size": 4, "optimizer": "adamw", "lr": 1e-2},
        }
    )
    summary = run_experiment(cfg, progress=False)
    run = tmp_path / "dual"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows[1:]] == [2, 2] and rows[-1]["failed"] == 0
    answers = [
        json.loads(x) for x in (run / "artefacts" / "answers.jsonl").read_text().splitlines()
    ]
    assert [a["round"] for a in answers] == [1, 2] and all(len(a["texts"]) == 2 for a in answers)
    assert "artefacts/answers.jsonl" in summary["artefacts"]
    # Only the global adapter travels; each client's private adapter stays in its own state.
    audit = [json.loads(x) for x in (run / "audit.jsonl").read_text().splitlines()]
    train = [a for a in audit if a["kind"] == "train" and a["type"] == "arrays"]
    assert {a["field"] for a in train} == {"global"} and {a["tensors"] for a in train} == {8}
    latest = run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()
    states = load_file(str(latest / "clients.safetensors"))
    private = {
        cid: {k: v for k, v in states.items() if k.startswith(f"{cid}::private/")} for cid in "01"
    }
    assert len(private["0"]) == len(private["1"]) == 8
    b0 = [v for k, v in private["0"].items() if "lora_B" in k]
    b1 = [v for k, v in private["1"].items() if "lora_B" in k]
    assert all(float(b.abs().sum()) > 0 for b in b0)  # trained in stage 1
    assert any(not torch.equal(x, y) for x, y in zip(b0, b1, strict=True))  # one per client
