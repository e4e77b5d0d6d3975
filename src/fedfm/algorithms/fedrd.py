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

Registered here: ``fedrd`` and three presets of it (:mod:`fedfm.algorithms.presets`) that
change one default, the server objective (:data:`fedfm.models.objectives.OBJECTIVES`) or
``reprogram``:

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
adapter on the frozen vision foundation model (``fm-adapter``,
:mod:`fedfm.models.efficientnet_adapter`); FedAvg exchanges only trainable tensors, so only
adapters and heads travel. Fed-CRD, Fed-VID and SemCKD, the paper's other KD baselines, are
not implemented.

Choices of ours, not made by the paper:

* The shared head ``g`` IS the student's ``head``: it travels with the student, clients
  train it with their CE, FedAvg averages it, and the server trains it in co-training.
  So the student's feature width, ``φ``'s output width and ``g``'s input width must agree;
  this is checked when the server half is built, with both widths named.
* φ's architecture is in :mod:`fedfm.models.reprogram`, the choices in the loss terms
  (gradients into both sides, the KL temperature) in :mod:`fedfm.models.objectives`.
* The server's optimizer (``server_train``, Adam by default) is rebuilt every round;
  co-training uses the one local-training loop, :func:`fedfm.core.train.local_train`.
* ``F_t`` is frozen and there is no augmentation, so its features on the public set (and on
  the evaluation subset) are computed once, in eval mode, and cached — exact, and it makes
  CPU runs affordable. The cache is per process and keyed by model, options and each row's
  content (:class:`fedfm.models.encoders.FeatureCache`); ``F_t`` is an encoder of
  :data:`fedfm.models.encoders.ENCODERS` (``algo.teacher``, its options ``teacher_options``).
* The public set: ``public_ids`` (explicit source ids), else the task's own public split
  (text task ``public_size``), else ``public_size`` rows drawn from the source's training
  rows that no client holds (e.g. rows left out by ``max_train``). It must be disjoint from
  every client's data and from the test set by sample id, and is refused otherwise
  (:mod:`fedfm.tasks.public`).
* Fed-Hint hints the student's penultimate features (the input of g), not a middle layer, onto
  ``F_t``'s pooled features; the regressor is a server module kept across rounds (and
  checkpointed); the hint is a mean over batch and features, so β carries the usual hint
  weight (the vision preset uses β = 1; see its comment).
* The warm-up uses the server optimizer's settings with ``warmup_epochs`` epochs, once,
  before round 1 (a resumed run has the warmed-up φ in its checkpoint); it is refused at
  config load for an objective without ``z_t``.
* (Beyond the paper) ``transfer_size`` > 0 adds an unlabelled transfer pool: rows of the
  source's training set that no client holds, not test rows and not the labelled public set
  (checked). After the labelled co-training of each round the server runs the same epochs
  over the pool with the distillation terms alone (KL at ``temperature`` and CKA, into the
  teacher side too unless ``detach_teacher``); ``transfer_loss: pseudo`` is its control,
  CE of the student against the teacher path's hard labels of the same rows.
* ``F_t`` lives only in the server half, built lazily in :meth:`FedRD.setup`/``round``;
  client handlers are FedAvg's and never touch it, so clients never load it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

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
from fedfm.algorithms.presets import register_preset
from fedfm.config import RunConfig, TrainConfig
from fedfm.core.cka import cka_loss, linear_cka
from fedfm.core.federation import Federation
from fedfm.core.groups import get_group, join_groups
from fedfm.core.kd import kd_kl
from fedfm.core.optim import ServerOptimizer
from fedfm.core.seeding import derive_seed
from fedfm.core.train import get_params, local_train, num_steps, set_params
from fedfm.devices import model_device, to_device
from fedfm.errors import ConfigError, config_fields
from fedfm.models.encoders import (
    Encoder,
    check_options,
    encoder_key,
    encoder_reads,
    feature_cache,
    load_encoder,
)
from fedfm.models.objectives import OBJECTIVES
from fedfm.models.reprogram import CoTrainer, as_student, head_width
from fedfm.tasks.base import (
    IMAGE_VIEW,
    SPLIT_INPUTS,
    TEXT_VIEW,
    SplitInputs,
    Task,
    TaskConfig,
    capable,
    require,
    split_view,
)
from fedfm.tasks.public import public_split, require_public_set, transfer_split

