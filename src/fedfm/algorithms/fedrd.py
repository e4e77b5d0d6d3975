"""FedRD: federated reprogramming knowledge distillation, and its baselines.

Paper: FedRD (federated reprogramming knowledge distillation), "A Federated Learning and
Knowledge Distillation Approach": memory-efficient federated fine-tuning of foundation models
for medical imaging, the foundation model kept on the server (its setting: PMC-CLIP as ``F_t``,
ISIC2018 skin-lesion classification, lightweight students such as ResNet18 on the clients).

The server holds a frozen foundation model ``F_t``, a trainable reprogramming module ``φ``
(residual blocks over ``F_t``'s features), a shared FC head ``g`` and the global student
``F_s``; clients hold only the student. Each round: (1) broadcast the student; (2) clients
train it with cross-entropy on their private data; (3) FedAvg weighted by ``n_k``; (4) the
server co-trains ``φ``, ``g`` and the student on a small public set with

    L = CE(y, z_s) + α·CE(y, z_t) + β·(KL(z_t ‖ z_s) + L_CKA(f_t, f_s)),
    f_t = φ(F_t(x)), z_t = g(f_t), f_s = F_s.features(x), z_s = g(f_s),

``L_CKA = −CKA`` (linear CKA, :mod:`fedfm.core.cka`; ``f_t`` and ``f_s`` may differ in width).

Registered here (the server half differs only in its objective, :data:`OBJECTIVES`):

* ``fedrd``: the method (objective ``fedrd``). ``warmup_epochs`` trains φ and g with
  ``CE(y, z_t)`` alone on the public set before round 1.
* ``fedrd-nophi`` (old name ``fedrd-kd``, kept as an alias): FedRD without φ,
  ``reprogram: false``: the raw features ``F_t(x)`` go to a separate teacher head (trained
  with ``α·CE`` on the public set) and to CKA directly.
* ``fed-hint``: Fed-Hint, the paper's FitNets baseline moved to the server (objective
  ``hint``): ``CE(y, z_s) + β·mean((W f_s − F_t(x))²)`` with a learned regressor ``W``.
* ``fedavg-ft``: the control for the labelled public rows (objective ``ce``): student FedAvg,
  then the server fine-tunes the student with ``CE(y, z_s)`` on the same public rows with the
  same optimizer and epochs; the foundation model is never loaded. (FedRD with
  ``alpha = beta = 0`` and no warm-up is the same computation, checked in tests.)

The other baselines are presets of plain ``fedavg``: the student alone, federated LoRA on
the text foundation model (the text task's ``encoder-lora-classifier``) and a federated
adapter on the frozen vision foundation model (``fm-adapter``, :mod:`fedfm.models.fm_adapter`);
FedAvg exchanges only trainable tensors, so only adapters and heads travel. Fed-CRD, Fed-VID
and SemCKD, the paper's other KD baselines, are not implemented.

Choices of ours, not made by the paper:

* The shared head ``g`` IS the student's ``head``: it travels with the student, clients
  train it with their CE, FedAvg averages it, and the server trains it in co-training.
  So the student's feature width, ``φ``'s output width and ``g``'s input width must agree;
  this is checked when the server half is built, with both widths named.
* ``φ`` = ``Linear(D_t, h)`` → ``blocks`` residual blocks ``x + W₂ ReLU(W₁ LN(x))`` →
  ``ReLU`` → ``Linear(h, d_s)`` → ``ReLU`` (the last ReLU because both students' features
  are post-ReLU, so ``g`` sees teacher and student features in the same range).
* Gradients of the KL and CKA terms flow into both sides (the paper's joint
  back-propagation); ``detach_teacher: true`` makes them distil into the student only.
* KL uses a temperature ``T`` (default 1, i.e. the paper's plain KL), scaled by ``T²``
  (:func:`fedfm.core.kd.kd_kl`).
* The server's optimizer (``server_train``, Adam by default) is rebuilt every round;
  co-training uses the one local-training loop, :func:`fedfm.core.train.local_train`.
* ``F_t`` is frozen and there is no augmentation, so its features on the public set (and on
  the evaluation subset) are computed once, in eval mode, and cached — exact, and it makes
  CPU runs affordable. The cache is per process and keyed by model, options and sample ids.
* The public set: ``public_ids`` (explicit source ids), else the task's own public split
  (text task ``public_size``), else ``public_size`` rows drawn from the source's training
  rows that no client holds (e.g. rows left out by ``max_train``). It must be disjoint from
  every client's data and from the test set by sample id, and is refused otherwise. (In a
  simulation the server can check this because the task holds every partition.)
* Fed-Hint hints the student's penultimate features (the input of g), not a middle layer, onto
  ``F_t``'s pooled features; the regressor is a server module kept across rounds (and
  checkpointed); the hint is a mean over batch and features, so β carries the usual hint
  weight (the vision preset uses β = 1; see its comment).
* The warm-up uses the server optimizer's settings with ``warmup_epochs`` epochs, once,
  before round 1 (a resumed run has the warmed-up φ in its checkpoint); it is refused at
  config load for an objective without ``z_t``.
* ``F_t`` lives only in the server half, built lazily in :meth:`FedRD.setup`/``round``;
  client handlers are FedAvg's and never touch it, so clients never load it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.metrics import f1_score
from torch import Tensor, nn
from typing_extensions import override

from fedfm.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, shared_model
from fedfm.algorithms.fedavg import (
    EVALUATE,
    TRAIN,
    FedAvgClient,
    FedAvgConfig,
    evaluate_global,
    fedavg_round,
)
from fedfm.config import RunConfig, TrainConfig
from fedfm.core.cka import cka_loss, linear_cka
from fedfm.core.federation import Federation
from fedfm.core.groups import get_group, join_groups
from fedfm.core.kd import kd_kl
from fedfm.core.optim import ServerOptimizer
from fedfm.core.seeding import derive_seed
from fedfm.core.train import get_params, local_train, num_steps, set_params
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError
from fedfm.registry import Registry
from fedfm.tasks.base import (
    IMAGE_VIEW,
    PUBLIC_SPLIT,
    SOURCE_ROWS,
    SPLIT_INPUTS,
    TEXT_VIEW,
    Task,
    TaskConfig,
    require,
)

log = logging.getLogger("fedfm")


# --------------------------------------------------------------------------- foundation models


@dataclass
class Teacher:
    """A frozen foundation model seen as a feature extractor.

    Attributes:
        name: Registry name.
        module: The model (kept in eval mode, never trained).
        feature_dim: Width of its features.
        encode_fn: The examples, as the view of a split the model reads (its
            :data:`TEACHER_READS` entry: images ``[N, C, H, W]`` or a list of texts) ->
            features ``[N, D]``.
        options: Options it was built with (part of the feature-cache key).
    """

    name: str
    module: nn.Module
    feature_dim: int
    encode_fn: Callable[[Any], Tensor]
    options: dict[str, Any] = field(default_factory=dict)

    @torch.no_grad()
    def encode(self, inputs: Any) -> Tensor:
        """Features ``[N, D]`` of every example of ``inputs`` (a view of a split), in eval mode."""
        self.module.eval()
        out = self.encode_fn(inputs).detach().float().cpu()
        if out.shape != (len(inputs), self.feature_dim):
            raise ConfigError(
                "algo.teacher",
                f"'{self.name}' gave features of shape {tuple(out.shape)}, expected "
                f"({len(inputs)}, {self.feature_dim})",
            )
        return out


TEACHERS: Registry[Callable[..., Teacher]] = Registry("foundation model", "algo.teacher")
TEACHER_READS: dict[str, str] = {}
"""Foundation model -> the view of a split it reads (a task capability, e.g. ``image_view``)."""


def register_teacher(
    name: str, reads: str, help: str = ""
) -> Callable[[Callable[..., Teacher]], Callable[..., Teacher]]:
    """Registers a foundation-model builder and the view of a split it reads.

    Args:
        name: Registry name (``algo.teacher``).
        reads: :data:`~fedfm.tasks.base.IMAGE_VIEW` or :data:`~fedfm.tasks.base.TEXT_VIEW`;
            a task must provide it for FedRD to run with this model (checked at config load).
        help: One-line description.
    """

    def deco(builder: Callable[..., Teacher]) -> Callable[..., Teacher]:
        TEACHERS.register(name, help)(builder)
        TEACHER_READS[name] = reads
        return builder

    return deco


@register_teacher(
    "efficientnet-lite0", IMAGE_VIEW, "EfficientNet-Lite0 ImageNet, 1280-d pooled features"
)
def efficientnet_lite0_teacher(
    image_size: int = 64, pretrained: bool = True, batch_size: int = 128
) -> Teacher:
    """EfficientNet-Lite0 on task images ``[N, C, H, W]`` in [0, 1], resized to ``image_size``.

    64 px by default rather than the native 224: 224 px has 12x the pixels (about 7x the
    time measured on 2 CPU cores), and a linear probe on Fashion-MNIST features holds its
    accuracy at 64 px (the reproduction study measures the probe per size: docs/fedrd.md).
    """
    from fedfm.models.vision import FEATURE_DIM, imagenet_preprocess, load_efficientnet_lite0

    model = load_efficientnet_lite0(pretrained=pretrained)

    def encode(x: Tensor) -> Tensor:
        device = model_device(model)  # the module may be moved after it is built
        chunks = [
            model.features(
                imagenet_preprocess(x[s : s + batch_size].to(device), size=image_size)
            ).cpu()
            for s in range(0, len(x), batch_size)
        ]
        return torch.cat(chunks) if chunks else torch.zeros(0, FEATURE_DIM)

    opts = {"image_size": image_size, "pretrained": pretrained}
    return Teacher("efficientnet-lite0", model, FEATURE_DIM, encode, opts)


@register_teacher(
    "minilm", TEXT_VIEW, "all-MiniLM-L6-v2 sentence encoder, 384-d normalised embeddings"
)
def minilm_teacher(name_or_path: str = "all-MiniLM-L6-v2", batch_size: int = 64) -> Teacher:
    """A sentence encoder on a split's raw texts."""
    from fedfm.models.encoder import encode, load_sentence_encoder

    model = load_sentence_encoder(name_or_path)
    dim = model.get_embedding_dimension()
    if dim is None:
        raise ConfigError("algo.teacher_options", f"'{name_or_path}' has no embedding width")

    def run(texts: list[str]) -> Tensor:
        return torch.from_numpy(encode(model, list(texts), batch_size=batch_size))

    return Teacher("minilm", model, dim, run, {"name_or_path": name_or_path})


