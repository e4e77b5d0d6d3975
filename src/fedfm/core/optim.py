"""Aggregation and server optimizers as pure functions over named tensors.

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
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from fedfm.core.messages import Arrays
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


# ----------------------------------------------------------------------------- checks


def _names(keys: Sequence[str] | set[str], limit: int = 5) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


def _check_keys(expected: Mapping[str, Tensor], got: Mapping[str, Tensor], what: str) -> None:
    """Refuses ``got`` unless it has exactly the keys of ``expected``."""
    missing = set(expected) - set(got)
    extra = set(got) - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"unexpected {_names(extra)}")
        raise ValueError(f"{what}: tensor names do not match ({'; '.join(parts)})")


def _check_shape(ref: Tensor, t: Tensor, what: str) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.shape != ref.shape:
        raise ValueError(f"{what}: shape {tuple(t.shape)} does not match {tuple(ref.shape)}")


def _check_weights(weights: Sequence[float], count: int, what: str) -> list[float]:
    """Returns the weights as floats after refusing bad ones."""
    ws = [float(w) for w in weights]
    if len(ws) != count:
        raise ValueError(f"{what}: {len(ws)} weights for {count} updates")
    for i, w in enumerate(ws):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{what}: weight {i} is {w}; weights must be finite and >= 0")
    if sum(ws) <= 0:
        raise ValueError(f"{what}: total weight is {sum(ws)}; it must be positive")
    return ws


def _compute_dtype(name: str, t: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 tensors, float64 for float64 ones."""
    if not t.is_floating_point():
        raise ValueError(
            f"'{name}' has dtype {t.dtype}; server optimizers need floating tensors"
            " (average integer buffers with weighted_mean)"
        )
    return torch.promote_types(t.dtype, torch.float32)


# ----------------------------------------------------------------------------- aggregation


