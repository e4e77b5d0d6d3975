"""The FedAvg family: FedAvg with any server optimizer, FedProx, SCAFFOLD, and local-only.

Papers:
- FedAvg: McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data".
- FedAvgM, FedAdagrad, FedAdam, FedYogi: Reddi et al. 2021, "Adaptive Federated
  Optimization" (server optimizers in :mod:`fedfm.core.optim`).
- FedProx: Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (the proximal
  term lives in :func:`fedfm.core.train.local_train`).
- SCAFFOLD: Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
  Federated Learning" (option II control variates).
- FedIT (Zhang et al. 2024) is FedAvg over LoRA adapters: the same code on an LM task,
  whose model is an adapter of the foundation model: what travels (``task.get_params``) is that
  adapter, read through the handle (:mod:`fedfm.fm`).

Choices of ours: aggregation weights are the clients' training-set sizes; parameters and
floating-point buffers (e.g. BatchNorm statistics) are averaged alike; the local-only
baseline trains each client's own model for the same local budget per round.

FedAvg's two halves are functions (:func:`fit`, :func:`evaluate_locally`, :func:`fedavg_round`,
:func:`evaluate_global`) that other algorithms running FedAvg rounds (FedRD) call as well;
FedRD's client half is :class:`FedAvgClient`.
``algo.aggregator`` replaces the weighted mean by a robust rule (clipping, median, trimmed
mean, Krum; :mod:`fedfm.core.robust`) before the server optimizer; default: the mean.
``algo.fedsd.enabled`` adds FedSD (:class:`fedfm.algorithms.fedsd.FedSD`) to
FedAvg, every server optimizer, FedProx and SCAFFOLD: a round-0 exchange in which each client
rewrites its answers with the global model, then local training on the rewrites instead of the
raw answers. Each algorithm's client half is its own class (``FedAvgClient``, ...), built from
the config alone.
``algo.update_cosines`` logs the mean and minimum pairwise cosine between the round's client
updates (FedSDR's "raw vs distilled" analysis), computed by the server from the replies it
aggregates: no extra bytes leave the clients. Every round logs ``update_norm``, the global
model's drift from its start ‖θ_t − θ_0‖ (L2 over the trainable tensors; FedSDR's study
matches a control's drift to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn
from typing_extensions import override

from fedfm.algorithms.base import (
    ALGORITHMS,
    AlgoConfig,
    Algorithm,
    ClientHalf,
    shared_model,
)
from fedfm.algorithms.fedsd import FedSD, FedSDOption
from fedfm.algorithms.lora_clients import LoraClients
from fedfm.config import RunConfig, TrainConfig
from fedfm.core.aggregate import update_norm
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.groups import get_group, join_groups
from fedfm.core.messages import EVAL_EXAMPLES, Message, MessageKind
from fedfm.core.optim import (
    ScaffoldSums,
    ServerOptConfig,
    ServerOptimizer,
    scaffold_client_control,
)
from fedfm.core.replies import (
    MetricMean,
    meta_number,
    summarise_client_metrics,
    weighted_mean_metric,
)
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secagg import refuse_non_sum
from fedfm.core.train import client_config, local_round
from fedfm.core.userdp import UPDATE_META
from fedfm.errors import ConfigError
from fedfm.eval.compare import UpdateCosines
from fedfm.tasks.base import ITEM_RESULTS, ItemResults, Task, TaskConfig, capable

TRAIN = MessageKind(
    "train",
    down_arrays=("params",),
    down_meta=("clip",),
    up_arrays=("params",),
    up_meta=("num_examples", "loss", "clip_bit"),
    meta_specs=UPDATE_META,
    dp_fields=("params", "clip_bit"),
)
EVALUATE = MessageKind(
    "evaluate",
    down_arrays=("params",),
    up_meta=("num_examples", "metrics"),
    meta_specs={"num_examples": EVAL_EXAMPLES},  # a local test split may be empty
)


UPDATE_COSINES_HELP = (
    "log the mean and min pairwise cosine of the round's client updates (computed by the "
    "server from the replies it aggregates: no extra bytes leave clients)"
)


class FedAvgConfig(AlgoConfig):
    """FedAvg with a choice of server optimizer and of (robust) aggregation."""

    server_opt: ServerOptConfig = Field(default_factory=ServerOptConfig)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    personal_eval: bool = Field(
        False, description="also evaluate the global model on each client's local test split"
    )


class FedAvgFamilyConfig(FedSDOption, FedAvgConfig):
    """FedAvg's and FedProx's own config: :class:`FedAvgConfig` plus the FedSD phase.

    Separate from :class:`FedAvgConfig` so that algorithms built on that one (FedRD) do not
    take options they would ignore.
    """

    update_cosines: bool = Field(False, description=UPDATE_COSINES_HELP)


# ----------------------------------------------------------------------------- FedAvg's halves


def fit(
    ctx: ClientContext,
    model: nn.Module,
    msg: Message,
    cfg: TrainConfig,
    data: Any = None,
    lora: LoraClients | None = None,
) -> Message:
    """Client half of a FedAvg round: the received parameters, trained locally, sent back.

    Args:
        ctx: The client's context.
        model: A model instance to load the received parameters into (trained in place).
        msg: A ``train`` message with the global ``params``.
        cfg: Local-training settings (FedProx's ``prox_mu`` pulls towards the received ones).
        data: What to train on instead of the client's data (FedSD's distilled set).
        lora: Mixed LoRA ranks or FFA-LoRA (:mod:`fedfm.algorithms.lora_clients`).

    Returns:
        The ``train`` reply: the trained tensors of the received keys, the client's number
        of examples and its mean training loss.
    """
    glob = msg.arrays["params"]
    if lora is not None:
        full = lora.load(ctx, model, glob)
        with lora.training(ctx, model):
            res = local_round(ctx, model, cfg, prox_ref=full, data=data)
        return train_reply(ctx, lora.reply(ctx, model, list(glob)), res.loss)
    ctx.task.set_params(model, glob)
    res = local_round(ctx, model, cfg, prox_ref=glob, data=data)
    return train_reply(ctx, ctx.task.get_params(model, list(glob)), res.loss)


def train_reply(ctx: ClientContext, trained: dict[str, Tensor], loss: float) -> Message:
    """A ``train`` reply: the trained ``params``, the number of examples and the loss.

    Under client-side DP-FedAvg the client's privacy wrapper sends only the clipped, noised
    parameters (:class:`fedfm.core.userdp.ClientDP`).
    """
    n = ctx.task.num_examples(ctx.data)
    return Message("train", {"params": trained}, {"num_examples": n, "loss": loss})


def evaluate_locally(ctx: ClientContext, model: nn.Module, msg: Message) -> Message:
    """Client half of personal evaluation: the received parameters on the local test split."""
    ctx.task.set_params(model, msg.arrays["params"])
    data = ctx.task.client_test_data(ctx.cid)
    metrics = ctx.task.evaluate(model, data)
    return Message(
        "evaluate", meta={"num_examples": ctx.task.num_examples(data), "metrics": metrics}
    )


def fedavg_round(
    algo: Algorithm,
    fed: Federation,
    params: dict[str, Tensor],
    opt: ServerOptimizer,
    cosines: bool = False,
    origin: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Server half of a FedAvg round: send ``params`` to the sampled clients, aggregate.

    The aggregation is the one step every summing algorithm runs
    (:meth:`~fedfm.algorithms.base.Algorithm.aggregate`): replies are folded into the
    aggregate as they arrive, so with the example-weighted mean the server holds one client's
    parameters at a time; a robust rule (``algo.aggregator``) keeps them all, as it must
    (:meth:`ServerOptimizer.accumulator`). DP-FedAvg and SecAgg+ wrap it there.

    Args:
        algo: The algorithm (its client sampling and ``min_clients``).
        fed: The federation.
        params: The global parameters θ.
        opt: The server optimizer (with its aggregator), applied to the aggregate Δ.
        cosines: Also the pairwise cosines of the clients' updates ``θ_i − θ``, from the
            replies the server aggregates anyway (no extra bytes leave clients); it keeps
            every client's update until the round ends.
        origin: The global parameters θ_0 the run started from: the metrics then hold
            ``update_norm`` = ‖θ_new − θ_0‖.

    Returns:
        The new parameters and the round's metrics (``train_loss``, ``clients``; with
        ``cosines``, ``update_cos/mean`` and ``update_cos/min`` over client pairs; with
        ``origin``, ``update_norm``).

    Raises:
        TooFewClientsError: Fewer than ``min_clients`` valid replies.
    """
    cids = algo.sample(fed)
    msg = Message("train", {"params": params})
    loss = MetricMean("loss")
    ups = UpdateCosines(params) if cosines else None

    def each(cid: str, r: Message) -> None:
        if "loss" in r.meta:  # a DP client sends none
            loss.add(r)
        if ups is not None:
            ups.add(cid, r.arrays["params"])

    got = algo.aggregate(
        fed, {c: msg for c in cids}, "params", params, opt.round_sum, {"params": params}, each
    )
    new = opt.apply_delta(params, got.result) if got.result is not None else dict(params)
    metrics = {"train_loss": loss.mean("loss")} if loss.count else {}
    metrics["clients"] = len(got.clients)
    metrics.update(got.metrics)
    if origin is not None:
        metrics["update_norm"] = update_norm(new, origin)
    return new, {**metrics, **(ups.result() if ups is not None else {})}


