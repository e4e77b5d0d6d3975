"""The one local-training loop that every algorithm calls.

Steps or epochs, SGD/Adam/AdamW, gradient clipping, FedProx's proximal term
(Li et al. 2020, "Federated Optimization in Heterogeneous Networks"), SCAFFOLD's gradient
correction (Karimireddy et al. 2020) and any extra loss (knowledge distillation) live here,
so algorithms never write their own loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from fedfm.core.settings import BNB_OPTIMIZERS, TrainConfig
from fedfm.devices import grad_scaler, model_device, to_device

if TYPE_CHECKING:
    from fedfm.core.federation import ClientContext

Batch = Any
LossFn = Callable[[nn.Module, Batch], tuple[Tensor, Any]]
ExtraLoss = Callable[[nn.Module, Batch, Any], Tensor]


@dataclass
class TrainResult:
    """What a local training call did.

    Attributes:
        steps: Optimizer steps taken.
        loss: Mean training loss (task loss plus extra loss, without the proximal term).
        skipped: Steps the float16 gradient scaler skipped (gradients overflowed).
    """

    steps: int
    loss: float
    skipped: int = 0


def num_steps(cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps for a client with ``num_examples`` examples."""
    if cfg.epochs is not None:
        return max(1, math.ceil(cfg.epochs * num_examples / cfg.batch_size))
    return cfg.steps


def scheduled_lr(cfg: TrainConfig, rnd: int, rounds: int) -> float:
    """The local learning rate of round ``rnd`` of ``rounds`` under ``cfg.schedule``.

    See :class:`fedfm.core.settings.LrSchedule` for the formula. Phases outside the rounds (round 0
    before them, ``rounds + 1`` after) train at the rate of the nearest round.
    """
    sched = cfg.schedule
    t = min(max(rnd, 1), max(rounds, 1))
    warm = sched.warmup_rounds
    if warm and t <= warm:
        return cfg.lr * t / warm
    if sched.name == "constant":
        return cfg.lr
    # FlowerTune's cosine_annealing over the rounds after the warm-up.
    span = max(rounds - warm, 1)
    return sched.min_lr + 0.5 * (cfg.lr - sched.min_lr) * (
        1 + math.cos(math.pi * (t - warm) / span)
    )


def round_config(cfg: TrainConfig, rnd: int, rounds: int) -> TrainConfig:
    """``cfg`` with ``lr`` set to the round's :func:`scheduled_lr` (``cfg`` itself if constant)."""
    if cfg.schedule.is_constant():
        return cfg
    return cfg.model_copy(update={"lr": scheduled_lr(cfg, rnd, rounds)})


