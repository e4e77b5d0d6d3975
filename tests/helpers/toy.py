"""A tiny in-memory regression task for engine and runtime tests (no data files needed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from fedfm.core.federation import derive_seed
from fedfm.tasks.base import TASKS, Task, TaskConfig


class ToyConfig(TaskConfig):
    kind: str = "toy"
    num_clients: int = Field(6, ge=1)
    per_client: int = 24
    dim: int = 4


class ToyTask(Task):
    """Linear regression with client-specific shifts; every client has ``per_client`` rows."""

    Config = ToyConfig
    kind = "regression"
    primary = "rmse"
    higher_is_better = False

    def __init__(self, cfg: ToyConfig, run: Any) -> None:
        super().__init__(cfg, run)
        g = torch.Generator().manual_seed(derive_seed(run.seed, "toy"))
        w = torch.randn(cfg.dim, generator=g)
        self.data: dict[str, tuple[Tensor, Tensor]] = {}
        for i in range(cfg.num_clients):
            x = torch.randn(cfg.per_client, cfg.dim, generator=g) + 0.3 * i
            self.data[str(i)] = (x, x @ w + 0.1 * torch.randn(cfg.per_client, generator=g))
        xt = torch.randn(50, cfg.dim, generator=g)
        self.test = (xt, xt @ w)

    def client_ids(self) -> list[str]:
        return list(self.data)

    def client_data(self, cid: str) -> tuple[Tensor, Tensor]:
        return self.data[cid]

    def client_test_data(self, cid: str) -> tuple[Tensor, Tensor]:
        return self.data[cid]

    def test_data(self) -> tuple[Tensor, Tensor]:
        return self.test

    def num_examples(self, data: tuple[Tensor, Tensor]) -> int:
        return int(data[1].shape[0])

    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(self.cfg.dim, 1)

    def batches(self, data: tuple[Tensor, Tensor], batch_size: int, seed: int) -> Iterator[Any]:
        g = torch.Generator().manual_seed(seed)
        x, y = data
        while True:
            perm = torch.randperm(len(y), generator=g)
            for s in range(0, len(y), batch_size):
                yield x[perm[s : s + batch_size]], y[perm[s : s + batch_size]]

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
        out = model(batch[0]).squeeze(-1)
        return nn.functional.mse_loss(out, batch[1]), out

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        with torch.no_grad():
            mse = nn.functional.mse_loss(model(data[0]).squeeze(-1), data[1])
        return {"rmse": float(mse.sqrt()), "loss": float(mse)}


if "toy" not in TASKS:
    TASKS.register("toy", "in-memory linear regression for tests")(ToyTask)