def evaluate_global(
    task: Task,
    fed: Federation,
    model: nn.Module,
    params: dict[str, Tensor],
    personal: bool,
) -> dict[str, Any]:
    """The global model on the global test set and, if ``personal``, on every client's split.

    Per-client values of the personal evaluation are ``local/<metric>``, summarised as mean
    and worst client and logged per client (``per_client``). For a task that keeps per-item
    results, every evaluated item is returned too (``items``: the engine keeps them in the
    run's ``eval_items.jsonl``).
    """
    task.set_params(model, params)
    out = evaluate_on_test(task, model)
    if personal:
        out.update(evaluate_personal(fed, params))
    return out


def export_global(task: Task, model: nn.Module, params: dict[str, Tensor], folder: Path) -> bool:
    """Writes the global ``params`` as a peft adapter when ``model`` is one.

    That is, when ``model`` is an adapter of the task's foundation model
    (:meth:`fedfm.tasks.base.Task.save_adapter`). See
    :meth:`fedfm.algorithms.base.Algorithm.export_adapter`; ``False`` for other models.
    """
    task.set_params(model, params)
    return task.save_adapter(model, folder)


def evaluate_on_test(task: Task, model: nn.Module) -> dict[str, Any]:
    """``model`` on the global test set.

    For a task that keeps per-item results the evaluated ``items`` come too (the engine writes
    them to the run's ``eval_items.jsonl``).
    """
    if ITEM_RESULTS in type(task).provides(task.cfg):
        metrics, items = capable(task, ItemResults).evaluate_items(model, task.test_data())
        return {**metrics, "items": items}
    return dict(task.evaluate(model, task.test_data()))


