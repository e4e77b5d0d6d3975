"""Robust aggregation: how client updates become one pseudo-gradient, when some may be poisoned.

The server step of the FedAvg family is "aggregate the client updates into Δ, then let the
server optimizer apply Δ" (:mod:`fedfm.core.optim`). The functions here replace the first
half; any server optimizer then applies their Δ. Every function is pure over named tensors.

Update rules (θ the global parameters, θ_k client k's, n clients, weights w_k = num_examples):
    * update           u_k = θ_k − θ
    * weight cap       w_k ← min(w_k, T), T chosen so that max_k w_k / Σ_j w_j = ``max_share``
                       (ours; a client claiming a huge ``num_examples`` gets at most that share)
    * norm clipping    u_k ← u_k · min(1, C / ‖u_k‖₂), ‖·‖₂ over all of a client's tensors, with
                       C = ``clip_norm`` (fixed, Sun et al. 2019) or C = ``clip_scale`` × the
                       median of this round's ‖u_k‖₂ (``clip_norm: median``, as FLAME bounds
                       updates by their median norm, Nguyen et al. 2022)
    * mean             Δ = Σ_k w_k u_k / Σ_k w_k                          (FedAvg)
    * median           Δ_i = median_k u_{k,i}, per coordinate i           (Yin et al. 2018)
    * trimmed_mean     Δ_i = mean of u_{k,i} without the ⌊β·n⌋ largest and ⌊β·n⌋ smallest
                       values, per coordinate, β = ``trim_fraction``     (Yin et al. 2018)
    * krum             Δ = u_{k*}, k* = argmin_k Σ_{j ∈ N_k} ‖u_k − u_j‖², N_k the n − f − 2
                       updates nearest to u_k, f = ``byzantine``          (Blanchard et al. 2017)
    * multikrum        Δ = weighted mean of the m updates with the lowest Krum scores,
                       m = ``keep`` (default n − f)                       (Blanchard et al. 2017)

Sources:
    * Blanchard, El Mhamdi, Guerraoui, Stainer. "Machine Learning with Adversaries: Byzantine
      Tolerant Gradient Descent", NeurIPS 2017 (Krum, Multi-Krum).
    * Yin, Chen, Ramchandran, Bartlett. "Byzantine-Robust Distributed Learning: Towards Optimal
      Statistical Rates", ICML 2018 (coordinate-wise median and trimmed mean).
    * Sun, Kairouz, Suresh, McMahan. "Can You Really Backdoor Federated Learning?", 2019
      (arXiv:1911.07963; norm bounding of client updates).
    * Nguyen et al. "FLAME: Taming Backdoors in Federated Learning", USENIX Security 2022
      (clipping to the median update norm).

Flower's NDArray aggregation functions (``flwr.server.strategy.aggregate``, flwr 1.42) are
reused where their behaviour is the rule above: ``aggregate`` (weighted mean),
``aggregate_median`` (``np.median`` per coordinate: the mean of the two middle values for an
even n), ``aggregate_trimmed_avg`` (cuts ``int(β·n)`` values from each end, scipy's
``trim_mean``) and ``aggregate_krum`` (Krum scores over the n − f − 2 nearest squared
distances; with ``to_keep`` > 0 the example-weighted mean of the best ``to_keep``, which is
Multi-Krum). The Message-level strategies of ``flwr.serverapp.strategy`` (FedMedian,
FedTrimmedAvg, MultiKrum) wrap the same arithmetic around Flower replies, so they do not fit
functions over named tensors. Clipping and the weight cap are not in Flower and are here.

Choices, marked where the sources differ:
    * Rules see updates u_k, not parameters θ_k (Flower aggregates parameters): for median,
      trimmed mean and Krum the two are the same up to the shift by θ; clipping needs u_k.
    * median, trimmed mean and Krum ignore the weights, as in the papers and in Flower; the
      mean and Multi-Krum's average use the (capped) example counts, as Flower's Multi-Krum
      does (Blanchard et al. average uniformly).
    * With fewer than 2f + 3 updates Krum loses its guarantee; it still runs, scoring over
      max(1, n − f − 2) neighbours as Flower does, rather than stop the round.
    * Arithmetic runs in float64 (NumPy, through Flower's functions), so 1e30-sized poisoned
      updates neither overflow the distances nor the norms; Δ is returned in each
      parameter's compute dtype (float32, or float64 for float64 parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from fedfm.registry import Registry

Updates = Sequence[Mapping[str, Tensor]]


class AggregatorConfig(BaseModel):
    """How client updates are combined (``algo.aggregator``); the default is plain FedAvg.

    Attributes:
        name: The rule (:data:`AGGREGATORS`).
        clip_norm: Bound C on each client's update norm: a number, ``"median"`` (adaptive:
            ``clip_scale`` × this round's median norm), or None (no clipping).
        clip_scale: Multiplier of the median norm for ``clip_norm: median``.
        trim_fraction: β of ``trimmed_mean``: the fraction cut at each end.
        byzantine: f, the number of poisoned clients Krum and Multi-Krum tolerate.
        keep: m, the updates Multi-Krum averages; None means n − f.
        max_share: Largest share of the total weight one client may have (None: no cap).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field("mean", description="the rule, one of AGGREGATORS")
    clip_norm: float | Literal["median"] | None = Field(
        None, description="bound on each update's norm: a number, median, or null (off)"
    )
    clip_scale: float = Field(1.0, gt=0, description="clip_norm=median: bound = this × median")
    trim_fraction: float = Field(
        0.1, ge=0, lt=0.5, description="trimmed_mean: fraction cut at each end"
    )
    byzantine: int = Field(1, ge=0, description="krum/multikrum: poisoned clients tolerated")
    keep: int | None = Field(None, ge=1, description="multikrum: updates averaged (null: n − f)")
    max_share: float | None = Field(
        None, gt=0, le=1, description="largest share of the total weight of one client"
    )

    @field_validator("name")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        AGGREGATORS.get(v)  # UnknownNameError names algo.aggregator.name and the choices
        return v

    @model_validator(mode="after")
    def _positive_bound(self) -> AggregatorConfig:
        if isinstance(self.clip_norm, float) and self.clip_norm <= 0:
            raise ValueError("clip_norm must be > 0, 'median' or null")
        return self

    @property
    def plain(self) -> bool:
        """True for the weighted mean without clipping or cap (FedAvg's own aggregation)."""
        return self.name == "mean" and self.clip_norm is None and self.max_share is None