DEFAULT_TEACHERS = {IMAGE_VIEW: "efficientnet-lite0", TEXT_VIEW: "minilm"}
"""The foundation model of ``teacher: auto``, by the view of its data a task provides."""


def teacher_name(teacher: str, provided: frozenset[str]) -> str:
    """The foundation model a config names, resolving ``auto`` by what the task provides.

    Args:
        teacher: ``algo.teacher``.
        provided: The task's capabilities.

    Raises:
        ConfigError: ``auto`` on a task with neither images nor texts.
    """
    if teacher != "auto":
        return teacher
    for view, name in DEFAULT_TEACHERS.items():
        if view in provided:
            return name
    raise ConfigError(
        "algo.teacher", "no default foundation model for a task without images or texts: name one"
    )


_CACHE: OrderedDict[str, Tensor] = OrderedDict()
_CACHE_SIZE = 16


def cached_features(
    teacher: Callable[[], Teacher], key: dict[str, Any], data: Any, inputs: Callable[[], Any]
) -> Tensor:
    """``F_t`` features of ``data``, computed once per process for (model, options, ids).

    Args:
        teacher: Returns the (lazily loaded) teacher; called only on a cache miss.
        key: Model name and options.
        data: Examples with stable ``ids``.
        inputs: Returns ``data`` as the view the teacher reads; called only on a cache miss.
    """
    digest = hashlib.sha256(data.ids.numpy().tobytes()).hexdigest()
    k = json.dumps(key, sort_keys=True) + digest
    if k not in _CACHE:
        _CACHE[k] = teacher().encode(inputs())
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(k)
    return _CACHE[k]


