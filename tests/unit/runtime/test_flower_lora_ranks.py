"""Mixed LoRA ranks on the Flower in-memory grid: the same global adapter as embedded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.bases import FEDSDR
from helpers.config import make_config
from helpers.grid import embedded_run, flower_run, same_run

pytest.importorskip("flwr.app")
pytestmark = pytest.mark.usefixtures("task_identity")


def _global_adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    """The server's adapter in the run's last checkpoint (``checkpoints/LATEST``)."""
    from safetensors.torch import load_file

    ckpt = run_dir / "checkpoints"
    last = ckpt / (ckpt / "LATEST").read_text().strip()
    state = load_file(str(last / "server.safetensors"))
    return {k: v for k, v in state.items() if k.startswith("params/")}


@pytest.mark.parametrize(
    ("mode", "lora"),
    [
        # Re-projection: ranks 1, 2 and 4 of a global rank 4.
        ("svd", {"r": 4, "client_ranks": [1, 2, 4]}),
        # Stacking: 2 rounds of 1 + 2 + 1 components fill a global capacity of 8.
        ("flora", {"r": 8, "client_ranks": [1, 2, 1]}),
    ],
)
def test_mixed_ranks_on_flower_give_the_embedded_global_adapter(
    tmp_path: Path, mode: str, lora: dict[str, Any]
) -> None:
    cfg = make_config(FEDSDR, tmp_path, name="emb", algorithm="fedavg", seed=3)
    cfg["task"]["lora"] = {**cfg["task"]["lora"], **lora, "rank_mode": mode}
    embedded_run(cfg)
    # One client per domain (a natural partition of three domains).
    flower_run({**cfg, "name": "flw", "runtime": "flower"}, tmp_path / "nodes", num_partitions=3)
    same_run(tmp_path / "emb", tmp_path / "flw")  # metrics and each client's own bytes
    emb, flw = _global_adapter(tmp_path / "emb"), _global_adapter(tmp_path / "flw")
    assert emb and emb.keys() == flw.keys()
    for key, value in emb.items():
        assert torch.equal(value, flw[key]), key
    # The adapter moved: both runtimes trained and aggregated, not just kept the initial one.
    b = [v for k, v in emb.items() if "lora_B" in k]
    assert b and any(float(v.abs().sum()) > 0 for v in b)
    # Each client sent its own rank: three ranks, three sizes on the Flower ledger.
    rows = [json.loads(x) for x in (tmp_path / "flw" / "audit.jsonl").read_text().splitlines()]
    up = {
        r["client"]: r["bytes"]
        for r in rows
        if (r["kind"], r["direction"], r["type"]) == ("train", "up", "arrays")
    }
    assert len(set(up.values())) == len(set(lora["client_ranks"]))