def evaluate_personal(fed: Federation, params: dict[str, Tensor]) -> dict[str, Any]:
    """Every client evaluates ``params`` on its own split (an ``evaluate`` message).

    Returns:
        The values as ``local/<metric>``, their mean and worst client, and ``per_client``.
    """
    replies = fed.broadcast(Message("evaluate", {"params": params}), fed.client_ids())
    per = {c: {f"local/{k}": v for k, v in _metrics(r).items()} for c, r in replies.items()}
    return {**summarise_client_metrics(per, ""), "per_client": per}


def _metrics(reply: Message) -> dict[str, float]:
    metrics = reply.meta["metrics"]
    assert isinstance(metrics, dict)
    return metrics


# ----------------------------------------------------------------------------- algorithms


class FedAvgClient(ClientHalf):
    """FedAvg's client half: local training and personal evaluation of the received model.

    With ``algo.fedsd`` on, the FedSD phase adds its ``refine`` handler and local training
    reads the client's distilled set (:class:`~fedfm.algorithms.fedsd.FedSD`). FedRD's
    clients are FedAvg's clients of the student.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.model = shared_model(task, run.seed)  # loaded from every message before use
        self.fedsd = FedSD(cfg)
        self.lora = LoraClients.of(task, task.get_params(self.model))

    def train_cfg(self) -> TrainConfig:
        """Local-training settings (FedProx's client sets the proximal weight)."""
        return self.run.train

    @override
    def handlers(self) -> dict[str, Handler]:
        return {
            "train": self.train,
            "evaluate": self.evaluate,
            **self.fedsd.handlers(self.task, self.model),
        }

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """See :func:`fit`; with FedSD, on the client's distilled set."""
        data = self.fedsd.train_data(ctx)
        return fit(ctx, self.model, msg, self.train_cfg(), data, self.lora)

    def evaluate(self, ctx: ClientContext, msg: Message) -> Message:
        """See :func:`evaluate_locally`."""
        return evaluate_locally(ctx, self.model, msg)


class FedAvg(Algorithm):
    """FedAvg over a task's trainable tensors, with any server optimizer (Reddi et al. 2021)."""

    Config = FedAvgFamilyConfig
    Client = FedAvgClient
    messages = (TRAIN, EVALUATE, *FedSD.kinds)
    update_kinds = ("train",)
    secure_fields: ClassVar[dict[str, str]] = {"train": "params"}
    lora_options = ("client_ranks", "freeze_a")

    def __init__(self, cfg: FedAvgConfig, task: Task, run: RunConfig) -> None:
        if not isinstance(cfg, FedAvgFamilyConfig):  # a plain FedAvgConfig: the defaults
            cfg = FedAvgFamilyConfig.model_validate(cfg.model_dump())
        super().__init__(cfg, task, run)
        self.cfg: FedAvgFamilyConfig = cfg
        self._model = shared_model(task, run.seed)
        self.params: dict[str, Tensor] = task.get_params(self._model)
        self.opt = self.server_optimizer(cfg.server_opt, cfg.aggregator)
        # Mixed LoRA ranks or FFA-LoRA (only B travels): fedfm.algorithms.lora_clients.
        self.lora = LoraClients.of(task, self.params)
        if self.lora is not None:
            self.lora.check(self.opt, run.rounds, run.privacy.user_level is not None)
            if self.lora.mode is not None and (cfg.update_cosines or cfg.fedsd.enabled):
                name = "update_cosines" if cfg.update_cosines else "fedsd"
                raise ConfigError(f"algo.{name}", "not run with mixed LoRA ranks")
            self.params = self.lora.sent(self.params)
        # θ_0, for update_norm: rebuilt from the seed, so a resumed run has it too.
        self.origin = {k: v.clone() for k, v in self.params.items()}
        self.fedsd = FedSD(cfg)
        if self.secagg is not None:
            refuse_non_sum(cfg.aggregator, cfg.update_cosines)
            if self.lora is not None and self.lora.mode is not None:
                raise ConfigError(
                    "task.lora.client_ranks",
                    "clients of different ranks send vectors of different shapes; secagg+"
                    " sums vectors of one shape",
                )

    @classmethod
    @override
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        FedSD.check_task(cfg, task_cls, task_cfg)

    def model(self) -> nn.Module:
        """The model instance this process's server and client halves share (scratch)."""
        return self._model

    @override
    def setup(self, fed: Federation) -> dict[str, float]:
        return self.fedsd.setup(self, fed, self.params)

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        if self.lora is not None and self.lora.mode is not None:
            self.params, metrics = self.lora.round(self, fed, self.params, self.opt, self.origin)
            return metrics
        self.params, metrics = fedavg_round(
            self, fed, self.params, self.opt, self.cfg.update_cosines, self.origin
        )
        return metrics

    def full_params(self) -> dict[str, Tensor]:
        """The whole global adapter (FFA-LoRA's frozen ``A`` added to what travels)."""
        return self.lora.full(self.params) if self.lora is not None else self.params

    @override
    def secure_base(self) -> dict[str, Tensor]:
        return self.params

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        params = self.full_params()
        return evaluate_global(self.task, fed, self._model, params, self.cfg.personal_eval)

    @override
    def export_adapter(self, folder: Path) -> bool:
        return export_global(self.task, self._model, self.full_params(), folder)

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        meta = {"lora_filled": self.lora.filled} if self.lora is not None else {}
        return join_groups({"params": self.params, "opt": self.opt.state_dict()}), meta

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, "params")
        self.opt.load_state_dict(get_group(arrays, "opt"))
        if self.lora is not None:  # FLoRA: the components holding stacks
            self.lora.filled = int(meta.get("lora_filled", 0))


