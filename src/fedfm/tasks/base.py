"""Tasks: what is learned (data, partitions, model builders, loss, evaluation).

A task is built deterministically from the run config, so every process (server, Flower
clients) rebuilds the same partitions; a client only reads its own. Algorithms reach data and
models only through the task.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from fedfm.registry import Registry

if TYPE_CHECKING:
    from fedfm.config import RunConfig


class TaskConfig(BaseModel):
    """Base of task configs: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
    kind: str


class Task(ABC):
    """A federated learning task.

    Attributes:
        Config: The task's config model.
        kind: ``"classification"``, ``"regression"`` or ``"lm"``.
        primary: Name of the headline metric (e.g. ``"acc"``, ``"rmse"``, ``"rougeL"``).
        higher_is_better: Direction of the headline metric.
    """

    Config: ClassVar[type[TaskConfig]] = TaskConfig
    kind: str = "classification"
    primary: str = "acc"
    higher_is_better: bool = True

    def __init__(self, cfg: TaskConfig, run: RunConfig) -> None:
        self.cfg = cfg
        self.run = run

    @abstractmethod
    def client_ids(self) -> list[str]:
        """All client ids, in a stable order."""

    @abstractmethod
    def client_data(self, cid: str) -> Any:
        """Training data of one client."""

    @abstractmethod
    def client_test_data(self, cid: str) -> Any:
        """Held-out local data of one client (personalised evaluation)."""

    def client_val_data(self, cid: str) -> Any | None:
        """Held-out validation data of one client, disjoint from its training and test data
        (for choosing hyperparameters without the test numbers); None when the task keeps none.
        """
        return None

    @abstractmethod
    def test_data(self) -> Any:
        """Global held-out data (server-side evaluation)."""

    @abstractmethod
    def num_examples(self, data: Any) -> int:
        """Number of examples in ``data``."""

    @abstractmethod
    def build_model(self, seed: int = 0, **overrides: Any) -> nn.Module:
        """A freshly initialised trainable model; ``overrides`` change its architecture."""

    @abstractmethod
    def batches(self, data: Any, batch_size: int, seed: int) -> Iterator[Any]:
        """An endless iterator of shuffled batches (reshuffled every epoch, seeded)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, Any]:
        """Task loss and model outputs for a batch."""

    @abstractmethod
    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        """Metrics of ``model`` on ``data`` (the primary metric included)."""

    def stats(self) -> dict[str, Any]:
        """Partition statistics saved in the run folder (sizes, label histograms)."""
        return {}


def macro_f1(pred: Tensor, y: Tensor) -> float:
    """Unweighted mean of per-class F1 = 2·TP / (2·TP + FP + FN) over the classes present in
    ``y`` or ``pred`` (both ``[N]`` class indices).

    Equal to ``sklearn.metrics.f1_score(y, pred, average="macro", zero_division=0)`` (tested);
    written out because sklearn validates its inputs on every call (about 4 ms), which
    dominated the evaluation of small models evaluated on every client every few rounds.
    """
    labels = torch.unique(torch.cat([y, pred]))  # [L]
    is_pred = pred[:, None] == labels[None, :]  # [N, L]
    is_true = y[:, None] == labels[None, :]
    tp = (is_pred & is_true).sum(0).double()
    # Every label occurs in y or pred, so the denominator tp+fp + tp+fn is at least 1.
    f1 = 2 * tp / (is_pred.sum(0) + is_true.sum(0)).double()
    return float(f1.mean())


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Accuracy, macro-F1 and cross-entropy of logits ``[N, C]`` against labels ``[N]``."""
    pred = logits.argmax(-1)
    return {
        "acc": float((pred == y).float().mean()),
        "macro_f1": macro_f1(pred, y),
        "loss": float(nn.functional.cross_entropy(logits, y)),
    }


TASKS: Registry[type[Task]] = Registry("task", "task.kind")
