"""A memory and traffic plan of a run, printed before it starts (``fedfm plan CONFIG``).

For the server and for one client: parameters (frozen / trainable), the estimated peak memory
split into its parts, the bytes each client sends and receives per round, and whether it fits
the run's device (available RAM through psutil on the CPU, free device memory on CUDA). The
embedded runtime holds the server and every simulated client in one process; its peak is what
is checked there, a client's alone for the Flower deployment engine.

Nothing is loaded to make the plan: a causal LM is built on torch's ``meta`` device from its
config (no weights), and peft wraps that to count the adapters exactly. The small model of
another task is built on ``meta`` too, or on the CPU when its builder cannot run on ``meta``
(it moves the model to the run's device). Only the task's data is
read, to know how many clients there are.

The estimate of an LLM run (the terms, per decoder layer, are what autograd keeps for the
backward pass through a frozen base with LoRA; ``N`` tokens of ``batch x max_length``,
``s`` bytes per activation, 2 under bfloat16 autocast):

* weights: every base parameter in its dtype (4-bit NF4: 4.13 bits per quantised weight with
  its double-quantised scales; 8-bit: 1 byte plus a float scale per row; the layers left
  unquantised in float32, as QLoRA's preparation leaves them);
* autocast copies: under autocast, each frozen linear layer's weight is also kept in bfloat16,
  cast once and shared like the weights (2 bytes per linear weight;
  :mod:`fedfm.models.cast_once`);
* adapters (float32), their gradients and the optimizer state (Adam: 2 tensors, SGD with
  momentum: 1, 8-bit Adam: 2 bytes per weight);
* training activations per layer: the two norms' float32 inputs (``8 N h``), the attention's
  query, key, value and output (``4 N h s``), the MLP's gate, up and activation (``3 N m s``;
  ``2 N m s`` where :mod:`fedfm.models.gated_mlp` recomputes the activation),
  and each adapted linear layer's input (``N d_in s``, plus its dropout mask); then the logits
  (``N V`` in ``s``, their float32 copy, the saved log-softmax and its gradient: an upper
  bound, as only the scored positions get logits; for the architectures whose loss
  :mod:`fedfm.models.lm_loss` computes, ``N`` is at most its chunk of rows) and, while one
  layer's backward runs, the float32 gradients of its activations (``N (2h + 3m) 4``);
* evaluation: scoring (perplexity, log-likelihood choices) keeps the logits of one batch of
  ``eval_batch_size x max_length`` (in ``s``, float32, log-softmax; at most a chunk of rows
  where :mod:`fedfm.models.lm_loss` scores the labels); generation keeps the key /
  value cache of ``eval_batch_size x (max_prompt_length + max_new_tokens)`` tokens;
* the server: the global adapter, the running mean of the replies and the server optimizer's
  state; the client-state store: adapters kept per client (FedSDR's LoRA-S);
* workers (``clients.parallel``): each client trained at once in its own forked process holds
  its own training memory (everything of a client but the shared weights and data: adapters,
  gradients, optimizer state, activations); ``auto`` takes as many workers as there are cores
  and sampled clients, and no more than the memory available holds.

``benchmarks/plan_accuracy.py`` compares the estimate with measured peaks (docs/plan.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from fedfm.config import RunConfig

MB = 2**20
# Server optimizer state tensors per trainable tensor (fedfm.core.optim).
_SERVER_STATES = {"fedavg": 0, "fedavgm": 1, "fedadagrad": 1, "fedadam": 2, "fedyogi": 2}
# Adapters an algorithm holds on a client beyond the global one, and those kept per client.
_EXTRA_ADAPTERS = {"fedsdr": 1}
_KEPT_PER_CLIENT = {"fedsdr": 1, "local": 1}
# Tensors of the trainable size sent each way per client and round (SCAFFOLD adds controls).
_MESSAGE_COPIES = {"scaffold": 2}
_OPT_STATES = {"sgd": 0.0, "adam": 8.0, "adamw": 8.0, "adamw_8bit": 2.0, "paged_adamw_8bit": 2.0}
_OPT_STATES["paged_adamw_32bit"] = 8.0


@dataclass
class Side:
    """The plan of one side (the server, or one client).

    Attributes:
        role: ``"server"`` or ``"client"``.
        frozen: Frozen parameters held.
        trainable: Trainable parameters held.
        parts: Estimated bytes by part (weights, adapters, optimizer, activations, ...).
        counted: Whether the model was counted (False: its builder could not run here).
    """

    role: str
    frozen: int
    trainable: int
    parts: dict[str, int] = field(default_factory=dict)
    counted: bool = True

    @property
    def peak(self) -> int:
        """Estimated peak bytes: the sum of the parts."""
        return sum(self.parts.values())


@dataclass
class Plan:
    """What a run needs: each side's memory, the traffic per round, and whether it fits.

    Attributes:
        device: The device the run resolves to.
        available: Bytes free on it now.
        server: The server's side.
        client: One client's side.
        process: Estimated peak of the process that holds the run on this runtime (with its
            workers, summed).
        process_what: What that process holds (``server and 10 clients``, ``one client``).
        workers: Clients trained at once in worker processes (1: in the run's process).
        clients: Number of clients; ``sampled`` of them train each round.
        up: Bytes one client sends per round; ``down``: receives; both None when the model
            was not counted (not estimated, rather than 0).
        notes: What the estimate leaves out for this config.
    """

    device: str
    available: int
    server: Side
    client: Side
    process: int
    process_what: str
    clients: int
    sampled: int
    up: int | None
    down: int | None
    notes: list[str] = field(default_factory=list)
    workers: int = 1

    @property
    def fits(self) -> bool:
        """Whether the estimated peak fits the memory available on the device."""
        return self.process <= self.available

    def summary(self) -> str:
        """The one line ``fedfm run`` prints at start."""
        verdict = "fits" if self.fits else "DOES NOT FIT"
        traffic = "traffic not estimated (the model was not counted)"
        if self.up is not None and self.down is not None:
            traffic = (
                f"{self.sampled} clients x {self.up / 1e6:.2f} MB up, {self.down / 1e6:.2f} MB down"
            )
        return (
            f"plan: {self.device}, {self.process_what}: peak ~{self.process / MB:,.0f} MiB of"
            f" {self.available / MB:,.0f} MiB available ({verdict}); per round {traffic}"
        )

    def table(self) -> str:
        """The full plan as plain text, one line per part."""
        lines = [self.summary(), ""]
        for side in (self.server, self.client):
            lines.append(
                f"{side.role}: {side.frozen:,} frozen + {side.trainable:,} trainable parameters,"
                f" peak ~{side.peak / MB:,.1f} MiB"
            )
            lines += [f"  {k:<22} {v / MB:>10,.1f} MiB" for k, v in side.parts.items() if v]
        if self.up is not None and self.down is not None:
            lines.append(
                f"traffic per round: {self.sampled} of {self.clients} clients, each"
                f" {self.up:,} B up and {self.down:,} B down"
                f" ({self.sampled * (self.up + self.down) / 1e6:.2f} MB in all)"
            )
        else:
            lines.append(
                f"traffic per round: not estimated ({self.sampled} of {self.clients} clients)"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_plan(cfg: RunConfig) -> Plan:
    """The plan of a validated config (reads the task's data, loads no weights).

    Raises:
        ConfigError: The config is refused (as when it is run).
    """
    from fedfm import devices
    from fedfm.engine import BUILD_FIELDS, resolve
    from fedfm.errors import config_fields
    from fedfm.tasks.base import TASKS
    from fedfm.tasks.lm import InstructionConfig

    _, task_cfg = resolve(cfg)
    before = _rss()
    with config_fields(BUILD_FIELDS):
        task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
    data = max(0, _rss() - before)  # the task's data (and the modules it imported), measured
    n = len(task.client_ids())
    c = cfg.clients
    sampled = min(n, max(c.min_clients, round(c.fraction * n)))  # as Federation.sample
    if isinstance(task_cfg, InstructionConfig):
        server, client, notes = _llm_sides(cfg, task_cfg, n)
    else:
        server, client, notes = _model_sides(cfg, task)
    server.parts = {"task data (measured)": data, **server.parts}
    client.parts = {"task data (measured)": data, **client.parts}
    copies = _MESSAGE_COPIES.get(cfg.algorithm, 1)
    per_client = client.trainable * 4 * copies
    if isinstance(cfg.algo, dict) and cfg.algo.get("personal_eval") and client.counted:
        notes.append(
            f"personal evaluation sends each client the model once more per evaluation"
            f" ({client.trainable * 4:,} B down, not in the traffic per round)"
        )
    device = cfg.torch_device()
    embedded = cfg.runtime != "flower"
    workers = 1
    what = f"server and {n} clients in one process" if embedded else "one client"
    if embedded:  # one base and one data set; the server evaluates between trainings
        evaluation = server.parts.get("evaluation", 0)
        base = server.peak - evaluation
        training = _training(client)
        available = devices.memory_available(device)
        workers = _workers(cfg, sampled, training, max(0, available - base))
        process = base + max(evaluation, workers * training)
        if workers > 1:
            what = f"server and {n} clients, {workers} trained at once in worker processes"
            notes.append(
                f"{workers} workers of {training / MB:,.0f} MiB of training memory each; a"
                " worker shares the base and data with the server until it writes a page"
            )
    else:
        process = client.peak
    return Plan(
        device=devices.describe(device),
        available=devices.memory_available(device),
        server=server,
        client=client,
        process=process,
        process_what=what,
        clients=n,
        sampled=sampled,
        up=per_client if client.counted else None,
        down=per_client if client.counted else None,
        notes=notes,
        workers=workers,
    )


_SHARED_PARTS = ("weights", "autocast copies", "task data (measured)")
"""A client's parts that workers forked from the server share with it."""


def _training(client: Side) -> int:
    """A client's own training memory: its peak less the weights and data it shares."""
    shared = sum(client.parts.get(k, 0) for k in _SHARED_PARTS)
    return max(0, client.peak - shared)


def fit_workers(limit: int, per_worker: int, available: int) -> int:
    """The most workers, up to ``limit``, whose training memory fits ``available`` (at least 1).

    Args:
        limit: Cores, or sampled clients, whichever is fewer.
        per_worker: Training memory of one worker.
        available: Memory left for the workers.
    """
    fit = available // per_worker if per_worker > 0 else limit
    return int(max(1, min(limit, fit)))


def _workers(cfg: RunConfig, sampled: int, per_worker: int, available: int) -> int:
    """Workers a run's ``clients.parallel`` stands for (``auto``: :func:`fit_workers`)."""
    from fedfm import devices

    asked = cfg.clients.parallel
    if asked != "auto":
        return min(int(asked), max(1, sampled))
    if devices.fork_refused(cfg.torch_device()):
        return 1  # one base per device, and only one device: clients one after the other
    return fit_workers(min(devices.cores(), sampled), per_worker, available)


def parallel_workers(cfg: RunConfig, task: Any) -> int:
    """Workers for a run whose ``task`` is built (its weights and data already in memory).

    Explicit values are taken as they are; ``auto`` fits the workers' training memory (as
    :func:`make_plan` counts it) into the memory available now. The global random states are
    left as they were (building a model on ``meta`` may seed them), so that a run draws the
    same numbers whatever its ``clients.parallel``.
    """
    if cfg.clients.parallel == 1:
        return 1
    from fedfm.core.checkpoint import rng_state, set_rng_state

    saved = rng_state()
    try:
        return _parallel_workers(cfg, task)
    finally:
        set_rng_state(saved)


def _parallel_workers(cfg: RunConfig, task: Any) -> int:
    from fedfm import devices
    from fedfm.engine import resolve
    from fedfm.tasks.lm import InstructionConfig

    _, task_cfg = resolve(cfg)
    n = len(task.client_ids())
    c = cfg.clients
    sampled = min(n, max(c.min_clients, round(c.fraction * n)))
    if isinstance(task_cfg, InstructionConfig):
        _, client, _ = _llm_sides(cfg, task_cfg, n)
    else:
        _, client, _ = _model_sides(cfg, task)
    available = devices.memory_available(cfg.torch_device())
    return _workers(cfg, sampled, _training(client), available)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# ----------------------------------------------------------------------------- LLM tasks


@dataclass
class _Shape:
    """What the estimate needs of a causal LM, read off its meta-device build."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int
    frozen: int
    linear: int  # weights of the decoder's linear layers (quantisable, cast under autocast)
    head: int  # weights of the LM head (cast under autocast, never quantised)
    trainable: int
    adapted_inputs: int  # sum of the input widths of the adapted linear layers, all layers
    rank: int
    logit_rows: int | None  # rows whose logits a training step holds at once (None: all)
    mlp_kept: int  # [N, intermediate] activations an MLP keeps for its backward pass


def _llm_shape(task_cfg: Any) -> _Shape:
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from fedfm.models import gated_mlp, lm_loss
    from fedfm.models.causal_lm import causal_lm_config
    from fedfm.models.lora import add_adapters

    config = causal_lm_config(task_cfg.model, task_cfg.model_args)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    frozen = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings().weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) - head
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = add_adapters(model, ["plan"], task_cfg.lora)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    adapted = sum(
        m.in_features
        for name, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), nn.Linear)
    )
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return _Shape(
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        kv_dim=kv_heads * head_dim,
        frozen=frozen,
        linear=linear,
        head=head,
        trainable=trainable,
        adapted_inputs=adapted,
        rank=task_cfg.lora.r,
        logit_rows=lm_loss.CHUNK if lm_loss.plain_head(config) else None,
        mlp_kept=2 if any(isinstance(m, gated_mlp.gated_classes()) for m in model.modules()) else 3,
    )


def _weight_bytes(shape: _Shape, dtype_bytes: int, quantization: str | None) -> int:
    if quantization is None:
        return shape.frozen * dtype_bytes
    other = (shape.frozen - shape.linear) * 4  # unquantised layers in float32 (QLoRA)
    per_weight = 4.127 / 8 if quantization == "4bit" else 1.0
    rows = shape.linear // max(shape.hidden, 1)  # one float scale per output row (8-bit)
    scales = 0 if quantization == "4bit" else rows * 4
    return int(shape.linear * per_weight) + scales + other


def _llm_sides(cfg: RunConfig, task_cfg: Any, n_clients: int) -> tuple[Side, Side, list[str]]:
    shape = _llm_shape(task_cfg)
    dtype_bytes = 2 if task_cfg.dtype == "bfloat16" else 4
    from fedfm import devices

    # The autocast the run will have: none on a CPU without bfloat16 instructions.
    autocast = devices.autocast_in_effect(cfg.torch_device(), task_cfg.autocast_bf16) is not None
    s = 2 if autocast or dtype_bytes == 2 else 4
    weights = _weight_bytes(shape, dtype_bytes, task_cfg.quantization)
    adapters = 1 + _EXTRA_ADAPTERS.get(cfg.algorithm, 0)
    tr = shape.trainable * 4  # float32 adapters
    optimizer = cfg.train.optimizer
    opt_state = _OPT_STATES[optimizer] * shape.trainable
    if optimizer == "sgd" and cfg.train.momentum > 0:
        opt_state = 4.0 * shape.trainable
    h, m, layers, v = shape.hidden, shape.intermediate, shape.layers, shape.vocab
    n_tok = cfg.train.batch_size * task_cfg.prompt.max_length
    dropout_mask = 1 if task_cfg.lora.dropout > 0 else 0
    per_layer = n_tok * (8 * h + 4 * h * s + shape.mlp_kept * m * s)
    lora_inputs = n_tok * (shape.adapted_inputs * (s + dropout_mask) + 2 * shape.rank * s)
    logits = min(n_tok, shape.logit_rows or n_tok) * v * (s + 4 + 4 + 4)
    # The backward pass of one layer holds the gradients of its activations (float32).
    backward = n_tok * (2 * h + 3 * m) * 4
    train_act = layers * per_layer + lora_inputs + logits + backward
    float32_base = dtype_bytes == 4 and task_cfg.quantization is None
    copies = (shape.linear + shape.head) * 2 if autocast and float32_base else 0
    evaluation = _eval_bytes(task_cfg, shape, s)
    client = Side(
        "client",
        shape.frozen,
        shape.trainable * adapters,
        {
            "weights": weights,
            "adapters": tr * adapters,
            "gradients": tr,
            "optimizer state": int(opt_state),
            "activations": int(train_act),
            "autocast copies": copies,
        },
    )
    server_states = _SERVER_STATES.get(_server_opt(cfg), 0)
    kept = _KEPT_PER_CLIENT.get(cfg.algorithm, 0) * n_clients * tr
    server = Side(
        "server",
        shape.frozen,
        shape.trainable,
        {
            "weights": weights,
            "global + running mean": 2 * tr,
            "server optimizer": server_states * tr,
            "client states": kept,
            "evaluation": evaluation,
        },
    )
    notes = [
        f"activations at batch {cfg.train.batch_size} x {task_cfg.prompt.max_length} tokens"
        f" (train.batch_size x task.prompt.max_length), {s} bytes per activation"
    ]
    if cfg.algorithm not in ("fedavg", "fedprox", "scaffold", "local", "fedsdr", "fedhds"):
        notes.append(f"{cfg.algorithm}: its own extra state (teachers, DP) is not estimated")
    return server, client, notes


def _eval_bytes(task_cfg: Any, shape: _Shape, s: int) -> int:
    """Peak of an evaluation batch: scoring logits, or generation's key/value cache."""
    b = task_cfg.eval_batch_size
    t = task_cfg.prompt.max_length
    scoring = task_cfg.eval_ppl or task_cfg.choice_mode == "loglik"
    rows = min(b * t, shape.logit_rows or b * t)  # the labelled positions, a chunk at a time
    logits = rows * shape.vocab * (s + 4 + 4) if scoring else 0
    tokens = task_cfg.prompt.max_prompt_length + task_cfg.max_new_tokens
    kv = b * tokens * shape.layers * 2 * shape.kv_dim * s
    layer = b * t * (6 * shape.hidden + 3 * shape.intermediate) * s  # one layer's transients
    return max(logits, kv) + layer


def _server_opt(cfg: RunConfig) -> str:
    opt = cfg.algo.get("server_opt", {}) if isinstance(cfg.algo, dict) else {}
    return str(opt.get("name", "fedavg")) if isinstance(opt, dict) else "fedavg"


# ----------------------------------------------------------------------------- other tasks


def _model_sides(cfg: RunConfig, task: Any) -> tuple[Side, Side, list[str]]:
    """Parameters and their state for a task without an LLM, its model built on ``meta``."""
    import torch

    from fedfm.engine import BUILD_FIELDS
    from fedfm.errors import ConfigError, config_fields

    model = None
    for where in (torch.device("meta"), torch.device("cpu")):
        try:
            with config_fields(BUILD_FIELDS), where:
                model = task.build_model(seed=cfg.seed)
            break
        except ConfigError:  # refused as the run would refuse it, named by its config path
            raise
        except Exception as err:
            # A builder that moves its model to the run's device (or reads weights) cannot
            # run on meta: the models of these tasks are small, so it is built on the CPU.
            why = type(err).__name__
    if model is None:
        note = f"the model was not counted: its builder failed on the CPU ({why})"
        return Side("server", 0, 0, counted=False), Side("client", 0, 0, counted=False), [note]
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params) - trainable
    weights = sum(p.numel() * p.element_size() for p in params)
    opt = _OPT_STATES[cfg.train.optimizer] * trainable
    client = Side(
        "client",
        frozen,
        trainable,
        {"weights": weights, "gradients": trainable * 4, "optimizer state": int(opt)},
    )
    server = Side("server", frozen, trainable, {"weights": weights, "running mean": trainable * 4})
    return server, client, ["activations are estimated for LLM tasks only"]


def plan_fits_or_warn(plan: Plan, strict: bool) -> None:
    """Warns when the plan does not fit; with ``strict`` refuses the run.

    Raises:
        ConfigError: ``strict`` and the estimate exceeds the memory available (field
            ``device``).
    """
    import logging

    from fedfm.errors import ConfigError

    if plan.fits:
        return
    why = (
        f"the estimated peak {plan.process / MB:,.0f} MiB exceeds the"
        f" {plan.available / MB:,.0f} MiB available on {plan.device}"
    )
    if strict:
        raise ConfigError("device", why)
    logging.getLogger("fedfm").warning("%s (fedfm plan CONFIG shows the parts)", why)