class FedProxConfig(FedAvgFamilyConfig):
    """FedProx: FedAvg plus a proximal term of weight ``mu`` in local training."""

    mu: float = Field(0.01, ge=0)


class FedProxClient(FedAvgClient):
    """FedAvg's client half with the proximal weight ``algo.mu`` in local training."""

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        mu = cfg.mu if isinstance(cfg, FedProxConfig) else 0.0
        self.prox = run.train.model_copy(update={"prox_mu": mu})

    @override
    def train_cfg(self) -> TrainConfig:
        return self.prox


class FedProx(FedAvg):
    """FedProx (Li et al. 2020): local loss + (mu/2)·||w − w_global||²."""

    Config = FedProxConfig
    Client = FedProxClient


SCAFFOLD_TRAIN = MessageKind(
    "train",
    down_arrays=("params", "control"),
    down_meta=("clip",),
    up_arrays=("delta_y", "delta_c"),
    up_meta=("num_examples", "loss", "clip_bit"),
    meta_specs=UPDATE_META,
    dp_fields=("delta_y", "clip_bit"),
)


class ScaffoldConfig(FedSDOption):
    """SCAFFOLD with a global step size (and the FedSD phase, ``algo.fedsd``)."""

    lr_global: float = Field(1.0, gt=0)
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig)
    personal_eval: bool = False
    update_cosines: bool = Field(False, description=UPDATE_COSINES_HELP)


