"""Tasks: what is learned (data, partitions, model builders, loss, evaluation).

A task is built deterministically from the run config, so every process (server, Flower
clients) rebuilds the same partitions; a client only reads its own. Algorithms reach data and
models only through the task.

:class:`Task` is the core every task has (clients' data, the model, batches, loss,
evaluation, what of a model travels). Beyond it a task may provide optional *capabilities*,
each a small protocol of documented methods (:class:`PublicSplit`, :class:`SourceRows`, ...;
:data:`CAPABILITIES` by name). A task class implements a capability's methods and declares
for which configs it provides it (:meth:`Task.provides`); an algorithm that needs one
checks for it when the config is loaded (:func:`require`, from
:meth:`fedfm.algorithms.base.Algorithm.check_task`), so a missing capability is one line
naming the field, never an error halfway through a run. Code reaches a capability's methods
through :func:`capable`, which gives the task typed as that protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

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


class PublicSplit(Protocol):
    """:data:`PUBLIC_SPLIT`: a public proxy split that no client holds."""

    def public_data(self) -> Any:
        """Public proxy data, disjoint from every client's by sample id."""
        ...


class SourceRows(Protocol):
    """:data:`SOURCE_ROWS`: the source's training rows by sample id, as task data."""

    def pool_ids(self) -> np.ndarray:
        """Sample ids of the source's training rows (the clients' pool)."""
        ...

    def rows(self, ids: Sequence[int]) -> Any:
        """The training rows with these sample ids, in the source's order.

        They are prepared exactly as client data.
        """
        ...


class SplitInputs(Protocol):
    """:data:`SPLIT_INPUTS`: model inputs of some rows of a labelled split."""

    def inputs(self, data: Any, idx: Sequence[int]) -> Any:
        """Model inputs of rows ``idx`` of ``data`` (one batch)."""
        ...


class ImageView(Protocol):
    """:data:`IMAGE_VIEW`: a split's images."""

    def images(self, data: Any) -> Tensor:
        """The images of ``data`` as one tensor ``[N, C, H, W]`` in [0, 1]."""
        ...


class TextView(Protocol):
    """:data:`TEXT_VIEW`: a split's raw texts."""

    def texts(self, data: Any) -> list[str]:
        """The raw texts of ``data``."""
        ...


class HasFoundationModel(Protocol):
    """:data:`FOUNDATION_MODEL`: the handle on the task's LLM."""

    def foundation_model(self) -> FoundationModel:
        """The handle on the task's LLM; see :mod:`fedfm.fm`.

        It gives the shared frozen base, named adapters, generation, features and DP-SGD.
        """
        ...