log = logging.getLogger("fedfm")


# --------------------------------------------------------------------------- foundation model

VIEWS = {"images": IMAGE_VIEW, "texts": TEXT_VIEW}
"""What an encoder reads -> the view of a split a task provides for it (a capability)."""
TEACHER_FIELDS = {"encoder": "algo.teacher", "encoder.options": "algo.teacher_options"}
"""Errors of the encoder registry, named by the config fields that supplied the values."""


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


def teacher_view(name: str) -> str:
    """The view of a split that foundation model ``name`` reads (a task capability).

    Raises:
        UnknownNameError: No such encoder (field ``algo.teacher``).
    """
    with config_fields(TEACHER_FIELDS):
        return VIEWS[encoder_reads(name)]


# --------------------------------------------------------------------------- public batches


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
            yield capable(task, SplitInputs).inputs(data, idx), data.y[idx], feats[idx]


# --------------------------------------------------------------------------- the algorithm


def _default_server_train() -> TrainConfig:
    return TrainConfig(epochs=1.0, batch_size=64, optimizer="adam", lr=1e-3)


class FedRDConfig(FedAvgConfig):
    """FedRD: FedAvg of the student plus server co-training with a frozen foundation model."""

    objective: str = Field("fedrd", description="server objective (OBJECTIVES)")
    teacher: str = Field("auto", description="foundation model (ENCODERS), or auto by task")
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
    transfer_size: int = Field(
        0, ge=0, description="(beyond the paper) unlabelled transfer pool rows (0: none)"
    )
    transfer_loss: Literal["kd", "pseudo"] = Field(
        "kd", description="on the pool: KL + CKA (kd), or CE on z_t's hard labels (pseudo)"
    )