class ScaffoldClient(ClientHalf):
    """SCAFFOLD's client half: local SGD corrected by ``c − c_i``, ``c_i`` in the client's state.

    With ``algo.fedsd`` on, the FedSD phase adds its ``refine`` handler and local training
    reads the client's distilled set.
    """

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.model = shared_model(task, run.seed)  # loaded from every message before use
        self.fedsd = FedSD(cfg)

    @override
    def handlers(self) -> dict[str, Handler]:
        return {
            "train": self.train,
            "evaluate": lambda ctx, msg: evaluate_locally(ctx, self.model, msg),
            **self.fedsd.handlers(self.task, self.model),
        }

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """Local SGD corrected by ``c − c_i``; replies ``y_i − x`` and ``c_i⁺ − c_i``.

        Under client-side DP-FedAvg only the clipped, noised ``Δy`` leaves (the client's
        privacy wrapper, :class:`fedfm.core.userdp.ClientDP`); the server derives ``Δc``
        from its noisy mean.
        """
        model = self.model
        glob, c = msg.arrays["params"], msg.arrays["control"]
        c_i = ctx.state.get_group("control") or {k: v.new_zeros(v.shape) for k, v in c.items()}
        self.task.set_params(model, glob)
        corr = {k: c[k] - c_i[k] for k in self.task.param_names(model)}  # trainable tensors
        data = self.fedsd.train_data(ctx)
        res = local_round(ctx, model, self.run.train, grad_correction=corr, data=data)
        local = self.task.get_params(model, list(glob))
        lr = client_config(ctx, self.run.train).lr  # the round's rate, as local_round used
        c_new = scaffold_client_control(c_i, c, glob, local, res.steps, lr)
        ctx.state.set_group("control", c_new)
        delta_y = {k: local[k] - glob[k] for k in glob}
        n = self.task.num_examples(ctx.data)
        return Message(
            "train",
            {"delta_y": delta_y, "delta_c": {k: c_new[k] - c_i[k] for k in c}},
            {"num_examples": n, "loss": res.loss},
        )


@dataclass
class ScaffoldStep:
    """SCAFFOLD's new server state after a round: the model ``x`` and the control ``c``."""

    params: dict[str, Tensor]
    control: dict[str, Tensor]


class ScaffoldRound:
    """SCAFFOLD's round sum (a :class:`~fedfm.core.aggregate.RoundSum`).

    Each reply's ``Δy`` at its size and its ``Δc`` uniformly
    (:class:`~fedfm.core.optim.ScaffoldSums`); closed, the server update.
    """

    def __init__(self, sums: ScaffoldSums, num_clients: int, lr_global: float) -> None:
        self.sums = sums
        self.num_clients = num_clients  # N
        self.lr_global = lr_global

    def fold(self, reply: Message, field: str) -> None:
        """Adds one client's ``Δy`` (its ``field``) and ``Δc``."""
        n = meta_number(reply, "num_examples")
        self.sums.add(reply.arrays[field], reply.arrays["delta_c"], n)

    def add_sum(self, total: Mapping[str, Tensor], extra: float, count: int) -> None:
        """SCAFFOLD takes no secure sum (its ``Δc`` is not in the masked vector).

        Raises:
            TypeError: Always.
        """
        raise TypeError("SecAgg+ cannot fold into SCAFFOLD's sums")

    def close(self) -> ScaffoldStep | None:
        """The server update (Karimireddy et al., eq. (5)), or None when nobody replied."""
        if self.sums.count == 0:
            return None
        params, control = self.sums.apply(self.num_clients, self.lr_global)
        return ScaffoldStep(params, control)


