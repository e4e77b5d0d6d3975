"""Partitioners over flwr-datasets: coverage, determinism, skew and error messages."""

from __future__ import annotations

import itertools

import datasets
import numpy as np
import pytest

from fedfm.data.partition import (
    PARTITIONERS,
    PartitionConfig,
    make_config,
    partition,
    partition_stats,
    quantity_sizes,
)
from fedfm.errors import ConfigError, UnknownNameError

N_CLASSES = 6


@pytest.fixture(scope="module")
def labelled() -> datasets.Dataset:
    """1,200 rows, 6 balanced classes sorted by label (the worst case for naive sharding),
    ids 1000.. so that ids differ from positions, and a 3-valued ``site`` column."""
    n = 1200
    labels = np.repeat(np.arange(N_CLASSES), n // N_CLASSES)
    feats = datasets.Features(
        {
            "id": datasets.Value("int64"),
            "label": datasets.ClassLabel(num_classes=N_CLASSES),
            "site": datasets.Value("string"),
            "y": datasets.Value("float32"),
            "pair": datasets.List(datasets.Value("int64"), length=2),
        }
    )
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict(
        {
            "id": np.arange(1000, 1000 + n),
            "label": labels,
            "site": [["north", "east", "west"][i % 3] for i in range(n)],
            "y": rng.normal(size=n).astype(np.float32),
            "pair": [[i % 2, 0] for i in range(n)],
        },
        features=feats,
    )


def _ids(parts: list[datasets.Dataset]) -> list[list[int]]:
    return [list(p["id"]) for p in parts]


def _skew(parts: list[datasets.Dataset], weighted: bool = False) -> float:
    """Mean total-variation distance between client label distributions and the global one
    (weighted by client size if asked, so that tiny clients' sampling noise counts little)."""
    hist = np.asarray(partition_stats(parts, "label")["label_hist"], dtype=float)
    glob = hist.sum(0) / hist.sum()
    local = hist / hist.sum(1, keepdims=True)
    tv = 0.5 * np.abs(local - glob).sum(1)
    return float(np.average(tv, weights=hist.sum(1) if weighted else None))


CONFIGS = {
    "iid": {"scheme": "iid", "num_clients": 7},
    "dirichlet": {"scheme": "dirichlet", "num_clients": 5, "alpha": 0.5},
    "pathological": {"scheme": "pathological", "num_clients": 6, "classes_per_client": 2},
    "natural": {"scheme": "natural", "num_clients": 3, "by": "site"},
    "quantity": {"scheme": "quantity", "num_clients": 8, "alpha": 1.0},
}


def test_every_scheme_is_configured_here() -> None:
    assert set(PARTITIONERS) == set(CONFIGS)


@pytest.mark.parametrize("scheme", sorted(CONFIGS))
def test_scheme_covers_every_row_once_in_order(labelled, scheme: str) -> None:
    cfg = make_config(CONFIGS[scheme], seed=1)
    parts = partition(labelled, cfg)
    assert len(parts) == cfg.num_clients
    ids = _ids(parts)
    flat = [i for p in ids for i in p]
    assert sorted(flat) == list(range(1000, 2200))  # every row exactly once
    assert all(p == sorted(p) for p in ids)  # each client keeps the source order
    assert all(len(p) >= 1 for p in ids)
    again = partition(labelled, make_config(CONFIGS[scheme], seed=1))
    assert _ids(again) == ids  # deterministic for a seed
    if scheme in ("iid", "dirichlet", "quantity"):
        other = partition(labelled, make_config(CONFIGS[scheme], seed=2))
        assert _ids(other) != ids


def test_iid_is_balanced_despite_sorted_labels(labelled) -> None:
    parts = partition(labelled, make_config(scheme="iid", num_clients=4))
    stats = partition_stats(parts, "label")
    assert stats["sizes"] == [300, 300, 300, 300]
    assert _skew(parts) < 0.1  # sharding the sorted rows without shuffling would give ~0.67


def test_dirichlet_small_alpha_is_more_skewed(labelled) -> None:
    skews = {}
    for alpha in (0.1, 100.0):
        values = [
            _skew(partition(labelled, make_config(scheme="dirichlet", alpha=alpha, seed=s)))
            for s in range(3)
        ]
        skews[alpha] = float(np.mean(values))
    assert skews[0.1] > 0.4 > 0.1 > skews[100.0]


def test_dirichlet_respects_min_size(labelled) -> None:
    cfg = make_config(scheme="dirichlet", num_clients=10, alpha=0.3, min_size=20, seed=4)
    assert min(partition_stats(partition(labelled, cfg), None)["sizes"]) >= 20


def test_pathological_gives_k_labels_per_client(labelled) -> None:
    for k in (1, 2, 3):
        cfg = make_config(scheme="pathological", num_clients=6, classes_per_client=k)
        hist = np.asarray(partition_stats(partition(labelled, cfg), "label")["label_hist"])
        assert ((hist > 0).sum(1) == k).all()
        # deterministic assignment: client i holds classes i..i+k-1 (mod 6)
        assert [set(np.flatnonzero(h)) for h in hist] == [
            {(i + j) % N_CLASSES for j in range(k)} for i in range(6)
        ]


def test_natural_partition_by_domain_column(labelled) -> None:
    parts = partition(labelled, make_config(scheme="natural", by="site", num_clients=3))
    # client i holds the i-th value in sorted order
    assert [set(p["site"]) for p in parts] == [{"east"}, {"north"}, {"west"}]
    assert [len(p) for p in parts] == [400, 400, 400]


def test_quantity_sizes_are_skewed_and_sum_to_n(labelled) -> None:
    sizes = quantity_sizes(1200, 8, alpha=0.2, min_size=5, seed=0)
    assert sum(sizes) == 1200 and min(sizes) >= 5
    spread = {
        a: np.mean([np.std(quantity_sizes(1200, 8, a, 5, s)) for s in range(5)])
        for a in (0.2, 50.0)
    }
    assert spread[0.2] > 3 * spread[50.0]
    parts = partition(labelled, make_config(scheme="quantity", num_clients=8, alpha=0.2))
    assert partition_stats(parts, None)["sizes"] == quantity_sizes(1200, 8, 0.2, 2, 0)
    assert _skew(parts, weighted=True) < 0.1  # sizes vary, labels stay mixed


def test_bins_turn_a_regression_target_into_label_skew(labelled) -> None:
    cfg = make_config(scheme="pathological", by="y", bins=4, num_clients=4, classes_per_client=1)
    parts = partition(labelled, cfg)
    ranges = sorted((min(p["y"]), max(p["y"])) for p in parts)
    # one quantile bin per client: value ranges do not overlap
    assert all(hi < lo for (_, hi), (lo, _) in itertools.pairwise(ranges))
    with pytest.raises(ConfigError) as err:
        partition(labelled, make_config(scheme="dirichlet", by="y", num_clients=4))
    assert err.value.field == "partition.bins"


def test_stats_match_hand_counts() -> None:
    ds = datasets.Dataset.from_dict(
        {"id": [0, 1, 2, 3, 4, 5], "label": [0, 0, 1, 2, 1, 0], "g": list("aabbab")}
    )
    parts = partition(ds, make_config(scheme="natural", by="g", num_clients=2))
    stats = partition_stats(parts, "label")
    # g == "a": rows 0, 1, 4 -> labels 0, 0, 1;  g == "b": rows 2, 3, 5 -> labels 1, 2, 0
    assert stats == {
        "num_clients": 2,
        "sizes": [3, 3],
        "label_hist": [[2, 1, 0], [1, 1, 1]],
        "labels": [0, 1, 2],
    }
    assert partition_stats(parts, None)["label_hist"] is None


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"num_clients": 0}, "partition.num_clients"),
        ({"alpha": 0.0}, "partition.alpha"),
        ({"scheme": "zipf"}, "partition.scheme"),
        ({"bins": 1}, "partition.bins"),
        ({"colour": "red"}, "partition.colour"),
    ],
)
def test_invalid_config_values(values: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_config(values)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("values", "field", "words"),
    [
        ({"scheme": "dirichlet", "by": "colour"}, "partition.by", "no column 'colour'"),
        ({"scheme": "natural", "by": "pair", "num_clients": 2}, "partition.by", "not a scalar"),
        ({"scheme": "natural", "by": "site", "num_clients": 4}, "partition.num_clients", "3"),
        ({"scheme": "iid", "num_clients": 5000}, "partition.num_clients", "1200 rows"),
        (
            {"scheme": "dirichlet", "num_clients": 300, "min_size": 5},
            "partition.min_size",
            "1200 rows",
        ),
        (
            {"scheme": "dirichlet", "num_clients": 100, "alpha": 0.01, "min_size": 8},
            "partition.alpha",
            "raise alpha",
        ),
        (
            {"scheme": "pathological", "num_clients": 2, "classes_per_client": 2},
            "partition.classes_per_client",
            "cover only 3 of 6",
        ),
        (
            {"scheme": "pathological", "classes_per_client": 7},
            "partition.classes_per_client",
            "7 > 6",
        ),
    ],
)
def test_impossible_requests_raise_config_error(labelled, values, field, words) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        partition(labelled, make_config(values))
    assert err.value.field == field


def test_unknown_scheme_from_registry() -> None:
    cfg = PartitionConfig.model_construct(scheme="zipf", num_clients=2)
    with pytest.raises(UnknownNameError, match="iid"):
        partition(datasets.Dataset.from_dict({"id": [0, 1]}), cfg)