Rule = Callable[[list[list[np.ndarray]], list[float], AggregatorConfig], list[np.ndarray]]

AGGREGATORS: Registry[Rule] = Registry("robust aggregator", "algo.aggregator.name")


# ----------------------------------------------------------------------------- rules


@AGGREGATORS.register("mean", help="weighted mean of the updates (FedAvg)")
def mean_rule(
    us: list[list[np.ndarray]], ws: list[float], cfg: AggregatorConfig
) -> list[np.ndarray]:
    """Σ w_k u_k / Σ w_k (Flower's ``aggregate``)."""
    from flwr.server.strategy.aggregate import aggregate

    return aggregate(list(zip(us, ws, strict=True)))  # type: ignore[arg-type]


@AGGREGATORS.register("median", help="coordinate-wise median (Yin et al. 2018)")
def median_rule(
    us: list[list[np.ndarray]], ws: list[float], cfg: AggregatorConfig
) -> list[np.ndarray]:
    """Coordinate-wise median of the updates (Flower's ``aggregate_median``)."""
    from flwr.server.strategy.aggregate import aggregate_median

    return aggregate_median([(u, 1) for u in us])


@AGGREGATORS.register(
    "trimmed_mean", help="coordinate-wise mean without the β largest and smallest (Yin et al. 2018)"
)
def trimmed_mean_rule(
    us: list[list[np.ndarray]], ws: list[float], cfg: AggregatorConfig
) -> list[np.ndarray]:
    """Coordinate-wise β-trimmed mean (Flower's ``aggregate_trimmed_avg``)."""
    from flwr.server.strategy.aggregate import aggregate_trimmed_avg

    return aggregate_trimmed_avg([(u, 1) for u in us], cfg.trim_fraction)


@AGGREGATORS.register(
    "krum", help="the update nearest its n−f−2 neighbours (Blanchard et al. 2017)"
)
def krum_rule(
    us: list[list[np.ndarray]], ws: list[float], cfg: AggregatorConfig
) -> list[np.ndarray]:
    """Krum: the single update with the lowest score (Flower's ``aggregate_krum``)."""
    from flwr.server.strategy.aggregate import aggregate_krum

    return aggregate_krum([(u, 1) for u in us], cfg.byzantine, to_keep=0)


@AGGREGATORS.register("multikrum", help="weighted mean of the m best Krum scores (Blanchard 2017)")
def multikrum_rule(
    us: list[list[np.ndarray]], ws: list[float], cfg: AggregatorConfig
) -> list[np.ndarray]:
    """Multi-Krum: the weighted mean of the ``keep`` lowest-scored updates."""
    from flwr.server.strategy.aggregate import aggregate_krum

    keep = min(len(us), cfg.keep or max(1, len(us) - cfg.byzantine))
    return aggregate_krum(list(zip(us, ws, strict=True)), cfg.byzantine, to_keep=keep)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- pieces