def weighted_mean(
    updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """Example-weighted mean Σ_k w_k·u_k / Σ_k w_k of named tensors.

    Floating tensors are averaged in float32 (float64 for float64) and cast back to the dtype of
    the first update; integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged in
    float64 and rounded.

    Args:
        updates: One ``name -> tensor`` mapping per client, all with the same names and shapes.
        weights: One non-negative weight per update (usually its example count n_k).

    Returns:
        A new ``name -> tensor`` dict on the device of the first update.

    Raises:
        ValueError: No updates, bad weights (negative, non-finite, total not positive, wrong
            count), or names/shapes that differ between updates.
    """
    if len(updates) == 0:
        raise ValueError("weighted_mean: no updates to aggregate")
    ws = _check_weights(weights, len(updates), "weighted_mean")
    total = sum(ws)
    first = updates[0]
    for k, u in enumerate(updates[1:], start=1):
        _check_keys(first, u, f"weighted_mean: update {k} vs update 0")
    out: dict[str, Tensor] = {}
    for name, ref in first.items():
        cd = (
            torch.promote_types(ref.dtype, torch.float32)
            if ref.is_floating_point()
            else (torch.float64)
        )
        acc = torch.zeros(ref.shape, dtype=cd, device=ref.device)
        for k, (u, w) in enumerate(zip(updates, ws, strict=True)):
            t = u[name]
            _check_shape(ref, t, f"weighted_mean: update {k} '{name}'")
            acc += t.to(device=ref.device, dtype=cd) * (w / total)
        if not ref.is_floating_point():
            acc = acc.round()
        out[name] = acc.to(ref.dtype)
    return out


def pseudo_gradient(
    params: Mapping[str, Tensor],
    updates: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
) -> dict[str, Tensor]:
    """Pseudo-gradient Δ = Σ_k (n_k/n)(θ_k − θ) (Reddi et al. 2021, Algorithm 1).

    Differences are taken before averaging, which keeps small changes of large float32
    weights exact.

    Args:
        params: Current global parameters θ.
        updates: Client parameters θ_k after local training, same names and shapes as ``params``.
        weights: Example counts n_k (or any non-negative weights).

    Returns:
        Δ per name, in float32 (float64 for float64 parameters) on each parameter's device.

    Raises:
        ValueError: No updates, bad weights, integer parameters, or mismatched names/shapes.
    """
    if len(updates) == 0:
        raise ValueError("pseudo_gradient: no updates to aggregate")
    ws = _check_weights(weights, len(updates), "pseudo_gradient")
    total = sum(ws)
    for k, u in enumerate(updates):
        _check_keys(params, u, f"pseudo_gradient: update {k} vs params")
    delta: dict[str, Tensor] = {}
    for name, p in params.items():
        cd = _compute_dtype(name, p)
        base = p.to(dtype=cd)
        acc = torch.zeros(p.shape, dtype=cd, device=p.device)
        for k, (u, w) in enumerate(zip(updates, ws, strict=True)):
            _check_shape(p, u[name], f"pseudo_gradient: update {k} '{name}'")
            acc += (u[name].to(device=p.device, dtype=cd) - base) * (w / total)
        delta[name] = acc
    return delta


# ----------------------------------------------------------------------------- step helpers


def _check_step_inputs(
    params: Mapping[str, Tensor],
    delta: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    optimizer: str,
) -> None:
    """Refuses a delta or a state that does not belong to ``params`` and ``optimizer``."""
    _check_keys(params, delta, f"{optimizer}: delta vs params")
    for name, p in params.items():
        _compute_dtype(name, p)
        _check_shape(p, delta[name], f"{optimizer}: delta '{name}'")
    prefixes = _STATE_PREFIXES[optimizer]
    for key, t in state.items():
        prefix, _, name = key.partition("/")
        if prefix not in prefixes or name not in params:
            allowed = ", ".join(f"'{p}/<param>'" for p in prefixes) or "no state"
            raise ValueError(f"{optimizer}: unexpected state entry '{key}' (keeps {allowed})")
        _check_shape(params[name], t, f"{optimizer}: state '{key}'")


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
    """p + step computed in step's dtype, returned as a new tensor in p's dtype."""
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
        cd = _compute_dtype(name, p)
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
        cd = _compute_dtype(name, p)
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
        cd = _compute_dtype(name, p)
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
            example-weighted mean of :func:`pseudo_gradient`.
    """

    def __init__(
        self, cfg: ServerOptConfig | None = None, aggregator: AggregatorConfig | None = None
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
            _check_weights(weights, len(updates), "robust aggregation")
            for k, u in enumerate(updates):
                _check_keys(params, u, f"robust aggregation: update {k} vs params")
            delta = robust_pseudo_gradient(params, updates, weights, self.aggregator)
        return self.apply_delta(params, delta)

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
    under client sampling.

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
    if num_clients_total < s:
        raise ValueError(
            f"scaffold_server_update: num_clients_total={num_clients_total} is below the"
            f" {s} clients that replied"
        )
    if not (math.isfinite(lr_global) and lr_global > 0):
        raise ValueError(f"scaffold_server_update: lr_global={lr_global} must be > 0")
    _check_weights(weights, s, "scaffold_server_update")
    for k in range(s):
        _check_keys(params, delta_y[k], f"scaffold_server_update: delta_y {k} vs params")
        _check_keys(c_global, delta_c[k], f"scaffold_server_update: delta_c {k} vs c_global")
    # Zero-based "pseudo-gradients": Σ w_i (Δy_i − 0) keeps the averaging in one function.
    zeros_x = {n: torch.zeros_like(p) for n, p in params.items()}
    zeros_c = {n: torch.zeros_like(c) for n, c in c_global.items()}
    if aggregator is None or aggregator.plain:
        dx = pseudo_gradient(zeros_x, delta_y, weights)
        dc = pseudo_gradient(zeros_c, delta_c, [1.0] * s)
    else:
        c_agg = aggregator
        if aggregator.clip_norm is not None:
            c_agg = aggregator.model_copy(update={"clip_norm": "median"})
        dx = robust_pseudo_gradient(zeros_x, delta_y, weights, aggregator)
        dc = robust_pseudo_gradient(zeros_c, delta_c, [1.0] * s, c_agg)
    new_x = {n: _add(p, lr_global * _get(dx[n], p, dx[n].dtype)) for n, p in params.items()}
    frac = s / num_clients_total
    new_c = {n: _add(c, frac * _get(dc[n], c, dc[n].dtype)) for n, c in c_global.items()}
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
    _check_keys(c_local, c_global, "scaffold_client_control: c_global vs c_local")
    _check_keys(c_local, params_global, "scaffold_client_control: params_global vs c_local")
    _check_keys(c_local, params_local, "scaffold_client_control: params_local vs c_local")
    scale = 1.0 / (steps * lr)
    out: dict[str, Tensor] = {}
    for name, ci in c_local.items():
        cd = _compute_dtype(name, ci)
        for what, src in (("c_global", c_global), ("x", params_global), ("y", params_local)):
            _check_shape(ci, src[name], f"scaffold_client_control: {what} '{name}'")
        x, y = _get(params_global[name], ci, cd), _get(params_local[name], ci, cd)
        new = ci.to(cd) - _get(c_global[name], ci, cd) + (x - y) * scale
        out[name] = new.to(ci.dtype)
    return out
