"""Robust aggregation rules on numbers checked by hand, and their composition with the server."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fedfm.algorithms.fedavg import FedAvgConfig, ScaffoldConfig
from fedfm.config import validate_section
from fedfm.core.optim import ServerOptConfig, ServerOptimizer, scaffold_server_update
from fedfm.core.robust import (
    AGGREGATORS,
    AggregatorConfig,
    aggregate_updates,
    cap_weights,
    clip_updates,
    robust_pseudo_gradient,
    update_norms,
)
from fedfm.errors import ConfigError


def _u(*vals: float) -> dict[str, torch.Tensor]:
    """A one-tensor update ``{"w": [vals...]}``."""
    return {"w": torch.tensor(vals, dtype=torch.float32)}


def _agg(updates, weights=None, **cfg) -> list[float]:
    ws = weights or [1.0] * len(updates)
    return aggregate_updates(updates, ws, AggregatorConfig(**cfg))["w"].tolist()


# ----------------------------------------------------------------------------- pieces


def test_cap_weights_water_fills_to_the_share():
    # Capping 7 at T: T / (T + 3) = 0.4 gives T = 2, and 1 <= 2 stays uncapped.
    assert cap_weights([1, 1, 1, 7], 0.4) == pytest.approx([1, 1, 1, 2])
    # Two large weights: T / (2T + 2) = 0.3 gives T = 1.5; both 5 and 9 are lowered.
    assert cap_weights([9, 1, 5, 1], 0.3) == pytest.approx([1.5, 1, 1.5, 1])
    assert cap_weights([2, 3, 5], 0.5) == [2, 3, 5]  # within the cap: unchanged
    assert cap_weights([1, 100], 0.4) == [1.0, 1.0]  # 0.4 < 1/2: equal weights are closest


def test_norms_and_clipping():
    ups = [_u(3, 4), _u(0.3, 0.4), {"a": torch.tensor([1.0]), "b": torch.tensor([[2.0, 2.0]])}]
    assert update_norms(ups) == pytest.approx([5, 0.5, 3])  # over all tensors of a client
    clipped = clip_updates(ups, 1.0)
    assert clipped[0]["w"].tolist() == pytest.approx([0.6, 0.8])
    assert clipped[1]["w"].tolist() == pytest.approx([0.3, 0.4])  # short: unchanged
    assert clipped[2]["b"].flatten().tolist() == pytest.approx([2 / 3, 2 / 3])


def test_fixed_and_median_clipping_before_the_mean():
    ups = [_u(1, 0), _u(0, 2), _u(30, 40)]  # norms 1, 2, 50
    # Fixed C = 2: the third becomes (1.2, 1.6); mean of (1,0), (0,2), (1.2,1.6).
    assert _agg(ups, clip_norm=2.0) == pytest.approx([2.2 / 3, 3.6 / 3])
    # Adaptive: C = 1.5 × median(1, 2, 50) = 3: the third becomes (1.8, 2.4).
    assert _agg(ups, clip_norm="median", clip_scale=1.5) == pytest.approx([2.8 / 3, 4.4 / 3])


def test_huge_updates_do_not_overflow_norms_or_distances():
    ups = [_u(1, 1), _u(1, 2), _u(3e38, -3e38)]  # the last one's ‖u‖² overflows float32
    assert math.isfinite(update_norms(ups)[2])
    assert _agg(ups, clip_norm="median") == pytest.approx(
        [(1 + 1 + 5**0.5 / 2**0.5) / 3, (1 + 2 - 5**0.5 / 2**0.5) / 3]
    )
    assert _agg(ups, name="krum", byzantine=0) in ([1.0, 1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------- rules


def test_weighted_mean():
    assert _agg([_u(1, 2), _u(3, 6)], [1, 3]) == pytest.approx([2.5, 5])


def test_weight_cap_bounds_an_inflated_client():
    ups = [_u(0.0), _u(0.0), _u(0.0), _u(10.0)]
    assert _agg(ups, [1, 1, 1, 10**12]) == pytest.approx([10.0], rel=1e-9)
    # Capped to 40 %: weights (1, 1, 1, 2), so Δ = 10·2/5.
    assert _agg(ups, [1, 1, 1, 10**12], max_share=0.4) == pytest.approx([4.0])


def test_coordinate_wise_median():
    assert _agg([_u(1, 10), _u(2, -5), _u(100, 0)], name="median") == [2.0, 0.0]
    assert _agg([_u(1), _u(2), _u(3), _u(100)], name="median") == [2.5]  # even n: mid-mean
    assert _agg([_u(1), _u(2), _u(100)], [1, 1, 10**6], name="median") == [2.0]  # unweighted


def test_trimmed_mean():
    ups = [_u(1), _u(2), _u(3), _u(4), _u(100)]
    assert _agg(ups, name="trimmed_mean", trim_fraction=0.2) == [3.0]  # cuts 1 at each end
    assert _agg(ups, name="trimmed_mean", trim_fraction=0.1) == [22.0]  # ⌊0.5⌋ = 0: the mean
    # Per coordinate: each column is trimmed on its own.
    cols = [_u(1, 50), _u(2, 40), _u(3, 30), _u(4, 20), _u(100, 10)]
    assert _agg(cols, name="trimmed_mean", trim_fraction=0.2) == [3.0, 30.0]


def test_krum_and_multikrum():
    ups = [_u(0), _u(1), _u(3), _u(100)]
    # f = 0: score = squared distances to the n − 2 = 2 nearest:
    # 0 → 1 + 9 = 10, 1 → 1 + 4 = 5, 3 → 4 + 9 = 13, 100 → 97² + 99² = 19210.
    assert _agg(ups, name="krum", byzantine=0) == [1.0]
    # Multi-Krum keeps the 2 best (1 and 0) and averages them by weight: (1·3 + 0·1) / 4.
    assert _agg(ups, [1, 3, 1, 1], name="multikrum", byzantine=0, keep=2) == [0.75]
    # Default m = n − f = 3 with f = 1: n − f − 2 = 1 nearest; scores 1, 1, 4, 9409.
    assert _agg(ups, name="multikrum", byzantine=1) == pytest.approx([4 / 3])


def test_every_rule_is_registered_and_the_config_checks_its_options():
    assert list(AGGREGATORS) == ["krum", "mean", "median", "multikrum", "trimmed_mean"]
    for bad in (
        {"name": "geomed"},
        {"clip_norm": -1.0},
        {"clip_norm": "mean"},
        {"trim_fraction": 0.5},
        {"max_share": 0},
        {"byzantine": -1},
    ):
        with pytest.raises(ConfigError, match=r"algo\.aggregator"):
            validate_section(AggregatorConfig, bad, "algo.aggregator")


# ----------------------------------------------------------------------------- composition


def test_pseudo_gradient_is_taken_against_the_global_parameters():
    params = {"w": torch.tensor([1.0, 1.0])}
    clients = [_u(2, 1), _u(1, 3), _u(101, -99)]  # updates (1,0), (0,2), (100,-100)
    delta = robust_pseudo_gradient(params, clients, [1, 1, 1], AggregatorConfig(name="median"))
    assert delta["w"].tolist() == [1.0, 0.0] and delta["w"].dtype == torch.float32


def test_robust_delta_then_any_server_optimizer():
    agg = AggregatorConfig(name="median")
    opt = ServerOptimizer(ServerOptConfig(name="fedavgm", lr=1.0, momentum=0.9), agg)
    theta = {"w": torch.tensor([0.0])}
    theta = opt.step(theta, [_u(1), _u(2), _u(100)], [1, 1, 1])  # Δ = 2, m = 2
    assert theta["w"].tolist() == [2.0]
    theta = opt.step(theta, [_u(3), _u(4), _u(102)], [1, 1, 1])  # Δ = 2, m = 0.9·2 + 2
    assert theta["w"].tolist() == pytest.approx([5.8])


def test_the_default_aggregator_is_plain_fedavg():
    params = {"w": torch.tensor([0.5, -1.0])}
    ups = [_u(1, 2), _u(3, -4)]
    a = ServerOptimizer(ServerOptConfig()).step(params, ups, [2, 6])
    b = ServerOptimizer(ServerOptConfig(), AggregatorConfig()).step(params, ups, [2, 6])
    assert torch.equal(a["w"], b["w"]) and a["w"].tolist() == pytest.approx([2.5, -2.5])
    assert FedAvgConfig().aggregator.plain and ScaffoldConfig().aggregator.plain


def test_a_step_that_would_make_the_model_non_finite_is_skipped(caplog):
    opt = ServerOptimizer()
    params = {"w": torch.tensor([-3e38, 1.0])}
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        new = opt.step(params, [_u(3e38, 1.0), _u(3e38, 1.0)], [1, 1])  # Δ overflows
    assert torch.equal(new["w"], params["w"]) and "server step skipped" in caplog.text


def test_scaffold_with_a_robust_rule():
    x = {"w": torch.tensor([0.0])}
    c = {"w": torch.tensor([0.0])}
    dy = [_u(1), _u(2), _u(100)]
    dc = [_u(1), _u(1), _u(1000)]
    agg = AggregatorConfig(name="median")
    new_x, new_c = scaffold_server_update(x, c, dy, dc, [1, 1, 1], 3, 1.0, agg)
    assert new_x["w"].tolist() == [2.0] and new_c["w"].tolist() == [1.0]  # (3/3)·median
    # A fixed bound clips Δy; Δc is clipped to its median norm (1) instead.
    clip = AggregatorConfig(clip_norm=2.0)
    new_x, new_c = scaffold_server_update(x, c, dy, dc, [1, 1, 1], 3, 1.0, clip)
    assert new_x["w"].tolist() == pytest.approx([5 / 3]) and new_c["w"].tolist() == [1.0]
