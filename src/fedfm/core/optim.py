"""Server optimizers as pure functions over named tensors (aggregation: :mod:`.aggregate`).

Every function here takes ``dict[str, Tensor]`` values and returns new ones; inputs are never
modified (DESIGN.md principle 2). :class:`ServerOptimizer` is the only stateful object and it
only wraps the pure step functions.

Sources:
    * Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan. "Adaptive Federated
      Optimization", ICLR 2021 (arXiv:2003.00295). Algorithm 1 (FedOpt: the server treats the
      averaged client change Δ as a pseudo-gradient) and Algorithm 2 (FedAdagrad, FedYogi,
      FedAdam). FedAvgM is server SGD with momentum, Hsu, Qi, Brown 2019, "Measuring the Effects
      of Non-Identical Data Distribution for Federated Visual Classification".
    * Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. "SCAFFOLD: Stochastic Controlled Averaging
      for Federated Learning", ICML 2020 (arXiv:1910.06378v2), Section 4 eqs. (4)-(5) and
      Algorithm 1.
    * Defaults follow OpenFedLLM (Ye et al. 2024, ``federated_learning/fed_global.py``):
      η = 1e-3, τ = 1e-3, β1 = 0.9, β2 = 0.99, v initialised to τ².

Update rules (Δ is the pseudo-gradient, η the server learning rate):
    * pseudo-gradient  Δ = Σ_k (n_k/n)(θ_k − θ)                        (example-weighted;
                       a robust rule of :mod:`fedfm.core.robust` when one is configured)
    * FedAvg           θ ← θ + η·Δ                                     (η defaults to 1)
    * FedAvgM          m ← β·m + Δ;  θ ← θ + η·m                       (η defaults to 1)
    * adaptive         m ← β1·m + (1−β1)·Δ;  θ ← θ + η·m / (√v + τ)    with
        - FedAdagrad   v ← v + Δ²
        - FedAdam      v ← β2·v + (1−β2)·Δ²
        - FedYogi      v ← v − (1−β2)·Δ²·sign(v − Δ²)

Choices, marked where the references differ:
    * m starts at 0 and v at τ²: Reddi et al. Algorithm 2 asks for v₋₁ ≥ τ² and OpenFedLLM
      starts v at τ² (Flower 1.x starts v at 0). No bias correction, as in Reddi et al. and
      OpenFedLLM (Flower's FedAdam adds one).
    * FedAvgM is undamped by default (m ← β·m + Δ, as Hsu et al. and Reddi et al.).
      ``momentum_dampening=True`` gives OpenFedLLM's form m ← β·m + (1−β)·Δ, and then, as
      OpenFedLLM does, the first round sets m ← Δ so the first step is not shrunk by (1−β).
    * The adaptive optimizers follow Reddi et al. Algorithm 2, which differs from OpenFedLLM in
      three ways: OpenFedLLM averages clients uniformly (we weight by n_k), uses no momentum in
      FedAdagrad and starts m at Δ in round 1 while squaring m (not Δ) in FedAdam/FedYogi.
    * Arithmetic runs in float32 (float64 when the parameter is float64) and the new parameter is
      cast back to its own dtype; state tensors stay in that compute dtype so that v ≈ τ² = 1e-6
      keeps its precision for bfloat16 parameters.
    * (ours) :class:`ServerOptimizer` skips a step that would make a parameter NaN or infinite
      (e.g. huge but finite poisoned updates overflowing float32) and keeps the last good model
      and optimizer state; the step functions themselves stay pure.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from fedfm.core.aggregate import (
    Aggregator,
    Buffered,
    ReplySum,
    RunningMean,
    by_size,
    check_keys,
    check_shape,
    check_weights,
    compute_dtype,
    mean_delta,
    pseudo_gradient,
)
from fedfm.core.messages import Arrays, Message
from fedfm.core.robust import AggregatorConfig, robust_pseudo_gradient
from fedfm.registry import Registry

OptimizerName = Literal["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]

# Default server learning rates: FedAvg/FedAvgM apply the average change as is; the adaptive
# optimizers use OpenFedLLM's η = 1e-3.
_DEFAULT_LR: dict[str, float] = {
    "fedavg": 1.0,
    "fedavgm": 1.0,
    "fedadagrad": 1e-3,
    "fedadam": 1e-3,
    "fedyogi": 1e-3,
}
# State prefixes each optimizer keeps; anything else in a given state is refused.
_STATE_PREFIXES: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedavgm": ("m",),
    "fedadagrad": ("m", "v"),
    "fedadam": ("m", "v"),
    "fedyogi": ("m", "v"),
}


class ServerOptConfig(BaseModel):
    """Server optimizer settings (Reddi et al. 2021; defaults from OpenFedLLM).

    Attributes:
        name: Which server optimizer.
        lr: Server learning rate η; ``None`` means 1.0 for fedavg/fedavgm and 1e-3 otherwise.
        momentum: β of FedAvgM.
        momentum_dampening: FedAvgM uses m ← β·m + (1−β)·Δ (OpenFedLLM) instead of m ← β·m + Δ.
        beta1: First-moment decay of the adaptive optimizers.
        beta2: Second-moment decay of FedAdam and FedYogi.
        tau: Adaptivity τ: added to √v and, squared, the initial v.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: OptimizerName = "fedavg"
    lr: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    momentum_dampening: bool = False
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.99, ge=0, lt=1)
    tau: float = Field(default=1e-3, gt=0, allow_inf_nan=False)

    @property
    def resolved_lr(self) -> float:
        """The server learning rate η actually used."""
        return self.lr if self.lr is not None else _DEFAULT_LR[self.name]


