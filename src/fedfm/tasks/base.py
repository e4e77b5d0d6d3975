"""Tasks: what is learned (data, partitions, model builders, loss, evaluation).

A task is built deterministically from the run config, so every process (server, Flower
clients) rebuilds the same partitions; a client only reads its own. Algorithms reach data and
models only through the task.

Beyond the required API, a task may provide optional *capabilities*, each a small set of
documented methods (:data:`CAPABILITIES`). A task class says which it provides for a config
(:meth:`Task.provides`); an algorithm that needs one checks for it when the config is loaded
(:meth:`fedfm.algorithms.base.Algorithm.check_task`), so a missing capability is one line
naming the field, never an error halfway through a run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from fedfm.core.scratch import Scratch
from fedfm.core.train import get_params, param_names, set_params
from fedfm.errors import ConfigError
from fedfm.eval.metrics import tensor_macro_f1 as macro_f1
from fedfm.registry import Registry

if TYPE_CHECKING:
    from fedfm.config import RunConfig
    from fedfm.fm import FoundationModel


class TaskConfig(BaseModel):
    """Base of task configs: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    kind: str


PUBLIC_SPLIT = "public_split"
SOURCE_ROWS = "source_rows"
SPLIT_INPUTS = "split_inputs"
IMAGE_VIEW = "image_view"
TEXT_VIEW = "text_view"
FOUNDATION_MODEL = "foundation_model"
ITEM_RESULTS = "item_results"
CONTROL_CODES = "control_codes"

CAPABILITIES: dict[str, str] = {
    PUBLIC_SPLIT: "public_data(): a public proxy split that no client holds",
    SOURCE_ROWS: "pool_ids() and rows(ids): the source's training rows by sample id, as task data",
    SPLIT_INPUTS: "inputs(data, idx): model inputs of some rows of a labelled split",
    IMAGE_VIEW: "images(data): a split's images as one tensor [N, C, H, W] in [0, 1]",
    TEXT_VIEW: "texts(data): a split's raw texts",
    FOUNDATION_MODEL: "foundation_model(): the handle on the task's LLM (fedfm.fm)",
    ITEM_RESULTS: "evaluate_items(model, data): one evaluation record per item",
    CONTROL_CODES: (
        "codes(), code_ids(data), code_labels() and heldout(): public control codes, each row's"
        " code, each code's class label, and the real held-out rows by source and sample id"
    ),
}
"""Optional task capabilities: name -> the methods that provide it."""


class LabelledSplit(Protocol):
    """A split of labelled examples with stable sample ids (what :data:`SPLIT_INPUTS` serves).

    Attributes:
        y: Labels ``[N]``.
        ids: Stable sample ids ``[N]`` from the source.
    """

    y: Tensor
    ids: Tensor

    def __len__(self) -> int: ...

    def subset(self, idx: Tensor) -> LabelledSplit:
        """Rows ``idx`` as a new split."""
        ...


