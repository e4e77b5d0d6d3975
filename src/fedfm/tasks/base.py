"""Tasks: what is learned (data, partitions, model builders, loss, evaluation).

A task is built deterministically from the run config, so every process (server, Flower
clients) rebuilds the same partitions; a client only reads its own. Algorithms reach data and
models only through the task.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict
from sklearn.metrics import f1_score
from torch import Tensor, nn

from fedfm.errors import ConfigError
from fedfm.registry import Registry

if TYPE_CHECKING:
    from fedfm.config import RunConfig
    from fedfm.fm import FoundationModel


class TaskConfig(BaseModel):
    """Base of task configs: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
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

    # ----- capabilities: tasks that have one override these -----
    def evaluate_items(
        self, model: nn.Module, data: Any
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`evaluate` plus one record per evaluated item (``id``, ``domain``, ``prompt``,
        ``reference``, ``answer``, ``score``), for win rates and distribution analyses.

        Raises:
            ConfigError: The task keeps no per-item results (field ``task.kind``).
        """
        raise ConfigError("task.kind", f"task '{self.cfg.kind}' keeps no per-item results")

    def foundation_model(self) -> FoundationModel:
        """The handle on the task's LLM (shared frozen base, named adapters, generation,
        features, DP-SGD); see :mod:`fedfm.fm`.

        Raises:
            ConfigError: The task has no foundation model (field ``task.kind``); an LLM
                algorithm asks for it when it is built, so this surfaces at config load.
        """
        raise ConfigError(
            "task.kind",
            f"task '{self.cfg.kind}' has no foundation model (LLM algorithms need e.g. "
            "kind: instruction)",
        )


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Accuracy, macro-F1 and cross-entropy of logits ``[N, C]`` against labels ``[N]``."""
    pred = logits.argmax(-1)
    return {
        "acc": float((pred == y).float().mean()),
        "macro_f1": float(f1_score(y.numpy(), pred.numpy(), average="macro", zero_division=0)),
        "loss": float(nn.functional.cross_entropy(logits, y)),
    }


TASKS: Registry[type[Task]] = Registry("task", "task.kind")