StepFn = Callable[
    [Mapping[str, Tensor], Mapping[str, Tensor], Mapping[str, Tensor], ServerOptConfig],
    tuple[Arrays, Arrays],
]

SERVER_OPTIMIZERS: Registry[StepFn] = Registry("server optimizer", "algo.server_opt.name")
log = logging.getLogger("fedfm")


# ----------------------------------------------------------------------------- step helpers


def _check_step_inputs(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    optimizer: str,
) -> None:
    """Refuses a delta or a state that does not belong to ``params`` and ``optimizer``."""
    check_keys(params, delta, f"{optimizer}: delta vs params")
    for name, p in params.items():
        compute_dtype(name, p)
        check_shape(p, delta[name], f"{optimizer}: delta '{name}'")
    prefixes = _STATE_PREFIXES[optimizer]
    for key, t in state.items():
        prefix, _, name = key.partition("/")
        if prefix not in prefixes or name not in params:
            allowed = ", ".join(f"'{p}/<param>'" for p in prefixes) or "no state"
            raise ValueError(f"{optimizer}: unexpected state entry '{key}' (keeps {allowed})")
        check_shape(params[name], t, f"{optimizer}: state '{key}'")


def _get(t: Tensor, p: Tensor, cd: torch.dtype) -> Tensor:
    """``t`` on ``p``'s device in the compute dtype."""
    return t.to(device=p.device, dtype=cd)


def _state_or(
    state: Mapping[str, Tensor], key: str, p: Tensor, cd: torch.dtype, init: float
) -> Tensor:
    """The state entry ``key``, or a tensor filled with ``init`` when the state lacks it."""
    if key in state:
        return _get(state[key], p, cd)
    return torch.full(p.shape, init, dtype=cd, device=p.device)


def _add(p: Tensor, step: Tensor) -> Tensor:
    """P + step computed in step's dtype, returned as a new tensor in p's dtype."""
    return (p.to(dtype=step.dtype) + step).to(p.dtype)


# ----------------------------------------------------------------------------- step functions


@SERVER_OPTIMIZERS.register("fedavg", help="FedAvg: θ ← θ + η·Δ (η = 1 by default)")
def fedavg_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
) -> tuple[Arrays, Arrays]:
    """FedAvg server step θ ← θ + η·Δ (McMahan et al. 2017; Reddi et al. 2021 Algorithm 1).

    Args:
        params: Global parameters θ.
        delta: Pseudo-gradient Δ (same names and shapes).
        state: Optimizer state; FedAvg keeps none, so it must be empty.
        cfg: Settings; only ``lr`` is used.

    Returns:
        ``(new_params, new_state)``; the state is always empty.
    """
    _check_step_inputs(params, delta, state, "fedavg")
    lr = cfg.resolved_lr
    new = {}
    for name, p in params.items():
        cd = compute_dtype(name, p)
        new[name] = _add(p, lr * _get(delta[name], p, cd))
    return new, {}