def client_config(ctx: ClientContext, cfg: TrainConfig) -> TrainConfig:
    """The local-training settings of this client's round (what its handler trains with).

    :func:`round_config` at ``ctx.rnd`` of the run's rounds.
    """
    if cfg.schedule.is_constant():
        return cfg
    return round_config(cfg, ctx.rnd, ctx.task.run.rounds)


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Builds the local optimizer named in ``cfg``.

    The bitsandbytes optimizers (``adamw_8bit``, ``paged_adamw_8bit``, ``paged_adamw_32bit``)
    are imported only when named; the config refuses them without bitsandbytes or CUDA.
    """
    if cfg.optimizer in BNB_OPTIMIZERS:
        import bitsandbytes as bnb

        cls = {
            "adamw_8bit": bnb.optim.AdamW8bit,
            "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
            "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
        }[cfg.optimizer]
        optimizer: torch.optim.Optimizer = cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return optimizer
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters that require gradients."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def local_train(
    model: nn.Module,
    batches: Iterator[Batch],
    loss_fn: LossFn,
    cfg: TrainConfig,
    steps: int,
    *,
    prox_ref: Mapping[str, Tensor] | None = None,
    extra_loss: ExtraLoss | None = None,
    grad_correction: Mapping[str, Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainResult:
    """Trains ``model`` in place for ``steps`` optimizer steps.

    Args:
        model: The model; only parameters with ``requires_grad`` are trained.
        batches: An endless iterator of batches (each is moved to the model's device).
        loss_fn: ``(model, batch) -> (loss, outputs)``.
        cfg: Optimizer, learning rate, clipping and ``prox_mu``.
        steps: Number of optimizer steps (see :func:`num_steps`).
        prox_ref: Reference weights by parameter name for the proximal term
            ``(mu/2)·||w - w_ref||²`` (FedProx); used when ``cfg.prox_mu > 0``.
        extra_loss: ``(model, batch, outputs) -> loss`` added to the task loss (e.g. KD).
        grad_correction: Tensors by parameter name added to each gradient before the step
            (SCAFFOLD's ``c - c_i``).
        optimizer: An optimizer to reuse (keeps its state across calls); built from ``cfg``
            when None.

    Returns:
        Steps taken and the mean loss.
    """
    named = trainable(model)
    params = list(named.values())
    opt = optimizer or make_optimizer(params, cfg)
    mu = cfg.prox_mu if prox_ref is not None else 0.0
    # Reference weights and corrections arrive as CPU tensors (messages, client state).
    ref = {n: prox_ref[n].to(p.device) for n, p in named.items()} if mu > 0 and prox_ref else {}
    corr = {n: c.to(named[n].device) for n, c in (grad_correction or {}).items() if n in named}
    device = model_device(model)
    # float16 autocast (a device without bfloat16) underflows small gradients unscaled.
    scaler = grad_scaler(device)
    skipped = 0
    was_training = model.training
    model.train()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        batch = to_device(next(batches), device)
        loss, out = loss_fn(model, batch)
        if extra_loss is not None:
            loss = loss + extra_loss(model, batch, out)
        total += loss.detach()
        if mu > 0:
            # Proximal term of FedProx: pulls local weights towards the round's global weights.
            loss = loss + 0.5 * mu * sum(((p - ref[n]) ** 2).sum() for n, p in named.items())
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # corrections and clipping act on the true gradients
        if grad_correction is not None:
            for n, p in named.items():
                if p.grad is not None:
                    p.grad.add_(corr[n])
        if cfg.clip_norm is not None:
            nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        if scaler is None:
            opt.step()
        else:
            skipped += _scaled_step(scaler, opt)
    model.train(was_training)
    return TrainResult(steps=steps, loss=float(total) / max(steps, 1), skipped=skipped)


def _scaled_step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> int:
    """The scaler's step and update; 1 when it skipped the step (an overflow), else 0."""
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return int(scaler.get_scale() < scale)


def local_round(
    ctx: ClientContext,
    model: nn.Module,
    cfg: TrainConfig,
    *,
    steps: int | None = None,
    purpose: str = "batches",
    loss_fn: LossFn | None = None,
    data: Any = None,
    **kw: Any,
) -> TrainResult:
    """One client's local training on its own data: the round of a client handler.

    Batches come from the task, shuffled with a seed of (run seed, round, client,
    ``purpose``); the number of steps follows ``cfg`` (steps, or epochs over the client's
    examples) unless ``steps`` is given; the learning rate follows ``cfg.schedule`` at the
    context's round (:func:`client_config`).

    Args:
        ctx: The client's context (its data and task).
        model: The model to train in place.
        cfg: Local-training settings (usually the run's ``train`` section).
        steps: Optimizer steps; ``None`` takes the budget of ``cfg``.
        purpose: Seed purpose of the batch order (different stages of a round that must not
            draw the same batches use different purposes).
        loss_fn: ``(model, batch) -> (loss, outputs)``; the task's loss when None.
        data: Training data other than the client's own (e.g. FedSD's distilled set, of the
            same size); ``ctx.data`` when None.
        **kw: Passed on to :func:`local_train` (``prox_ref``, ``extra_loss``,
            ``grad_correction``, ``optimizer``); ``prox_ref`` and ``grad_correction`` are
            keyed as the messages are (``ctx.task.get_params``) and reach the loop by
            parameter name (``ctx.task.param_names``).

    Returns:
        Steps taken and the mean loss.
    """
    task = ctx.task
    data = ctx.data if data is None else data
    cfg = client_config(ctx, cfg)
    n = steps or num_steps(cfg, task.num_examples(data))
    if isinstance(task, OwnLocalStep):  # the task's own loop (a Hugging Face Trainer)
        return task.local_step(model, data, cfg, n, ctx.rng_seed(purpose), loss_fn=loss_fn, **kw)
    batches = task.batches(data, cfg.batch_size, ctx.rng_seed(purpose))
    keyed = [k for k in ("prox_ref", "grad_correction") if kw.get(k) is not None]
    if keyed:
        names = task.param_names(model)
        for k in keyed:
            kw[k] = {names[key]: t for key, t in kw[k].items() if key in names}
    return local_train(model, batches, loss_fn or task.loss, cfg, n, **kw)


@runtime_checkable
class OwnLocalStep(Protocol):
    """A task whose clients train with a loop of their own instead of :func:`local_train`.

    :mod:`fedfm.integrations.hf` is one: a user's Hugging Face ``Trainer``.
    :func:`local_round` hands it the client's data, the round's settings, the number of
    steps and the seed of the batch order, and the extras of the algorithm (``loss_fn``,
    ``prox_ref``, ...), which it must refuse when it cannot honour them.
    """

    def local_step(
        self, model: nn.Module, data: Any, cfg: TrainConfig, steps: int, seed: int, **kw: Any
    ) -> TrainResult:
        """Trains ``model`` in place for ``steps`` optimizer steps; the steps and mean loss."""
        ...


@runtime_checkable
class ExchangedTensors(Protocol):
    """A module that names the tensors it sends itself (instead of :func:`state_keys`).

    A module that holds LoRA adapters of a frozen base next to its own layers (the text
    task's encoder with a head) implements it to send its adapters in peft's format, grouped
    by adapter name (:mod:`fedfm.models.lora`), beside its other trainable tensors.
    """

    def exchanged_tensors(self) -> dict[str, Tensor]:
        """The live tensors that leave the module, by the key they travel under.

        The parameters and buffers themselves, not copies.
        """
        ...


def state_keys(model: nn.Module) -> list[str]:
    """What travels by default: trainable parameters and floating-point buffers.

    Frozen parameters (an LLM's base weights under LoRA, a frozen backbone) are left out, so
    only adapters, students and proxies ever leave a client.
    """
    train = {n for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n for n, b in model.named_buffers() if b.is_floating_point()}
    return [k for k in model.state_dict() if k in train or k in buffers]


def exchanged(model: nn.Module) -> dict[str, Tensor]:
    """The live tensors of ``model`` that travel, by key.

    Its :class:`ExchangedTensors` when it names them, else its :func:`state_keys` entries.
    """
    if isinstance(model, ExchangedTensors):
        return model.exchanged_tensors()
    state = model.state_dict(keep_vars=True)  # the parameters themselves, not detached views
    return {k: state[k] for k in state_keys(model)}


def get_params(model: nn.Module, names: list[str] | None = None) -> dict[str, Tensor]:
    """Detached CPU copies of the tensors of ``model`` that travel (:func:`exchanged`).

    Args:
        model: The model.
        names: Only these keys; all when None.
    """
    live = exchanged(model)
    keys = names if names is not None else list(live)
    return {k: live[k].detach().to("cpu", copy=True) for k in keys}


def set_params(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copies ``params`` (keyed as :func:`get_params`) into the model's tensors.

    Tensors not in ``params`` are left as they are.
    """
    live = exchanged(model)
    with torch.no_grad():
        for k, v in params.items():
            live[k].copy_(v)


def param_names(model: nn.Module) -> dict[str, str]:
    """Key of each trainable parameter among the tensors that travel -> its parameter name.

    Messages key tensors as :func:`get_params` does; :func:`local_train` finds parameters by
    name (FedProx's reference, SCAFFOLD's correction).
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    return {k: names[id(t)] for k, t in exchanged(model).items() if id(t) in names}