class Scaffold(Algorithm):
    """SCAFFOLD (Karimireddy et al. 2020), option II control variates.

    Clients keep their control variate ``c_i`` in their persistent state; local steps use
    SGD with the gradient corrected by ``c − c_i``.
    """

    Config = ScaffoldConfig
    Client = ScaffoldClient
    messages = (SCAFFOLD_TRAIN, EVALUATE, *FedSD.kinds)
    update_kinds = ("train",)

    def __init__(self, cfg: ScaffoldConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.cfg: ScaffoldConfig = cfg
        if run.privacy.user_level is not None:
            if not cfg.aggregator.plain:
                raise ConfigError(
                    "algo.aggregator", "privacy.user_level aggregates by its own noised sum"
                )
            if run.train.epochs is not None:
                raise ConfigError(
                    "train.epochs",
                    "SCAFFOLD under privacy.user_level derives the control update from the"
                    " noised model update and needs the same local steps everywhere: set"
                    " train.steps",
                )
        self._model = shared_model(task, run.seed)
        self.params: dict[str, Tensor] = task.get_params(self._model)
        self.origin = {k: v.clone() for k, v in self.params.items()}  # θ_0, for update_norm
        self.control = {k: v.new_zeros(v.shape) for k, v in self.params.items()}
        self.fedsd = FedSD(cfg)

    @classmethod
    @override
    def check_task(cls, cfg: AlgoConfig, task_cls: type[Task], task_cfg: TaskConfig) -> None:
        FedSD.check_task(cfg, task_cls, task_cfg)

    def model(self) -> nn.Module:
        """The model instance this process's server and client halves share (scratch)."""
        return self._model

    @override
    def setup(self, fed: Federation) -> dict[str, float]:
        return self.fedsd.setup(self, fed, self.params)

    @override
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        msg = Message("train", {"params": self.params, "control": self.control})
        like = {"delta_y": self.params, "delta_c": self.control}
        loss = MetricMean("loss")
        ups = UpdateCosines(self.params) if self.cfg.update_cosines else None

        def each(cid: str, r: Message) -> None:
            if "loss" in r.meta:  # a DP client sends none
                loss.add(r)
            if ups is not None:
                ups.add_delta(cid, r.arrays["delta_y"])

        def start(base: Mapping[str, Tensor]) -> ScaffoldRound:
            sums = ScaffoldSums(self.params, self.control, self.cfg.aggregator)
            return ScaffoldRound(sums, len(fed.client_ids()), self.cfg.lr_global)

        zeros = {k: torch.zeros_like(v) for k, v in self.params.items()}  # Δy is a difference
        got = self.aggregate(fed, {c: msg for c in cids}, "delta_y", zeros, start, like, each)
        if isinstance(got.result, ScaffoldStep):
            self.params, self.control = got.result.params, got.result.control
        elif got.result is not None:
            self._noised_step(got.result)
        metrics = {"train_loss": loss.mean("loss")} if loss.count else {}
        metrics["clients"] = len(got.clients)
        metrics["update_norm"] = update_norm(self.params, self.origin)
        return {**metrics, **(ups.result() if ups is not None else {})}

    def _noised_step(self, step: dict[str, Tensor]) -> None:
        """The step from Δ̃, DP-FedAvg's noised mean of the clients' Δy.

        x ← x + η_g·Δ̃ and c ← c + q·(−c − Δ̃/(K·η_l)): the paper's control update for the
        mean of Δc (Δc_i = −c − Δy_i/(K·η_l)) computed from Δ̃, with ``q`` for |S|/N (ours).
        """
        k_lr = self.run.train.steps * self.run.train.lr
        eta, q = self.cfg.lr_global, self.run.clients.fraction
        self.params = {k: (p + eta * step[k]).to(p.dtype) for k, p in self.params.items()}
        self.control = {
            k: (c + q * (-c - step[k] / k_lr)).to(c.dtype) for k, c in self.control.items()
        }

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        return evaluate_global(self.task, fed, self._model, self.params, self.cfg.personal_eval)

    @override
    def export_adapter(self, folder: Path) -> bool:
        return export_global(self.task, self._model, self.params, folder)

    @override
    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return join_groups({"params": self.params, "control": self.control}), {}

    @override
    def load_state_dict(self, arrays: dict[str, Tensor], meta: dict[str, Any]) -> None:
        self.params = get_group(arrays, "params")
        self.control = get_group(arrays, "control")


LOCAL_TRAIN = MessageKind("train", up_meta=("num_examples", "loss"))
LOCAL_EVALUATE = MessageKind(
    "evaluate", up_meta=("num_examples", "metrics"), meta_specs={"num_examples": EVAL_EXAMPLES}
)


class LocalOnlyClient(ClientHalf):
    """The local-only client half: the client's own model, in its state, trained and scored."""

    def __init__(self, cfg: AlgoConfig, task: Task, run: RunConfig) -> None:
        super().__init__(cfg, task, run)
        self.model = shared_model(task, run.seed)
        self.init = task.get_params(self.model)  # every client starts from the same weights

    def _load_own(self, ctx: ClientContext) -> nn.Module:
        self.task.set_params(self.model, ctx.state.get_group("model") or self.init)
        return self.model

    @override
    def handlers(self) -> dict[str, Handler]:
        return {"train": self.train, "evaluate": self.evaluate}

    def train(self, ctx: ClientContext, msg: Message) -> Message:
        """The client's own model, trained for the run's local budget."""
        model = self._load_own(ctx)
        res = local_round(ctx, model, self.run.train)
        ctx.state.set_group("model", self.task.get_params(model))
        return Message(
            "train", meta={"num_examples": self.task.num_examples(ctx.data), "loss": res.loss}
        )

    def evaluate(self, ctx: ClientContext, msg: Message) -> Message:
        """The client's own model on the global test set and on its local test split."""
        model = self._load_own(ctx)
        glob = {f"test/{k}": v for k, v in self.task.evaluate(model, self.task.test_data()).items()}
        loc = self.task.evaluate(model, self.task.client_test_data(ctx.cid))
        metrics = {**glob, **{f"local/{k}": v for k, v in loc.items()}}
        return Message(
            "evaluate", meta={"num_examples": self.task.num_examples(ctx.data), "metrics": metrics}
        )


class LocalOnly(Algorithm):
    """Local-only baseline: each client trains its own model and shares nothing.

    Each client's model lives in its persistent state; evaluation reports each client's model
    on the global test set (``test/``) and on its own local test split (``local/``).
    """

    Client = LocalOnlyClient
    messages = (LOCAL_TRAIN, LOCAL_EVALUATE)
    personalised = True

    # ----- server half -----
    @override
    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        replies = fed.broadcast(Message("train"), cids)
        self.require(fed, replies, len(cids))
        return {"train_loss": weighted_mean_metric(replies, "loss"), "clients": len(replies)}

    @override
    def evaluate(self, fed: Federation) -> dict[str, Any]:
        replies = fed.broadcast(Message("evaluate"), fed.client_ids())
        per = {c: _metrics(r) for c, r in replies.items()}
        out: dict[str, Any] = summarise_client_metrics(per, "")
        # The headline metric of a local-only run is the mean client on the global test set.
        primary = self.task.primary
        if f"test/{primary}" in out:
            out[primary] = out[f"test/{primary}"]
        out["per_client"] = per
        return out


ALGORITHMS.register("fedavg", "FedAvg with any server optimizer (fedavg, fedavgm, fedadam, ...)")(
    FedAvg
)
ALGORITHMS.register("fedprox", "FedProx: FedAvg with a proximal term in local training")(FedProx)
ALGORITHMS.register("scaffold", "SCAFFOLD: control variates against client drift")(Scaffold)
ALGORITHMS.register("local", "local-only baseline: every client trains alone")(LocalOnly)