class Task(ABC):
    """A federated learning task.

    Attributes:
        Config: The task's config model.
        kind: ``"classification"``, ``"regression"`` or ``"lm"``.
        primary: Name of the headline metric (e.g. ``"acc"``, ``"rmse"``, ``"rougeL"``).
        higher_is_better: Direction of the headline metric.
        scratch: Modules this process builds once for both halves of the algorithm
            (:mod:`fedfm.core.scratch`).
    """

    Config: ClassVar[type[TaskConfig]] = TaskConfig
    kind: str = "classification"
    primary: str = "acc"
    higher_is_better: bool = True

    def __init__(self, cfg: TaskConfig, run: RunConfig) -> None:
        self.cfg = cfg
        self.run = run
        self.scratch = Scratch()

    @property
    def device(self) -> torch.device:
        """Where this task's models live and compute: the run's ``device`` on this machine."""
        return self.run.torch_device()

    @classmethod
    def check_run(cls, cfg: TaskConfig, run: RunConfig) -> None:
        """Refuses a task config that does not fit the rest of the run (e.g. its ``device``).

        Called when the config is loaded, after the task's own section is validated and
        before any data or model is loaded.

        Raises:
            ConfigError: Naming the task field that does not fit.
        """
        return None  # most tasks need nothing of the run

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

    def shifted(self, cid: str) -> frozenset[int]:
        """The classes whose rows this client relabels under a simulated concept shift
        (``task.shift``); empty when the task simulates none."""
        return frozenset()

    def relabelled(self, cid: str, data: Any) -> Any | None:
        """The rows of ``data`` (one of the client's splits) in the classes it relabels under
        ``task.shift``; None when the client relabels none."""
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

    # ----- what of a model travels -----
    def get_params(self, model: nn.Module, names: list[str] | None = None) -> dict[str, Tensor]:
        """Detached CPU copies of the tensors of ``model`` (from :meth:`build_model`) that
        travel: messages, client states and checkpoints carry exactly these.

        By default the model's trainable parameters and floating-point buffers by state-dict
        key, or the tensors it names itself (:func:`fedfm.core.train.get_params`; the text
        task's MiniLM LoRA sends its adapter under peft's saved keys, :mod:`fedfm.models.lora`).
        A task whose model is an adapter of its foundation model returns that adapter through
        the handle (``fm.get_adapter``), so FedIT's messages are in the same format.

        Args:
            model: A model of this task.
            names: Only these keys; all when None.
        """
        return get_params(model, names)

    def set_params(self, model: nn.Module, params: Mapping[str, Tensor]) -> None:
        """Copies ``params`` (keyed as :meth:`get_params`) into ``model``."""
        set_params(model, params)

    def param_names(self, model: nn.Module) -> dict[str, str]:
        """Key of each trainable tensor that travels -> its parameter name in ``model`` (how
        FedProx's reference and SCAFFOLD's correction, keyed as the messages are, reach the
        training loop; :func:`fedfm.core.train.param_names`)."""
        return param_names(model)

    def save_adapter(self, model: nn.Module, folder: Path) -> bool:
        """Writes ``model``'s adapter in peft's format into ``folder`` when the model is an
        adapter of the task's foundation model (what ``fedfm eval`` reads); ``False``,
        writing nothing, otherwise."""
        return False

    # ----- optional capabilities (CAPABILITIES) -----
    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """The optional capabilities this task provides with config ``cfg``."""
        return frozenset()

    def public_data(self) -> Any:
        """:data:`PUBLIC_SPLIT`: public proxy data, disjoint from every client's by sample id."""
        raise self._missing(PUBLIC_SPLIT)

    def pool_ids(self) -> np.ndarray:
        """:data:`SOURCE_ROWS`: sample ids of the source's training rows (the clients' pool)."""
        raise self._missing(SOURCE_ROWS)

    def rows(self, ids: Sequence[int]) -> Any:
        """:data:`SOURCE_ROWS`: the training rows with these sample ids, as task data.

        Rows come in the source's order and are prepared exactly as client data.
        """
        raise self._missing(SOURCE_ROWS)

    def inputs(self, data: Any, idx: Sequence[int]) -> Any:
        """:data:`SPLIT_INPUTS`: model inputs of rows ``idx`` of ``data`` (one batch)."""
        raise self._missing(SPLIT_INPUTS)

    def images(self, data: Any) -> Tensor:
        """:data:`IMAGE_VIEW`: the images of ``data`` as one tensor ``[N, C, H, W]`` in [0, 1]."""
        raise self._missing(IMAGE_VIEW)

    def texts(self, data: Any) -> list[str]:
        """:data:`TEXT_VIEW`: the raw texts of ``data``."""
        raise self._missing(TEXT_VIEW)

    def view(self, capability: str, data: Any) -> Any:
        """``data`` through the view named by ``capability`` (:data:`IMAGE_VIEW`, ...)."""
        views = {IMAGE_VIEW: self.images, TEXT_VIEW: self.texts}
        if capability not in views:
            raise ValueError(f"'{capability}' is not a view of a split")
        return views[capability](data)

    def _missing(self, capability: str) -> ConfigError:
        return ConfigError("task.kind", f"'{self.cfg.kind}' does not provide {capability}")

    def codes(self) -> list[str]:
        """:data:`CONTROL_CODES`: the public control codes (labels, topics) in a fixed order."""
        raise self._missing(CONTROL_CODES)

    def code_ids(self, data: Any) -> Tensor:
        """:data:`CONTROL_CODES`: each row's code as an index into :meth:`codes` (``[N]``)."""
        raise self._missing(CONTROL_CODES)

    def code_labels(self) -> list[int | None]:
        """:data:`CONTROL_CODES`: each code's class label (``None`` where a code has none)."""
        raise self._missing(CONTROL_CODES)

    def heldout(self) -> dict[str, Any]:
        """:data:`CONTROL_CODES`: the server's real held-out rows (``dataset``,
        ``source_options``, ``class_names``, sample ``ids``), so a synthetic set can be
        tested on them later (:mod:`fedfm.data.synthetic`)."""
        raise self._missing(CONTROL_CODES)

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


def require(
    task_cls: type[Task], task_cfg: TaskConfig, capability: str, field: str, needed_for: str
) -> None:
    """Refuses a task that lacks a capability an algorithm needs (called at config load).

    Args:
        task_cls: The task class.
        task_cfg: Its validated config.
        capability: A key of :data:`CAPABILITIES`.
        field: The config field that makes the algorithm need it (named in the error).
        needed_for: What the algorithm needs it for.

    Raises:
        ConfigError: The task does not provide the capability with this config.
    """
    if capability not in task_cls.provides(task_cfg):
        raise ConfigError(
            field,
            f"{needed_for} needs {CAPABILITIES[capability]}; task '{task_cfg.kind}' does not"
            " provide it with this config",
        )


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Accuracy, macro-F1 and cross-entropy of logits ``[N, C]`` against labels ``[N]``."""
    pred = logits.argmax(-1)
    return {
        "acc": float((pred == y).float().mean()),
        "macro_f1": macro_f1(pred, y),
        "loss": float(nn.functional.cross_entropy(logits, y)),
    }


TASKS: Registry[type[Task]] = Registry("task", "task.kind")