@SERVER_OPTIMIZERS.register("fedavgm", help="FedAvgM: m ← β·m + Δ, θ ← θ + η·m")
def fedavgm_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
) -> tuple[Arrays, Arrays]:
    """FedAvgM server step with momentum buffer ``m/<name>`` (Hsu et al. 2019).

    Undamped: m ← β·m + Δ (m starts at 0). With ``cfg.momentum_dampening``:
    m ← β·m + (1−β)·Δ, and m ← Δ when the state has no buffer yet (OpenFedLLM).
    Then θ ← θ + η·m.

    Args:
        params: Global parameters θ.
        delta: Pseudo-gradient Δ.
        state: ``{"m/<name>": m}`` or empty at the start.
        cfg: Settings; uses ``lr``, ``momentum``, ``momentum_dampening``.

    Returns:
        ``(new_params, new_state)`` with ``new_state = {"m/<name>": m}``.
    """
    _check_step_inputs(params, delta, state, "fedavgm")
    lr, beta = cfg.resolved_lr, cfg.momentum
    new, new_state = {}, {}
    for name, p in params.items():
        cd = compute_dtype(name, p)
        d = _get(delta[name], p, cd)
        key = f"m/{name}"
        if cfg.momentum_dampening:
            m = beta * _get(state[key], p, cd) + (1 - beta) * d if key in state else d.clone()
        else:
            m = beta * _state_or(state, key, p, cd, 0.0) + d
        new_state[key] = m
        new[name] = _add(p, lr * m)
    return new, new_state


SecondMoment = Callable[[Tensor, Tensor, ServerOptConfig], Tensor]


def _adaptive_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
    optimizer: str,
    second_moment: SecondMoment,
) -> tuple[Arrays, Arrays]:
    """Shared body of Reddi et al. Algorithm 2; ``second_moment(v, Δ², cfg)`` gives the new v."""
    _check_step_inputs(params, delta, state, optimizer)
    lr, b1, tau = cfg.resolved_lr, cfg.beta1, cfg.tau
    new, new_state = {}, {}
    for name, p in params.items():
        cd = compute_dtype(name, p)
        d = _get(delta[name], p, cd)
        m = b1 * _state_or(state, f"m/{name}", p, cd, 0.0) + (1 - b1) * d
        v = second_moment(_state_or(state, f"v/{name}", p, cd, tau**2), d * d, cfg)
        new_state[f"m/{name}"] = m
        new_state[f"v/{name}"] = v
        new[name] = _add(p, lr * m / (v.sqrt() + tau))
    return new, new_state


@SERVER_OPTIMIZERS.register("fedadagrad", help="FedAdagrad: v ← v + Δ² (Reddi et al. 2021)")
def fedadagrad_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
) -> tuple[Arrays, Arrays]:
    """FedAdagrad: m ← β1·m + (1−β1)·Δ; v ← v + Δ²; θ ← θ + η·m/(√v + τ).

    Args:
        params: Global parameters θ.
        delta: Pseudo-gradient Δ.
        state: ``{"m/<name>", "v/<name>"}`` tensors, or empty (m = 0, v = τ²).
        cfg: Settings; uses ``lr``, ``beta1``, ``tau``.

    Returns:
        ``(new_params, new_state)``.
    """
    return _adaptive_step(params, delta, state, cfg, "fedadagrad", lambda v, d2, _: v + d2)


@SERVER_OPTIMIZERS.register("fedadam", help="FedAdam: v ← β2·v + (1−β2)·Δ² (Reddi et al. 2021)")
def fedadam_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
) -> tuple[Arrays, Arrays]:
    """FedAdam: m ← β1·m + (1−β1)·Δ; v ← β2·v + (1−β2)·Δ²; θ ← θ + η·m/(√v + τ).

    No bias correction (Reddi et al. 2021 Algorithm 2).

    Args:
        params: Global parameters θ.
        delta: Pseudo-gradient Δ.
        state: ``{"m/<name>", "v/<name>"}`` tensors, or empty (m = 0, v = τ²).
        cfg: Settings; uses ``lr``, ``beta1``, ``beta2``, ``tau``.

    Returns:
        ``(new_params, new_state)``.
    """
    return _adaptive_step(
        params, delta, state, cfg, "fedadam", lambda v, d2, c: c.beta2 * v + (1 - c.beta2) * d2
    )