def cap_weights(weights: Sequence[float], max_share: float) -> list[float]:
    """Caps weights so that none exceeds ``max_share`` of their sum (water-filling).

    The k largest weights are lowered to a common T with T / (k·T + rest) = ``max_share``,
    for the smallest k that keeps T at least the largest weight left uncapped. When even
    equal weights exceed the share (``max_share`` < 1/n), all weights become equal.

    Args:
        weights: Non-negative weights with a positive sum.
        max_share: The largest share, in (0, 1].

    Returns:
        The capped weights, in the input's order.
    """
    ws = [float(w) for w in weights]
    total = sum(ws)
    n = len(ws)
    if n == 0 or max(ws) <= max_share * total:
        return ws
    if max_share * n <= 1:
        return [1.0] * n
    desc = sorted(ws, reverse=True)
    for k in range(1, n):
        rest = sum(desc[k:])
        cap = max_share * rest / (1 - k * max_share)
        if desc[k] <= cap:
            return [min(w, cap) for w in ws]
    return [1.0] * n  # unreachable for max_share > 1/n; kept for safety


def update_norms(updates: Updates) -> list[float]:
    """‖u_k‖₂ over all tensors of each update, in float64."""
    out = []
    for u in updates:
        sq = sum(float(t.detach().to(torch.float64).pow(2).sum()) for t in u.values())
        out.append(math.sqrt(sq))
    return out


def clip_bound(norms: Sequence[float], cfg: AggregatorConfig) -> float | None:
    """The norm bound C of this round given the update norms, or None without clipping."""
    if cfg.clip_norm is None:
        return None
    if cfg.clip_norm == "median":
        return cfg.clip_scale * float(np.median(norms))
    return float(cfg.clip_norm)


def clip_updates(
    updates: Updates, bound: float, norms: Sequence[float] | None = None
) -> list[dict[str, Tensor]]:
    """Scales each update down to norm ``bound`` when it is longer (float64 results).

    Args:
        updates: The updates u_k.
        bound: C.
        norms: ‖u_k‖₂ when already computed (:func:`update_norms`).
    """
    out = []
    norms = update_norms(updates) if norms is None else norms
    for u, norm in zip(updates, norms, strict=True):
        scale = min(1.0, bound / norm) if norm > 0 else 1.0
        out.append({k: t.detach().to(torch.float64) * scale for k, t in u.items()})
    return out


def aggregate_updates(
    updates: Updates, weights: Sequence[float], cfg: AggregatorConfig
) -> dict[str, Tensor]:
    """Combines updates u_k into Δ by ``cfg``: cap weights, clip norms, then the rule.

    Args:
        updates: One ``name -> tensor`` update per client, same names and shapes.
        weights: One non-negative weight per update (its example count).
        cfg: The aggregator.

    Returns:
        Δ per name, float64 on the CPU.

    Raises:
        ValueError: No updates, or names that differ between updates.
    """
    if len(updates) == 0:
        raise ValueError("aggregate_updates: no updates to aggregate")
    names = list(updates[0])
    for k, u in enumerate(updates):
        if set(u) != set(names):
            raise ValueError(f"aggregate_updates: update {k} has other tensor names than update 0")
    ws = [float(w) for w in weights]
    if cfg.max_share is not None:
        ws = cap_weights(ws, cfg.max_share)
    norms = update_norms(updates) if cfg.clip_norm is not None else []
    bound = clip_bound(norms, cfg)
    us = clip_updates(updates, bound, norms) if bound is not None else updates
    arrays = [[u[n].detach().to("cpu", torch.float64).numpy() for n in names] for u in us]
    out = AGGREGATORS.get(cfg.name)(arrays, ws, cfg)
    return {
        n: torch.from_numpy(np.asarray(a, dtype=np.float64))
        for n, a in zip(names, out, strict=True)
    }


def robust_pseudo_gradient(
    params: Mapping[str, Tensor],
    client_params: Updates,
    weights: Sequence[float],
    cfg: AggregatorConfig,
) -> dict[str, Tensor]:
    """Δ from client parameters θ_k: :func:`aggregate_updates` of u_k = θ_k − θ.

    Args:
        params: Current global parameters θ (floating tensors).
        client_params: θ_k per client, same names and shapes as ``params``.
        weights: Example counts n_k.
        cfg: The aggregator.

    Returns:
        Δ per name in the parameter's compute dtype (float32, float64 for float64) and device.
    """
    updates = [
        {
            n: u[n].detach().to(torch.float64) - p.detach().to(torch.float64)
            for n, p in params.items()
        }
        for u in client_params
    ]
    delta = aggregate_updates(updates, weights, cfg)
    return {
        n: delta[n].to(device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
        for n, p in params.items()
    }