class ItemResults(Protocol):
    """:data:`ITEM_RESULTS`: one evaluation record per item."""

    def evaluate_items(
        self, model: nn.Module, data: Any
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`Task.evaluate` plus one record per evaluated item.

        Each record has ``id``, ``domain``, ``prompt``, ``reference``, ``answer`` and ``score``, for
        win rates and distribution analyses.
        """
        ...


class ControlCodes(Protocol):
    """:data:`CONTROL_CODES`: public control codes and each row's code."""

    def codes(self) -> list[str]:
        """The public control codes (labels, topics) in a fixed order."""
        ...

    def code_ids(self, data: Any) -> Tensor:
        """Each row's code as an index into :meth:`codes` (``[N]``)."""
        ...

    def code_labels(self) -> list[int | None]:
        """Each code's class label (``None`` where a code has none)."""
        ...

    def heldout(self) -> dict[str, Any]:
        """The server's real held-out rows, so a synthetic set can be tested on them later.

        They come as ``dataset``, ``source_options``, ``class_names`` and sample ``ids``
        (:mod:`fedfm.data.synthetic`).
        """
        ...


@dataclass(frozen=True)
class Capability:
    """An optional task capability.

    Attributes:
        protocol: The methods a task that provides it implements.
        help: What it is, in one line (named when an algorithm needs it).
        missing: The one-line refusal when a task lacks it (``{kind}``: the task's kind).
    """

    protocol: type
    help: str
    missing: str = "'{kind}' does not provide {name}"


CAPABILITIES: dict[str, Capability] = {
    PUBLIC_SPLIT: Capability(
        PublicSplit, "public_data(): a public proxy split that no client holds"
    ),
    SOURCE_ROWS: Capability(
        SourceRows,
        "pool_ids() and rows(ids): the source's training rows by sample id, as task data",
    ),
    SPLIT_INPUTS: Capability(
        SplitInputs, "inputs(data, idx): model inputs of some rows of a labelled split"
    ),
    IMAGE_VIEW: Capability(
        ImageView, "images(data): a split's images as one tensor [N, C, H, W] in [0, 1]"
    ),
    TEXT_VIEW: Capability(TextView, "texts(data): a split's raw texts"),
    FOUNDATION_MODEL: Capability(
        HasFoundationModel,
        "foundation_model(): the handle on the task's LLM (fedfm.fm)",
        "task '{kind}' has no foundation model (LLM algorithms need e.g. kind: instruction)",
    ),
    ITEM_RESULTS: Capability(
        ItemResults,
        "evaluate_items(model, data): one evaluation record per item",
        "task '{kind}' keeps no per-item results",
    ),
    CONTROL_CODES: Capability(
        ControlCodes,
        "codes(), code_ids(data), code_labels() and heldout(): public control codes, each"
        " row's code, each code's class label, and the real held-out rows by source and"
        " sample id",
    ),
}
"""Optional task capabilities by name."""

_BY_PROTOCOL: dict[type, str] = {cap.protocol: name for name, cap in CAPABILITIES.items()}
P = TypeVar("P")


def _methods(protocol: type) -> list[str]:
    """The methods a capability's protocol names."""
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


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
        """Held-out validation data of one client, disjoint from its training and test data.

        For choosing hyperparameters without the test numbers; None when the task keeps none.
        """
        return None

    def shifted(self, cid: str) -> frozenset[int]:
        """The classes whose rows this client relabels under a simulated concept shift.

        The shift is ``task.shift``; empty when the task simulates none.
        """
        return frozenset()

    def relabelled(self, cid: str, data: Any) -> Any | None:
        """The rows of ``data`` (one of the client's splits) in the classes it relabels.

        The relabelling is that of ``task.shift``; None when the client relabels none.
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

    # ----- what of a model travels -----
    def get_params(self, model: nn.Module, names: list[str] | None = None) -> dict[str, Tensor]:
        """Detached CPU copies of the tensors of ``model`` that travel.

        ``model`` is from :meth:`build_model`; messages, client states and checkpoints carry exactly
        these.

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
        """Key of each trainable tensor that travels -> its parameter name in ``model``.

        How FedProx's reference and SCAFFOLD's correction, keyed as the messages are, reach the
        training loop (:func:`fedfm.core.train.param_names`).
        """
        return param_names(model)

    def save_adapter(self, model: nn.Module, folder: Path) -> bool:
        """Writes ``model``'s adapter in peft's format into ``folder``; ``False`` when it has none.

        Writes only when the model is an adapter of the task's foundation model (what ``fedfm eval``
        reads); otherwise writes nothing.
        """
        return False

    # ----- optional capabilities (CAPABILITIES) -----
    @classmethod
    def provides(cls, cfg: TaskConfig) -> frozenset[str]:
        """The optional capabilities this task provides with config ``cfg``.

        The task implements each one's protocol.
        """
        return frozenset()


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
    cap = CAPABILITIES[capability]
    if capability not in task_cls.provides(task_cfg):
        raise ConfigError(
            field,
            f"{needed_for} needs {cap.help}; task '{task_cfg.kind}' does not"
            " provide it with this config",
        )
    lacking = [m for m in _methods(cap.protocol) if not callable(getattr(task_cls, m, None))]
    if lacking:  # declared but not implemented: a fault of the task class
        raise ConfigError(
            "task.kind", f"task '{task_cfg.kind}' declares {capability} but lacks {lacking}"
        )


def capable(task: Task, protocol: Callable[..., P]) -> P:
    """``task`` typed as a capability's protocol, once it provides that capability.

    Algorithms check what they need with :func:`require` at config load; this is where they
    reach the methods.

    Raises:
        ConfigError: The task does not provide it with its config (field ``task.kind``).
    """
    name = _BY_PROTOCOL[cast(type, protocol)]
    if name not in task.provides(task.cfg):
        kind = task.cfg.kind
        raise ConfigError("task.kind", CAPABILITIES[name].missing.format(kind=kind, name=name))
    return cast(P, task)


def split_view(task: Task, capability: str, data: Any) -> Any:
    """``data`` through the view named by ``capability``.

    The view is :data:`IMAGE_VIEW` or :data:`TEXT_VIEW`.

    Raises:
        ValueError: ``capability`` is not a view of a split.
        ConfigError: The task does not provide that view (field ``task.kind``).
    """
    if capability == IMAGE_VIEW:
        return capable(task, ImageView).images(data)
    if capability == TEXT_VIEW:
        return capable(task, TextView).texts(data)
    raise ValueError(f"'{capability}' is not a view of a split")


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Accuracy, macro-F1 and cross-entropy of logits ``[N, C]`` against labels ``[N]``."""
    pred = logits.argmax(-1)
    return {
        "acc": float((pred == y).float().mean()),
        "macro_f1": macro_f1(pred, y),
        "loss": float(nn.functional.cross_entropy(logits, y)),
    }


TASKS: Registry[type[Task]] = Registry("task", "task.kind")