def clear_feature_cache() -> None:
    """Empties the per-process feature cache."""
    _CACHE.clear()


# --------------------------------------------------------------------------- reprogramming


class ResidualBlock(nn.Module):
    """``x + W₂ ReLU(W₁ LayerNorm(x))`` (pre-norm residual MLP block)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class Reprogrammer(nn.Module):
    """φ: foundation-model features ``[B, in_dim]`` -> task features ``[B, out_dim]``.

    Args:
        in_dim: Width of the foundation model's features.
        out_dim: Width the shared head ``g`` reads (= the student's feature width).
        hidden: Width of the residual blocks.
        blocks: Number of residual blocks.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.proj_in = nn.Linear(in_dim, hidden)
        self.blocks = nn.Sequential(*[ResidualBlock(hidden) for _ in range(blocks)])
        self.proj_out = nn.Linear(hidden, out_dim)

    @override
    def forward(self, f: Tensor) -> Tensor:
        if f.shape[-1] != self.in_dim:
            raise ConfigError(
                "algo.reprogram_in",
                f"features of width {f.shape[-1]} fed to a reprogrammer built for {self.in_dim}",
            )
        return F.relu(self.proj_out(F.relu(self.blocks(self.proj_in(f)))))


class Student(Protocol):
    """What FedRD asks of the task's model (the student).

    Features ``f_s = features(x)`` ``[B, d_s]`` and a Linear ``head`` (the shared head g)
    over them; :func:`head_width` checks the head when the server half is built.
    """

    head: nn.Linear

    def features(self, x: Any) -> Tensor:
        """Features ``[B, d_s]`` of a batch of inputs."""
        ...


def as_student(model: nn.Module) -> Student:
    """``model`` seen as a :class:`Student` (checked when the server half is built)."""
    return cast(Student, model)


def head_width(student: nn.Module) -> int:
    """Input width of the student's head ``g``; checks the student's ``feature_dim`` agrees."""
    head = getattr(student, "head", None)
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            "task.model", f"{type(student).__name__} has no Linear 'head' to share as g"
        )
    width = getattr(student, "feature_dim", head.in_features)
    if width != head.in_features:
        raise ConfigError(
            "task.model",
            f"student feature width {width} does not match its head's input width "
            f"{head.in_features}",
        )
    return head.in_features


def build_reprogrammer(
    fm_name: str,
    fm_dim: int,
    head_in: int,
    in_dim: int | None = None,
    out_dim: int | None = None,
    hidden: int | None = None,
    blocks: int = 2,
) -> Reprogrammer:
    """Builds φ and checks the widths that must agree.

    Args:
        fm_name: Foundation model name (for messages).
        fm_dim: Width of its features.
        head_in: Input width of the shared head ``g``.
        in_dim: φ's input width; ``None`` takes ``fm_dim``.
        out_dim: φ's output width; ``None`` takes ``head_in``.
        hidden: Width of the residual blocks; ``None`` takes the output width.
        blocks: Residual blocks.

    Raises:
        ConfigError: ``in_dim`` differs from ``fm_dim`` or ``out_dim`` from ``head_in``.
    """
    in_dim = fm_dim if in_dim is None else in_dim
    out_dim = head_in if out_dim is None else out_dim
    if in_dim != fm_dim:
        raise ConfigError(
            "algo.reprogram_in",
            f"reprogramming input width {in_dim} does not match the feature width {fm_dim} "
            f"of foundation model '{fm_name}'",
        )
    if out_dim != head_in:
        raise ConfigError(
            "algo.reprogram_out",
            f"reprogramming output width {out_dim} does not match the shared head's input "
            f"width {head_in} (the student's feature width)",
        )
    return Reprogrammer(in_dim, out_dim, hidden or out_dim, blocks)