@dataclass
class ServerHalf:
    """What only the server holds: the foundation model (lazy), public set and features."""

    teacher_name: str
    teacher_key: str
    load_teacher: Callable[[], Encoder]
    public: Any
    public_feats: Tensor
    cotrainer: CoTrainer
    eval_data: Any = None
    eval_feats: Tensor | None = None
    pool: Any = None
    pool_feats: Tensor | None = None


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
        if cfg.transfer_size > 0 and not objective.teacher_path:
            raise ConfigError(
                "algo.transfer_size", f"objective '{cfg.objective}' has no z_t to transfer: set 0"
            )
        require(task_cls, task_cfg, SPLIT_INPUTS, "task.kind", "FedRD's server co-training")
        require_public_set(task_cls, task_cfg, cfg.public_ids, cfg.public_size, "FedRD")

    @staticmethod
    def _check_teacher(cfg: FedRDConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        name = teacher_name(cfg.teacher, task_cls.provides(task_cfg))
        require(task_cls, task_cfg, teacher_view(name), "algo.teacher", f"'{name}'")
        with config_fields(TEACHER_FIELDS):
            check_options(name, cfg.teacher_options)

    def __init__(self, cfg: FedRDConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: FedRDConfig = cfg
        self._model = shared_model(task, run.seed)
        self.params: dict[str, Tensor] = get_params(self._model)
        self.opt = ServerOptimizer(cfg.server_opt, cfg.aggregator)
        self._srv: ServerHalf | None = None
        self._teacher: Encoder | None = None
        self._pending: dict[str, dict[str, Tensor]] = {}

    def model(self) -> nn.Module:
        """The student instance this process's server and client halves share."""
        return self._model

    # ----- server half -----
    @property
    def teacher_loaded(self) -> bool:
        """Whether this process has loaded the foundation model."""
        return self._teacher is not None

    def teacher(self) -> Encoder:
        """The foundation model, loaded on first use (server side only), frozen."""
        if self._teacher is None:
            name = self._teacher_name()
            # Its features come back to the CPU (they are cached per process).
            with config_fields(TEACHER_FIELDS):
                self._teacher = load_encoder(name, self.task.device, **self.cfg.teacher_options)
        return self._teacher

    def _teacher_name(self) -> str:
        return teacher_name(self.cfg.teacher, self.task.provides(self.task.cfg))

    def _features(self, key: str, data: Any) -> Tensor:
        """``F_t(x)`` of every example of ``data``, cached per process by each row's content.

        The foundation model is loaded on the first row not cached.
        """
        inputs = split_view(self.task, teacher_view(self._teacher_name()), data)
        return feature_cache(key)(inputs, lambda rows: self.teacher().encode(rows))

    def server(self) -> ServerHalf:
        """Builds the server half once: public set, cached features, φ and heads."""
        if self._srv is not None:
            return self._srv
        c = self.cfg
        objective = OBJECTIVES.get(c.objective)
        name = self._teacher_name() if objective.uses_teacher else "none"
        if objective.uses_teacher:
            teacher_view(name)  # an unknown name fails here, before any loading
        key = encoder_key(name, c.teacher_options)
        public, origin = public_split(
            self.task, c.public_size, c.public_ids, self.run.seed, label="fedrd-public"
        )
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
        if c.transfer_size:
            exclude = np.asarray(public.ids)
            pool = transfer_split(self.task, c.transfer_size, exclude, self.run.seed, "transfer")
            self._srv.pool, self._srv.pool_feats = pool, self._features(key, pool)
        if self._pending:
            self._load_server_arrays(self._pending)
            self._pending = {}
        log.info("fedrd: public set of %d rows from %s; F_t width %d", len(public), origin, fm_dim)
        return self._srv

    def _check_student_width(self, student: nn.Module, public: Any, head_in: int) -> None:
        with torch.no_grad():
            x = to_device(
                capable(self.task, SplitInputs).inputs(public, [0, 1]), model_device(student)
            )
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
        out: dict[str, float] = {"server_loss": res.loss, "server_steps": res.steps}
        if srv.pool is not None and srv.pool_feats is not None:
            out.update(self.transfer(srv, rnd))
        self.params = get_params(model.student, list(self.params))
        return {**out, **{f"server_{k}": float(np.mean(v)) for k, v in parts.items() if v}}

    def transfer(self, srv: ServerHalf, rnd: int) -> dict[str, float]:
        """(Beyond the paper) one pass of co-training over the unlabelled transfer pool.

        After the labelled co-training, the same epochs over the pool with the distillation
        terms alone, β·(KL(z_t ‖ z_s) + L_CKA), or (``transfer_loss: pseudo``, the control) CE
        of the student against z_t's hard labels. The pool's own labels are never read.
        """
        c, model = self.cfg, srv.cotrainer
        assert srv.pool_feats is not None
        pseudo = c.transfer_loss == "pseudo"

        def pool_loss(m: nn.Module, batch: Any) -> tuple[Tensor, Any]:
            x, _, feats = batch  # the pool's labels are not read
            student = as_student(model.student)
            f_s = student.features(x)
            z_s = student.head(f_s)
            f_t, z_t = model.teacher(feats)
            if pseudo:
                return F.cross_entropy(z_s, z_t.detach().argmax(-1)), None
            kd_z, kd_f = (z_t.detach(), f_t.detach()) if c.detach_teacher else (z_t, f_t)
            loss = kd_kl(z_s, kd_z, c.temperature) + cka_loss(kd_f, f_s)
            return c.beta * loss, None

        cfg = c.server_train
        seed = derive_seed(self.run.seed, rnd, "fedrd-transfer")
        batches = public_batches(self.task, srv.pool, srv.pool_feats, cfg.batch_size, seed)
        res = local_train(model, batches, pool_loss, cfg, num_steps(cfg, len(srv.pool)))
        return {"transfer_loss": res.loss, "transfer_steps": float(res.steps)}

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
        rows = capable(self.task, SplitInputs)
        f_s = torch.cat(
            [
                student.features(
                    to_device(rows.inputs(data, range(s, min(s + 256, len(data)))), device)
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


ALGORITHMS.register("fedrd", "FedRD: student FedAvg + server reprogramming KD with a frozen FM")(
    FedRD
)
register_preset(
    "fedrd-nophi", "fedrd", "FedRD without φ: teacher head on raw FM features", reprogram=False
)
register_preset("fedrd-kd", "fedrd", "old name of fedrd-nophi (FedRD without φ)", reprogram=False)
register_preset(
    "fed-hint", "fedrd", "Fed-Hint: student FedAvg + server FitNets hints from the FM",
    objective="hint",
)  # fmt: skip
register_preset(
    "fedavg-ft", "fedrd", "student FedAvg + server fine-tuning on the public set", objective="ce"
)