@SERVER_OPTIMIZERS.register(
    "fedyogi", help="FedYogi: v ← v − (1−β2)·Δ²·sign(v − Δ²) (Reddi et al. 2021)"
)
def fedyogi_step(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    cfg: ServerOptConfig,
) -> tuple[Arrays, Arrays]:
    """FedYogi: m ← β1·m + (1−β1)·Δ; v ← v − (1−β2)·Δ²·sign(v − Δ²); θ ← θ + η·m/(√v + τ).

    Args:
        params: Global parameters θ.
        delta: Pseudo-gradient Δ.
        state: ``{"m/<name>", "v/<name>"}`` tensors, or empty (m = 0, v = τ²).
        cfg: Settings; uses ``lr``, ``beta1``, ``beta2``, ``tau``.

    Returns:
        ``(new_params, new_state)``.
    """
    return _adaptive_step(
        params,
        delta,
        state,
        cfg,
        "fedyogi",
        lambda v, d2, c: v - (1 - c.beta2) * d2 * torch.sign(v - d2),
    )


# ----------------------------------------------------------------------------- stateful wrapper


class ServerOptimizer:
    """Holds the state of one server optimizer between rounds; the maths is in the step functions.

    Args:
        cfg: Settings; defaults to plain FedAvg.
        aggregator: How client updates become Δ (:mod:`fedfm.core.robust`); defaults to the
            example-weighted mean of :func:`pseudo_gradient`. Client-level DP-FedAvg replaces
            it by its own noised sum around the step (:mod:`fedfm.core.userdp`).
    """

    def __init__(
        self,
        cfg: ServerOptConfig | None = None,
        aggregator: AggregatorConfig | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else ServerOptConfig()
        self.aggregator = aggregator if aggregator is not None else AggregatorConfig()
        self._step_fn = SERVER_OPTIMIZERS.get(self.cfg.name)
        self._state: Arrays = {}

    def step(
        self,
        params: Mapping[str, Tensor],
        updates: Sequence[Mapping[str, Tensor]],
        weights: Sequence[float],
    ) -> dict[str, Tensor]:
        """One round: Δ from the client parameters by the aggregator, then the optimizer step.

        Args:
            params: Current global parameters θ (not modified).
            updates: Client parameters θ_k after local training.
            weights: Example counts n_k.

        Returns:
            The new global parameters.
        """
        if self.aggregator.plain:
            delta = pseudo_gradient(params, updates, weights)
        else:
            delta = self._robust(params, updates, weights)
        return self.apply_delta(params, delta)

    def accumulator(self, params: Mapping[str, Tensor]) -> Aggregator:
        """Takes client parameters θ_k as replies arrive; its result is Δ for :meth:`apply_delta`.

        The example-weighted mean streams (one running sum, :func:`mean_delta`); a robust rule
        needs every update at once and keeps them (:class:`Buffered`). Both give the numbers
        :meth:`step` gives for the same updates.
        """
        if self.aggregator.plain:
            return mean_delta(params)
        return Buffered(params, self._robust)

    def round_sum(
        self, params: Mapping[str, Tensor], weight: Callable[[Message], float] = by_size
    ) -> ReplySum:
        """:meth:`accumulator` fed from replies, each at ``weight`` (its size by default)."""
        return ReplySum(self.accumulator(params), weight)

    def _robust(
        self, params: Mapping[str, Tensor], updates: Sequence[Mapping[str, Tensor]], weights: Any
    ) -> Arrays:
        check_weights(weights, len(updates), "robust aggregation")
        for k, u in enumerate(updates):
            check_keys(params, u, f"robust aggregation: update {k} vs params")
        return robust_pseudo_gradient(params, updates, weights, self.aggregator)

    def apply_delta(
        self, params: Mapping[str, Tensor], delta: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """One optimizer step from an already aggregated pseudo-gradient Δ.

        For algorithms whose clients send changes θ_k − θ instead of parameters: aggregate
        them with :func:`weighted_mean` and pass the result here.

        Args:
            params: Current global parameters θ (not modified).
            delta: Pseudo-gradient Δ.

        Returns:
            The new global parameters.
        """
        new_params, new_state = self._step_fn(params, delta, self._state, self.cfg)
        bad = [k for k, t in new_params.items() if not bool(torch.isfinite(t).all())]
        if bad:
            # Applying it would leave no model to train from: every client's next reply
            # would be NaN and rejected. Keep the last good model and optimizer state.
            log.warning(
                "server step skipped: it makes %d tensor(s) non-finite (e.g. '%s')",
                len(bad),
                bad[0],
            )
            return dict(params)
        self._state = new_state
        return new_params

    def state_dict(self) -> dict[str, Tensor]:
        """A copy of the state: contiguous CPU tensors only, ready for safetensors."""
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self._state.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Replaces the state with a copy of ``state`` (as returned by :meth:`state_dict`).

        Names and shapes are checked against the parameters at the next step.

        Raises:
            ValueError: A value is not a tensor or a key is not one this optimizer keeps.
        """
        prefixes = _STATE_PREFIXES[self.cfg.name]
        for key, t in state.items():
            if not isinstance(t, Tensor):
                raise ValueError(f"{self.cfg.name} state '{key}': expected a tensor")
            if key.partition("/")[0] not in prefixes or "/" not in key:
                allowed = ", ".join(f"'{p}/<param>'" for p in prefixes) or "no state"
                raise ValueError(
                    f"{self.cfg.name}: unexpected state entry '{key}' (keeps {allowed})"
                )
        self._state = {k: t.detach().clone() for k, t in state.items()}


# ----------------------------------------------------------------------------- SCAFFOLD


def scaffold_server_update(
    params: Mapping[str, Tensor],
    c_global: Mapping[str, Tensor],
    delta_y: Sequence[Mapping[str, Tensor]],
    delta_c: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    num_clients_total: int,
    lr_global: float = 1.0,
    aggregator: AggregatorConfig | None = None,
) -> tuple[Arrays, Arrays]:
    """SCAFFOLD server update (Karimireddy et al. 2020, eq. (5); Algorithm 1 lines 16-17).

        x ← x + η_g · Σ_i (n_i/n)·Δy_i          Δy_i = y_i − x
        c ← c + (|S|/N) · (1/|S|) Σ_i Δc_i      Δc_i = c_i⁺ − c_i

    The paper averages Δy_i uniformly (1/|S|); we weight by example counts n_i like FedAvg
    (ours; pass equal weights for the paper's form). Δc is averaged uniformly as in the paper,
    since c estimates the mean of the N clients' gradients, which the |S|/N factor keeps unbiased
    under client sampling. The same update from running means: :class:`ScaffoldSums`.

    With a robust ``aggregator`` (ours), both means become its rule: Δy with the weights n_i,
    Δc with equal weights. Δc is in gradient units, not parameter units, so a fixed
    ``clip_norm`` bounds Δy only and Δc is clipped to ``clip_scale`` × its median norm
    whenever clipping is on.

    Args:
        params: Global model x.
        c_global: Server control variate c.
        delta_y: Per sampled client, y_i − x.
        delta_c: Per sampled client, c_i⁺ − c_i.
        weights: Per sampled client, the weight of its Δy_i (example count).
        num_clients_total: N, the number of clients in the federation.
        lr_global: Global step size η_g.
        aggregator: A robust rule for both means (:mod:`fedfm.core.robust`); None: the means.

    Returns:
        ``(new_params, new_c_global)``, each tensor in its input's dtype.

    Raises:
        ValueError: No clients, |S| > N, η_g ≤ 0, bad weights, or mismatched names/shapes.
    """
    s = len(delta_y)
    if s == 0:
        raise ValueError("scaffold_server_update: no client updates")
    if len(delta_c) != s:
        raise ValueError(f"scaffold_server_update: {s} delta_y but {len(delta_c)} delta_c")
    check_weights(weights, s, "scaffold_server_update")
    for k in range(s):
        check_keys(params, delta_y[k], f"scaffold_server_update: delta_y {k} vs params")
        check_keys(c_global, delta_c[k], f"scaffold_server_update: delta_c {k} vs c_global")
    sums = ScaffoldSums(params, c_global, aggregator)
    for dy, dc, w in zip(delta_y, delta_c, weights, strict=True):
        sums.add(dy, dc, w)
    return sums.apply(num_clients_total, lr_global)


def _zeros(arrays: Mapping[str, Tensor]) -> Arrays:
    return {n: torch.zeros_like(t) for n, t in arrays.items()}


def _rule(
    cfg: AggregatorConfig,
) -> Callable[[Mapping[str, Tensor], list[Mapping[str, Tensor]], list[float]], Arrays]:
    return lambda base, updates, weights: robust_pseudo_gradient(base, updates, weights, cfg)


class ScaffoldSums:
    """Running means of SCAFFOLD's client changes: Σ n_i·Δy_i / n and Σ Δc_i / |S|.

    Fed one client at a time as replies arrive; :meth:`apply` is the server update of
    :func:`scaffold_server_update`.

    With a robust ``aggregator`` the changes are kept and combined by its rule at the end
    (see :func:`scaffold_server_update`).

    Args:
        params: Global model x (names, shapes, dtypes of Δy).
        c_global: Server control variate c (names, shapes, dtypes of Δc).
        aggregator: A robust rule, or None (or the plain mean) for the running means.
    """

    def __init__(
        self,
        params: Mapping[str, Tensor],
        c_global: Mapping[str, Tensor],
        aggregator: AggregatorConfig | None = None,
    ) -> None:
        self.params = params
        self.c_global = c_global
        self.dy: Aggregator
        self.dc: Aggregator
        if aggregator is None or aggregator.plain:
            # Zero-based pseudo-gradients: Σ w_i·(Δy_i − 0), in the compute dtype.
            self.dy = RunningMean("scaffold_server_update (delta_y)", params, keep_dtype=False)
            self.dc = RunningMean("scaffold_server_update (delta_c)", c_global, keep_dtype=False)
        else:
            # Δc is in gradient units, not parameter units: a fixed bound clips Δy only.
            c_agg = aggregator
            if aggregator.clip_norm is not None:
                c_agg = aggregator.model_copy(update={"clip_norm": "median"})
            self.dy = Buffered(_zeros(params), _rule(aggregator))
            self.dc = Buffered(_zeros(c_global), _rule(c_agg))
        self.count = 0

    def add(self, delta_y: Mapping[str, Tensor], delta_c: Mapping[str, Tensor], w: float) -> None:
        """Adds one client's Δy_i (weight ``w``) and Δc_i (weight 1)."""
        self.dy.add(delta_y, w)
        self.dc.add(delta_c, 1.0)
        self.count += 1

    def apply(self, num_clients_total: int, lr_global: float = 1.0) -> tuple[Arrays, Arrays]:
        """``(new_params, new_c_global)`` from the clients added so far.

        Raises:
            ValueError: No clients, |S| > N, η_g ≤ 0.
        """
        s = self.count
        if s == 0:
            raise ValueError("scaffold_server_update: no client updates")
        if num_clients_total < s:
            raise ValueError(
                f"scaffold_server_update: num_clients_total={num_clients_total} is below the"
                f" {s} clients that replied"
            )
        if not (math.isfinite(lr_global) and lr_global > 0):
            raise ValueError(f"scaffold_server_update: lr_global={lr_global} must be > 0")
        dx, dc = self.dy.result(), self.dc.result()
        new_x = {
            n: _add(p, lr_global * _get(dx[n], p, dx[n].dtype)) for n, p in self.params.items()
        }
        frac = s / num_clients_total
        new_c = {n: _add(c, frac * _get(dc[n], c, dc[n].dtype)) for n, c in self.c_global.items()}
        return new_x, new_c


def scaffold_client_control(
    c_local: Mapping[str, Tensor],
    c_global: Mapping[str, Tensor],
    params_global: Mapping[str, Tensor],
    params_local: Mapping[str, Tensor],
    steps: int,
    lr: float,
) -> dict[str, Tensor]:
    """SCAFFOLD client control variate, option II (Karimireddy et al. 2020, eq. (4); Alg. 1 l. 12).

        c_i⁺ = c_i − c + (x − y_i) / (K·η_l)

    Args:
        c_local: Client control variate c_i.
        c_global: Server control variate c received this round.
        params_global: Global model x received this round.
        params_local: Local model y_i after K local steps.
        steps: K, the number of local SGD steps taken.
        lr: η_l, the local learning rate.

    Returns:
        c_i⁺, each tensor in ``c_local``'s dtype (computed in float32 or float64).

    Raises:
        ValueError: K < 1, η_l ≤ 0, or mismatched names/shapes.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"scaffold_client_control: steps={steps!r} must be an integer >= 1")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"scaffold_client_control: lr={lr} must be > 0")
    check_keys(c_local, c_global, "scaffold_client_control: c_global vs c_local")
    check_keys(c_local, params_global, "scaffold_client_control: params_global vs c_local")
    check_keys(c_local, params_local, "scaffold_client_control: params_local vs c_local")
    scale = 1.0 / (steps * lr)
    out: dict[str, Tensor] = {}
    for name, ci in c_local.items():
        cd = compute_dtype(name, ci)
        for what, src in (("c_global", c_global), ("x", params_global), ("y", params_local)):
            check_shape(ci, src[name], f"scaffold_client_control: {what} '{name}'")
        x, y = _get(params_global[name], ci, cd), _get(params_local[name], ci, cd)
        new = ci.to(cd) - _get(c_global[name], ci, cd) + (x - y) * scale
        out[name] = new.to(ci.dtype)
    return out