class CoTrainer(nn.Module):
    """The server's trainable parts: the student (``head`` = g) and the objective's modules.

    The objective's modules (:data:`OBJECTIVES`) are φ, a teacher head or a hint regressor.
    """

    def __init__(self, student: nn.Module, parts: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.student = student
        self.parts = nn.ModuleDict(parts or {})

    def _part(self, name: str) -> nn.Module | None:
        return dict(self.parts.items()).get(name)

    @property
    def phi(self) -> Reprogrammer | None:
        """φ, when the objective reprograms."""
        return cast(Reprogrammer | None, self._part("phi"))

    @property
    def teacher_head(self) -> nn.Linear | None:
        """The separate teacher head on raw ``F_t`` features (FedRD without φ)."""
        return cast(nn.Linear | None, self._part("thead"))

    @property
    def hint(self) -> nn.Linear | None:
        """The hint regressor ``f_s -> F_t`` feature space (Fed-Hint)."""
        return cast(nn.Linear | None, self._part("hint"))

    @property
    def has_teacher_path(self) -> bool:
        """Whether there are teacher logits ``z_t`` (φ + g, or a teacher head)."""
        return self.phi is not None or self.teacher_head is not None

    def teacher(self, feats: Tensor) -> tuple[Tensor, Tensor]:
        """Cached ``F_t(x)`` ``[B, D_t]`` -> (``f_t``, ``z_t``)."""
        if self.phi is not None:
            f_t = self.phi(feats)
            return f_t, as_student(self.student).head(f_t)
        if self.teacher_head is None:
            raise ConfigError("algo.objective", "this objective has no teacher logits z_t")
        return feats, self.teacher_head(feats)


# --------------------------------------------------------------------------- server objectives


@dataclass(frozen=True)
class Objective:
    """What the server's co-training adds to the student's cross-entropy on the public set.

    Attributes:
        uses_teacher: Whether it reads ``F_t`` (False: the foundation model is never loaded).
        teacher_path: Whether it has teacher logits ``z_t`` (what the warm-up trains).
        build: ``(cfg, fm_name, fm_dim, head_in, num_classes) -> {name: module}``, the
            objective's own trainable server modules (checkpointed under their names).
        extra: ``(cotrainer, cfg, y, f_s, z_s, feats) -> (loss, parts)``: the term added to
            ``CE(y, z_s)`` and its parts as floats (logged as ``server_<part>``).
    """

    uses_teacher: bool
    teacher_path: bool
    build: Callable[[FedRDConfig, str, int, int, int], dict[str, nn.Module]]
    extra: Callable[
        [CoTrainer, FedRDConfig, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, dict[str, float]]
    ]


OBJECTIVES: Registry[Objective] = Registry("server objective", "algo.objective")


def _build_fedrd(
    c: FedRDConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    if not c.reprogram:
        return {"thead": nn.Linear(fm_dim, classes)}
    phi = build_reprogrammer(
        fm_name, fm_dim, head_in, c.reprogram_in, c.reprogram_out,
        c.reprogram_hidden, c.reprogram_blocks,
    )  # fmt: skip
    return {"phi": phi}


def _fedrd_extra(
    m: CoTrainer, c: FedRDConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    f_t, z_t = m.teacher(feats)
    return distillation_terms(
        y, z_s, f_s, z_t, f_t, c.alpha, c.beta, c.temperature, c.detach_teacher
    )


def hint_loss(regressed: Tensor, target: Tensor) -> Tensor:
    """FitNets' hint loss, ``‖r(f_s) − f_t‖²`` as a mean over the batch and the features.

    (The mean over features, not FitNets' ½ sum, keeps the term's scale independent of the
    teacher's width; the weight β then plays the role of the usual hint weight.)

    Args:
        regressed: The regressor's output on student features ``[B, D_t]``.
        target: The teacher's features ``[B, D_t]`` (a constant: ``F_t`` is frozen).
    """
    return F.mse_loss(regressed, target.detach())


def _build_hint(
    c: FedRDConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    return {"hint": nn.Linear(head_in, fm_dim)}


def _hint_extra(
    m: CoTrainer, c: FedRDConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    assert m.hint is not None
    loss = hint_loss(m.hint(f_s), feats)
    return c.beta * loss, {"hint": float(loss.detach())}


def _no_modules(
    c: FedRDConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    return {}


def _no_extra(
    m: CoTrainer, c: FedRDConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    return z_s.new_zeros(()), {}


OBJECTIVES.register(
    "fedrd", "α·CE(y, z_t) + β·(KL(z_t‖z_s) + L_CKA) with φ (or a teacher head: reprogram false)"
)(Objective(True, True, _build_fedrd, _fedrd_extra))
OBJECTIVES.register("hint", "β·FitNets hint: mean (W f_s − F_t(x))² with a learned regressor W")(
    Objective(True, False, _build_hint, _hint_extra)
)
OBJECTIVES.register("ce", "nothing: the server fine-tunes the student on the public set")(
    Objective(False, False, _no_modules, _no_extra)
)


# --------------------------------------------------------------------------- public set


def used_ids(task: Any) -> np.ndarray:
    """Sample ids of every client's training and local-test data."""
    parts = []
    for cid in task.client_ids():
        parts += [task.client_data(cid).ids.numpy(), task.client_test_data(cid).ids.numpy()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_public(public_ids: np.ndarray, task: Any, field_name: str) -> None:
    """Refuses a public set that shares sample ids with client data or the test set.

    Raises:
        ConfigError: Shared ids (their number and a few examples are named).
    """
    for what, ids in (("client data", used_ids(task)), ("the test set", task.test_data().ids)):
        shared = np.intersect1d(public_ids, np.asarray(ids))
        if len(shared):
            raise ConfigError(
                field_name,
                f"public set overlaps {what}: {len(shared)} shared sample ids "
                f"(e.g. {shared[:5].tolist()})",
            )


def public_split(task: Task, size: int, ids: list[int] | None, seed: int) -> tuple[Any, str]:
    """The public proxy set, checked disjoint from client data and the test set.

    Explicit ``ids`` are rows of the source (:data:`~fedfm.tasks.base.SOURCE_ROWS`); else the
    task's public split (:data:`~fedfm.tasks.base.PUBLIC_SPLIT`); else ``size`` rows drawn
    from the source's training rows that no client holds. :meth:`FedRD.check_task` has made
    sure the task provides what the config asks for.

    Args:
        task: The task.
        size: Rows to draw from the unused training pool (when neither ``ids`` nor the task
            gives a public set).
        ids: Explicit sample ids from the source's training rows.
        seed: Seed of the draw.

    Returns:
        The data and a short description of where it came from.

    Raises:
        ConfigError: No public set can be formed, or it overlaps client data or the test set.
    """
    if ids is not None:
        missing = np.setdiff1d(np.asarray(ids), task.pool_ids())
        if len(missing):
            raise ConfigError(
                "algo.public_ids",
                f"{len(missing)} ids are not training rows of the task's source"
                f" (e.g. {missing[:5].tolist()})",
            )
        field_name, origin = "algo.public_ids", "explicit ids"
        data = task.rows(ids)
    elif PUBLIC_SPLIT in task.provides(task.cfg):
        field_name, origin = "task.public_size", "the task's public split"
        data = task.public_data()
    else:
        pool_ids = task.pool_ids()
        taken = np.concatenate([used_ids(task), np.asarray(task.test_data().ids)])
        free = np.flatnonzero(~np.isin(pool_ids, taken))
        if len(free) < size:
            raise ConfigError(
                "algo.public_size",
                f"only {len(free)} training rows are held by no client, {size} asked "
                "(lower task.max_train or public_size)",
            )
        rng = np.random.default_rng(derive_seed(seed, "fedrd-public"))
        rows = np.sort(rng.choice(free, size=size, replace=False))
        field_name, origin = "algo.public_size", "unused training rows"
        data = task.rows(pool_ids[rows].tolist())
    check_public(data.ids.numpy(), task, field_name)
    return data, origin


def public_batches(
    task: Task, data: Any, feats: Tensor, batch_size: int, seed: int
) -> Iterator[Any]:
    """Endless shuffled ``(inputs, y, F_t features)`` batches; drops a last batch of < 2 rows.

    CKA needs at least two examples, so a trailing single example is skipped.
    """
    g = torch.Generator().manual_seed(seed)
    n = len(data)
    bs = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=g).tolist()
        for s in range(0, n, bs):
            idx = perm[s : s + bs]
            if len(idx) < 2:
                continue
            yield task.inputs(data, idx), data.y[idx], feats[idx]


def distillation_terms(
    y: Tensor,
    z_s: Tensor,
    f_s: Tensor,
    z_t: Tensor,
    f_t: Tensor,
    alpha: float,
    beta: float,
    temperature: float = 1.0,
    detach_teacher: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """FedRD's loss without the student's CE: ``α·CE(y, z_t) + β·(KL(z_t ‖ z_s) + L_CKA)``.

    Args:
        y: Labels ``[B]``.
        z_s: Student logits ``[B, C]``.
        f_s: Student features ``[B, d_s]``.
        z_t: Teacher logits ``[B, C]``.
        f_t: Teacher features ``[B, d_t]`` (``d_t`` may differ from ``d_s``).
        alpha: Weight of the teacher's CE.
        beta: Weight of the KL and CKA terms.
        temperature: KL temperature ``T``; the KL is scaled by ``T²`` (Hinton et al. 2015).
        detach_teacher: Stop the KL and CKA gradients at the teacher side.

    Returns:
        The loss and its parts (``ce_t``, ``kl``, ``cka`` = CKA, not the loss) as floats.
    """
    ce_t = F.cross_entropy(z_t, y)
    kd_z, kd_f = (z_t.detach(), f_t.detach()) if detach_teacher else (z_t, f_t)
    kl = kd_kl(z_s, kd_z, temperature)  # KL(p_t || p_s)·T², mean over the batch
    l_cka = cka_loss(kd_f, f_s)
    parts = {"ce_t": float(ce_t.detach()), "kl": float(kl.detach()), "cka": -float(l_cka.detach())}
    return alpha * ce_t + beta * (kl + l_cka), parts


# --------------------------------------------------------------------------- the algorithm


def _default_server_train() -> TrainConfig:
    return TrainConfig(epochs=1.0, batch_size=64, optimizer="adam", lr=1e-3)


class FedRDConfig(FedAvgConfig):
    """FedRD: FedAvg of the student plus server co-training with a frozen foundation model."""

    objective: str = Field("fedrd", description="server objective (OBJECTIVES)")
    teacher: str = Field("auto", description="foundation model (TEACHERS), or auto by task")
    teacher_options: dict[str, Any] = Field(default_factory=dict)
    reprogram: bool = Field(True, description="false: the KD baseline without reprogramming")
    reprogram_in: int | None = Field(None, ge=1, description="φ input width (default: F_t's)")
    reprogram_out: int | None = Field(None, ge=1, description="φ output width (default: g's)")
    reprogram_hidden: int | None = Field(None, ge=1)
    reprogram_blocks: int = Field(2, ge=0)
    alpha: float = Field(1.0, ge=0, description="weight of CE(y, z_t)")
    beta: float = Field(1.0, ge=0, description="weight of KL(z_t||z_s) + L_CKA(f_t, f_s)")
    temperature: float = Field(1.0, gt=0)
    detach_teacher: bool = False
    server_train: TrainConfig = Field(default_factory=_default_server_train)
    warmup_epochs: float = Field(
        0.0, ge=0, description="epochs of CE(y, z_t) on the public set for φ and g before round 1"
    )
    public_size: int = Field(500, ge=0)
    public_ids: list[int] | None = None
    teacher_eval_size: int = Field(0, ge=0, description="test rows to evaluate z_t on (0: off)")


@dataclass
class ServerHalf:
    """What only the server holds: the foundation model (lazy), public set and features."""

    teacher_name: str
    teacher_key: dict[str, Any]
    load_teacher: Callable[[], Teacher]
    public: Any
    public_feats: Tensor
    cotrainer: CoTrainer
    eval_data: Any = None
    eval_feats: Tensor | None = None


class FedRD(Algorithm):
    """FedRD (federated reprogramming KD); ``reprogram: false`` is the plain KD baseline.

    Steps (1)-(3) are FedAvg's (:func:`~fedfm.algorithms.fedavg.fit`,
    :func:`~fedfm.algorithms.fedavg.fedavg_round`) on the student; step (4) is
    :meth:`co_train`.
    """

    Config = FedRDConfig
    Client = FedAvgClient  # steps (1)-(3) on the client: FedAvg's client of the student
    messages = (TRAIN, EVALUATE)

    @classmethod
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        """Refuses a task that cannot give the foundation model its inputs or a public set."""
        assert isinstance(cfg, FedRDConfig)
        objective = OBJECTIVES.get(cfg.objective)
        if objective.uses_teacher:
            cls._check_teacher(cfg, task_cls, task_cfg)
        if cfg.warmup_epochs > 0 and not objective.teacher_path:
            raise ConfigError(
                "algo.warmup_epochs", f"objective '{cfg.objective}' has no z_t to warm up: set 0"
            )
        require(task_cls, task_cfg, SPLIT_INPUTS, "task.kind", "FedRD's server co-training")
        if cfg.public_ids is not None:
            require(task_cls, task_cfg, SOURCE_ROWS, "algo.public_ids", "a public set by ids")
        elif PUBLIC_SPLIT not in task_cls.provides(task_cfg):
            why = "a public set drawn from unused training rows"
            require(task_cls, task_cfg, SOURCE_ROWS, "algo.public_size", why)
            if cfg.public_size <= 0:
                raise ConfigError(
                    "algo.public_size", "FedRD needs a public set: set public_size > 0"
                )

    @staticmethod
    def _check_teacher(cfg: FedRDConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        name = teacher_name(cfg.teacher, task_cls.provides(task_cfg))
        TEACHERS.get(name)  # an unknown name fails here
        if name not in TEACHER_READS:
            raise ConfigError(
                "algo.teacher", f"'{name}' does not say what it reads (use register_teacher)"
            )
        require(task_cls, task_cfg, TEACHER_READS[name], "algo.teacher", f"'{name}'")

    def __init__(self, cfg: FedRDConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedRDConfig = cfg
        self._model = shared_model(task, run.seed)
        self.params: dict[str, Tensor] = get_params(self._model)
        self.opt = ServerOptimizer(cfg.server_opt, cfg.aggregator)
        self._srv: ServerHalf | None = None
        self._teacher: Teacher | None = None
        self._pending: dict[str, dict[str, Tensor]] = {}

    def model(self) -> nn.Module:
        """The student instance this process's server and client halves share."""
        return self._model

    # ----- server half -----
    @property
    def teacher_loaded(self) -> bool:
        """Whether this process has loaded the foundation model."""
        return self._teacher is not None

    def teacher(self) -> Teacher:
        """The foundation model, loaded on first use (server side only)."""
        if self._teacher is None:
            name = self._teacher_name()
            self._teacher = TEACHERS.get(name)(**self.cfg.teacher_options)
            for p in self._teacher.module.parameters():
                p.requires_grad_(False)
            # Its features come back to the CPU (they are cached per process).
            self._teacher.module.to(self.task.device).eval()
        return self._teacher

    def _teacher_name(self) -> str:
        return teacher_name(self.cfg.teacher, self.task.provides(self.task.cfg))

    def _features(self, key: dict[str, Any], data: Any) -> Tensor:
        """``F_t(x)`` of every example of ``data`` (cached, see :func:`cached_features`)."""
        reads = TEACHER_READS[self._teacher_name()]
        return cached_features(self.teacher, key, data, lambda: self.task.view(reads, data))

    def server(self) -> ServerHalf:
        """Builds the server half once: public set, cached features, φ and heads."""
        if self._srv is not None:
            return self._srv
        c = self.cfg
        objective = OBJECTIVES.get(c.objective)
        name = self._teacher_name() if objective.uses_teacher else "none"
        if objective.uses_teacher:
            TEACHERS.get(name)  # an unknown name fails here, before any loading
        key = {"teacher": name, **c.teacher_options}
        public, origin = public_split(self.task, c.public_size, c.public_ids, self.run.seed)
        # Without a teacher the batches carry empty feature rows [N, 0].
        feats = (
            self._features(key, public) if objective.uses_teacher else torch.zeros(len(public), 0)
        )
        fm_dim = int(feats.shape[1])
        student = self.task.build_model(seed=self.run.seed)
        set_params(student, self.params)
        head_in = head_width(student)
        torch.manual_seed(derive_seed(self.run.seed, "fedrd-server-init"))
        classes = as_student(student).head.out_features
        parts = objective.build(c, name, fm_dim, head_in, classes)
        cotrainer = CoTrainer(student, parts).to(self.task.device)  # φ, heads: CPU-initialised
        self._srv = ServerHalf(name, key, self.teacher, public, feats, cotrainer)
        self._check_student_width(student, public, head_in)
        if c.teacher_eval_size and self._srv.cotrainer.has_teacher_path:
            test = self.task.test_data()
            n = min(c.teacher_eval_size, len(test))
            idx = torch.randperm(len(test), generator=torch.Generator().manual_seed(self.run.seed))
            self._srv.eval_data = test.subset(torch.as_tensor(sorted(idx[:n].tolist())))
            self._srv.eval_feats = self._features(key, self._srv.eval_data)
        if self._pending:
            self._load_server_arrays(self._pending)
            self._pending = {}
        log.info("fedrd: public set of %d rows from %s; F_t width %d", len(public), origin, fm_dim)
        return self._srv

    def _check_student_width(self, student: nn.Module, public: Any, head_in: int) -> None:
        with torch.no_grad():
            x = to_device(self.task.inputs(public, [0, 1]), model_device(student))
            width = as_student(student).features(x).shape[-1]
        if width != head_in:
            raise ConfigError(
                "task.model",
                f"student features have width {width}, the shared head reads {head_in}",
            )

    @override
    def setup(self, fed: Federation) -> dict[str, float]:
        t = time.perf_counter()
        srv = self.server()
        return {
            "public_size": len(srv.public),
            "teacher_dim": int(srv.public_feats.shape[1]),
            "setup_s": round(time.perf_counter() - t, 3),
        }

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        # Before round 1 (a run resumed later has a warmed-up φ in its checkpoint).
        warm = self.warm_up() if fed.rnd == 1 and self.cfg.warmup_epochs > 0 else {}
        # (1)-(3): broadcast, local CE, FedAvg of the student; then (4) server co-training.
        self.params, metrics = fedavg_round(self, fed, self.params, self.opt)
        metrics.update(self.co_train(fed.rnd))
        return {**warm, **metrics}

    def warm_up(self) -> dict[str, float]:
        """Trains the teacher path (φ and g, or the teacher head) with ``CE(y, z_t)`` alone.

        On the public set, for ``warmup_epochs`` (the server optimizer's other settings).

        The student's feature extractor gets no gradient here; g is the student's head, so the
        warmed-up g is what round 1 broadcasts.

        Raises:
            ConfigError: The objective has no teacher path to warm up.
        """
        srv = self.server()
        model = srv.cotrainer
        if not model.has_teacher_path:
            raise ConfigError(
                "algo.warmup_epochs", f"objective '{self.cfg.objective}' has no z_t to warm up"
            )
        set_params(model.student, self.params)

        def teacher_ce(m: nn.Module, batch: Any) -> tuple[Tensor, Any]:
            _, y, feats = batch
            return F.cross_entropy(model.teacher(feats)[1], y), None

        cfg = self.cfg.server_train.model_copy(update={"epochs": self.cfg.warmup_epochs})
        seed = derive_seed(self.run.seed, "fedrd-warmup")
        batches = public_batches(self.task, srv.public, srv.public_feats, cfg.batch_size, seed)
        res = local_train(model, batches, teacher_ce, cfg, num_steps(cfg, len(srv.public)))
        self.params = get_params(model.student, list(self.params))
        return {"warmup_ce_t": res.loss, "warmup_steps": res.steps}

    def co_train(self, rnd: int) -> dict[str, float]:
        """Server step (4): trains φ, g and the student on the public set."""
        srv = self.server()
        c = self.cfg
        model = srv.cotrainer
        set_params(model.student, self.params)
        parts: dict[str, list[float]] = {}
        objective = OBJECTIVES.get(c.objective)

        def student_loss(m: nn.Module, batch: Any) -> tuple[Tensor, Any]:
            x, y, _ = batch
            student = as_student(model.student)
            f_s = student.features(x)
            z_s = student.head(f_s)
            return F.cross_entropy(z_s, y), (f_s, z_s)

        def teacher_terms(m: nn.Module, batch: Any, out: Any) -> Tensor:
            _, y, feats = batch
            f_s, z_s = out
            extra, terms = objective.extra(model, c, y, f_s, z_s, feats)
            for k, v in terms.items():
                parts.setdefault(k, []).append(v)
            return extra

        cfg = c.server_train
        seed = derive_seed(self.run.seed, rnd, "fedrd-server")
        batches = public_batches(self.task, srv.public, srv.public_feats, cfg.batch_size, seed)
        steps = num_steps(cfg, len(srv.public))
        res = local_train(model, batches, student_loss, cfg, steps, extra_loss=teacher_terms)
        self.params = get_params(model.student, list(self.params))
        return {
            "server_loss": res.loss,
            "server_steps": res.steps,
            **{f"server_{k}": float(np.mean(v)) for k, v in parts.items() if v},
        }

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        out = evaluate_global(self.task, fed, self._model, self.params, self.cfg.personal_eval)
        srv = self._srv
        if srv is not None and srv.eval_feats is not None and srv.cotrainer.has_teacher_path:
            out.update(self._teacher_metrics(srv))
        return out

    @torch.no_grad()
    def _teacher_metrics(self, srv: ServerHalf) -> dict[str, float]:
        """Accuracy of the (reprogrammed) teacher path ``z_t`` and CKA(f_t, f_s) on test rows."""
        model = srv.cotrainer
        set_params(model.student, self.params)
        was = model.training
        model.eval()
        data, feats = srv.eval_data, srv.eval_feats
        assert feats is not None
        device = model_device(model)
        f_t, z_t = (t.cpu() for t in model.teacher(feats.to(device)))
        student = as_student(model.student)
        f_s = torch.cat(
            [
                student.features(
                    to_device(self.task.inputs(data, range(s, min(s + 256, len(data)))), device)
                ).cpu()
                for s in range(0, len(data), 256)
            ]
        )
        model.train(was)
        pred, y = z_t.argmax(-1), data.y
        return {
            "teacher/acc": float((pred == y).float().mean()),
            "teacher/macro_f1": float(
                f1_score(y.numpy(), pred.numpy(), average="macro", zero_division=0)
            ),
            "cka_test": float(linear_cka(f_t, f_s)),
        }

    # ----- checkpointing -----
    def _server_groups(self) -> dict[str, dict[str, Tensor]]:
        if self._srv is None:
            return self._pending
        return {g: get_params(mod) for g, mod in self._srv.cotrainer.parts.items()}

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        groups = {"params": self.params, "opt": self.opt.state_dict(), **self._server_groups()}
        return join_groups(groups), {}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, "params")
        self.opt.load_state_dict(get_group(arrays, "opt"))
        mine = {g: get_group(arrays, g) for g in SERVER_PARTS}
        mine = {g: t for g, t in mine.items() if t}
        if self._srv is None:
            self._pending = mine  # applied when the server half is built
        else:
            self._load_server_arrays(mine)

    def _load_server_arrays(self, groups: dict[str, dict[str, Tensor]]) -> None:
        if self._srv is None:
            return
        for group, mod in self._srv.cotrainer.parts.items():
            if groups.get(group):
                set_params(mod, groups[group])


SERVER_PARTS = ("phi", "thead", "hint")
"""Names of the objectives' server modules (checkpoint groups)."""


class FedRDNoPhiConfig(FedRDConfig):
    """FedRD without φ: FedRD's loss with a trainable teacher head on raw ``F_t`` features."""

    reprogram: bool = False


class FedRDNoPhi(FedRD):
    """FedRD without φ (``reprogram: false``); also registered under its old name ``fedrd-kd``."""

    Config = FedRDNoPhiConfig


FedKD = FedRDNoPhi  # the old name of the class


class FedHintConfig(FedRDConfig):
    """Fed-Hint: ``CE(y, z_s) + β·½‖W f_s − F_t(x)‖²`` at the server (FitNets hints)."""

    objective: str = "hint"


class FedHint(FedRD):
    """Fed-Hint (FitNets-style feature hints from the frozen foundation model, at the server)."""

    Config = FedHintConfig


class FedAvgPublicFTConfig(FedRDConfig):
    """Student FedAvg + public fine-tuning: the server's ``CE(y, z_s)`` alone, no teacher."""

    objective: str = "ce"


class FedAvgPublicFT(FedRD):
    """Student FedAvg, then the server fine-tunes the student on the public set every round."""

    Config = FedAvgPublicFTConfig


ALGORITHMS.register("fedrd", "FedRD: student FedAvg + server reprogramming KD with a frozen FM")(
    FedRD
)
ALGORITHMS.register("fedrd-nophi", "FedRD without φ: teacher head on raw FM features")(FedRDNoPhi)
ALGORITHMS.register("fedrd-kd", "old name of fedrd-nophi (FedRD without φ)")(FedRDNoPhi)
ALGORITHMS.register("fed-hint", "Fed-Hint: student FedAvg + server FitNets hints from the FM")(
    FedHint
)
ALGORITHMS.register("fedavg-ft", "student FedAvg + server fine-tuning on the public set")(
    FedAvgPublicFT
)
