"""Splitting a dataset over clients with flwr-datasets' partitioners.

Schemes (registered in :data:`PARTITIONERS`):

* ``iid``: rows shuffled with ``seed``, then ``IidPartitioner`` (equal contiguous shards of the
  shuffled order; without the shuffle, a label-sorted source would not be IID).
* ``dirichlet``: label skew, ``DirichletPartitioner`` (Hsu et al. 2019, "Measuring the effects of
  non-identical data distribution"): per class, client shares ~ Dir(alpha); ``self_balancing``
  off. flwr-datasets resamples until every client has ``min_size`` rows and gives up after 11
  draws; that, and a request that cannot be met (fewer rows than ``num_clients * min_size``),
  raise :class:`ConfigError`.
* ``pathological``: ``PathologicalPartitioner`` (McMahan et al. 2017's k classes per client) with
  ``class_assignment_mode="deterministic"``: client i holds classes i, i+1, ..., i+k-1 (mod C),
  so every client has exactly k classes and, when ``num_clients + k - 1 >= C``, every class is
  used. Configurations that would leave classes (rows) unused are refused.
* ``natural``: ``NaturalIdPartitioner`` on a column (a domain, a site); client i holds the i-th
  value in sorted order; ``num_clients`` must equal the number of distinct values.
* ``quantity``: quantity skew. flwr-datasets' ``InnerDirichletPartitioner`` also skews labels,
  so sizes are drawn here as ``min_size + Multinomial(n - num_clients*min_size, Dir(alpha))``
  and given to ``SizePartitioner`` over the shuffled rows.

Every partition lists its rows in the source's order (so it is stable for a seed), and together
the partitions cover every row exactly once. ``bins`` turns a continuous column into quantile
bins before ``dirichlet``/``pathological`` (label skew for regression).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import warnings
from collections.abc import Callable
from typing import Any, Literal

import datasets
import numpy as np
import pandas as pd
import pydantic

from fedfm.data.arrow import column_array
from fedfm.errors import ConfigError
from fedfm.registry import Registry

log = logging.getLogger("fedfm.data")
FIELD = "partition"
_ROW = "__row__"
_KEY = "__key__"


class PartitionConfig(pydantic.BaseModel):
    """How a dataset is split over clients.

    Attributes:
        scheme: ``iid``, ``dirichlet``, ``pathological``, ``natural`` or ``quantity``.
        num_clients: Number of partitions.
        alpha: Dirichlet concentration (``dirichlet``, ``quantity``); small = skewed.
        by: Column that ``dirichlet``, ``pathological`` and ``natural`` split by.
        classes_per_client: Classes per client (``pathological``).
        min_size: Smallest partition allowed (``dirichlet``, ``quantity``).
        bins: Quantile bins for a continuous ``by`` column (``dirichlet``, ``pathological``).
        seed: Seed of every random draw.
    """

    model_config = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)

    scheme: Literal["iid", "dirichlet", "pathological", "natural", "quantity"] = "iid"
    num_clients: int = pydantic.Field(10, ge=1)
    alpha: float = pydantic.Field(0.5, gt=0)
    by: str = "label"
    classes_per_client: int = pydantic.Field(2, ge=1)
    min_size: int = pydantic.Field(2, ge=0)
    bins: int | None = pydantic.Field(None, ge=2)
    seed: int = 0


def make_config(values: dict[str, Any] | None = None, **kw: Any) -> PartitionConfig:
    """Validates a partition config, turning pydantic's report into one :class:`ConfigError`."""
    try:
        return PartitionConfig(**{**(values or {}), **kw})
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{FIELD}.{loc}", err["msg"]) from None


Scheme = Callable[[datasets.Dataset, PartitionConfig], list[list[int]]]
PARTITIONERS: Registry[Scheme] = Registry("partitioner", "partition.scheme")


def partition(ds: datasets.Dataset, cfg: PartitionConfig) -> list[datasets.Dataset]:
    """Splits ``ds`` over ``cfg.num_clients`` clients.

    Returns:
        One dataset per client; each keeps ``ds``'s row order; together they hold every row
        of ``ds`` exactly once.

    Raises:
        ConfigError: Unknown scheme, missing ``by`` column, impossible request.
    """
    scheme = PARTITIONERS.get(cfg.scheme)
    if cfg.num_clients > len(ds):
        raise ConfigError(
            f"{FIELD}.num_clients", f"{cfg.num_clients} clients for only {len(ds)} rows"
        )
    rows = scheme(ds, cfg)
    if len(rows) != cfg.num_clients:  # a scheme bug, not a user error
        raise RuntimeError(f"{cfg.scheme} made {len(rows)} partitions, not {cfg.num_clients}")
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    if len(flat) != len(ds) or len(np.unique(flat)) != len(ds):
        raise RuntimeError(f"{cfg.scheme} did not assign every row exactly once")
    return [_select(ds, np.sort(np.asarray(r, dtype=np.int64))) for r in rows]


def _select(ds: datasets.Dataset, idx: np.ndarray) -> datasets.Dataset:
    """``ds.select`` with a fingerprint from the index bytes (hashing a list is slow)."""
    digest = hashlib.sha256(ds._fingerprint.encode() + idx.tobytes()).hexdigest()[:16]
    return ds.select(idx, new_fingerprint=digest)


def partition_stats(parts: list[datasets.Dataset], label_col: str | None) -> dict[str, Any]:
    """Sizes and per-client label histograms.

    Args:
        parts: Client datasets.
        label_col: Column to histogram (discrete values), or ``None``.

    Returns:
        ``{"num_clients": n, "sizes": [...], "label_hist": [[count per label] per client] or
        None, "labels": [label values, in histogram order] or None}``. For a ``ClassLabel``
        column the histogram has one entry per class, absent classes included.
    """
    sizes = [len(p) for p in parts]
    out: dict[str, Any] = {"num_clients": len(parts), "sizes": sizes, "label_hist": None}
    out["labels"] = None
    if label_col is None or not parts:
        return out
    feature = parts[0].features.get(label_col)
    if feature is None:
        raise ConfigError(f"{FIELD}.by", f"no column '{label_col}' (have {parts[0].column_names})")
    values = [column_array(p, label_col) for p in parts]
    if isinstance(feature, datasets.ClassLabel):
        labels: list[Any] = list(range(feature.num_classes))
    else:
        labels = np.unique(np.concatenate(values)).tolist() if sum(sizes) else []
    lookup = np.asarray(labels)
    hist = [
        np.bincount(np.searchsorted(lookup, v), minlength=len(labels)).tolist()
        if len(v)
        else [0] * len(labels)
        for v in values
    ]
    out["label_hist"] = hist
    out["labels"] = labels
    return out


# --------------------------------------------------------------------------- helpers


def _keys(ds: datasets.Dataset, cfg: PartitionConfig, binned: bool) -> datasets.Dataset:
    """A slim dataset of row positions and the ``by`` values (binned if asked).

    The flwr partitioners only need these two columns; selecting from a slim copy avoids
    copying images or long texts.
    """
    if cfg.by not in ds.column_names:
        raise ConfigError(f"{FIELD}.by", f"no column '{cfg.by}' (have {ds.column_names})")
    values = column_array(ds, cfg.by)
    nested = values.dtype == object and len(values) and not isinstance(values[0], str | int | float)
    if values.ndim != 1 or nested:
        raise ConfigError(f"{FIELD}.by", f"column '{cfg.by}' is not a scalar column")
    if binned and cfg.bins is not None:
        values = pd.qcut(values, q=cfg.bins, labels=False, duplicates="drop").astype(np.int64)
    elif binned and np.issubdtype(values.dtype, np.floating):
        distinct = len(np.unique(values))
        if distinct > 50:
            raise ConfigError(
                f"{FIELD}.bins",
                f"column '{cfg.by}' is continuous ({distinct} values): set bins to split by "
                "quantile bins",
            )
    keys = values if np.issubdtype(values.dtype, np.number) else values.tolist()
    return datasets.Dataset.from_dict({_ROW: np.arange(len(ds)), _KEY: keys})


def _rows_of(partitioner: Any, n: int) -> list[list[int]]:
    """Source row positions of each partition.

    ``load_partition`` calls ``Dataset.select`` with a Python list, whose fingerprint hashing
    costs ~0.4 s per 6,000 rows; where the pinned flwr-datasets 0.6.1 keeps its assignment in
    ``_partition_id_to_indices`` (filled by the public ``num_partitions``), it is read directly.
    """
    rows = column_array(partitioner.dataset, _ROW).astype(np.int64)
    _ = partitioner.num_partitions  # public call that runs the assignment
    mapping = getattr(partitioner, "_partition_id_to_indices", None)
    if isinstance(mapping, dict) and sorted(mapping) == list(range(n)):
        return [rows[np.asarray(mapping[i], dtype=np.int64)].tolist() for i in range(n)]
    return [list(partitioner.load_partition(i)[_ROW]) for i in range(n)]


def _shuffled_rows(ds: datasets.Dataset, seed: int) -> datasets.Dataset:
    order = np.random.default_rng(seed).permutation(len(ds))
    return datasets.Dataset.from_dict({_ROW: order})


# --------------------------------------------------------------------------- schemes


@PARTITIONERS.register("iid", "uniform random split into near-equal parts")
def _iid(ds: datasets.Dataset, cfg: PartitionConfig) -> list[list[int]]:
    from flwr_datasets.partitioner import IidPartitioner

    part = IidPartitioner(num_partitions=cfg.num_clients)
    part.dataset = _shuffled_rows(ds, cfg.seed)
    return _rows_of(part, cfg.num_clients)


@PARTITIONERS.register("dirichlet", "label skew: per-class client shares ~ Dirichlet(alpha)")
def _dirichlet(ds: datasets.Dataset, cfg: PartitionConfig) -> list[list[int]]:
    from flwr_datasets.partitioner import DirichletPartitioner

    if len(ds) < cfg.num_clients * cfg.min_size:
        raise ConfigError(
            f"{FIELD}.min_size",
            f"{cfg.num_clients} clients x min_size {cfg.min_size} > {len(ds)} rows",
        )
    part = DirichletPartitioner(
        num_partitions=cfg.num_clients,
        partition_by=_KEY,
        alpha=cfg.alpha,
        min_partition_size=cfg.min_size,
        self_balancing=False,
        shuffle=True,
        seed=cfg.seed,
    )
    part.dataset = _keys(ds, cfg, binned=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rows = _rows_of(part, cfg.num_clients)
        except ValueError as exc:
            raise ConfigError(
                f"{FIELD}.alpha",
                f"no Dirichlet({cfg.alpha}) draw gave all {cfg.num_clients} clients >= "
                f"{cfg.min_size} rows ({exc}); raise alpha, lower min_size or num_clients",
            ) from None
    if caught:
        log.info("dirichlet partition: %d redraws to reach min_size %d", len(caught), cfg.min_size)
    return rows


@PARTITIONERS.register("pathological", "each client holds classes_per_client classes")
def _pathological(ds: datasets.Dataset, cfg: PartitionConfig) -> list[list[int]]:
    from flwr_datasets.partitioner import PathologicalPartitioner

    keys = _keys(ds, cfg, binned=True)
    n_classes = len(keys.unique(_KEY))
    k = cfg.classes_per_client
    if k > n_classes:
        raise ConfigError(
            f"{FIELD}.classes_per_client", f"{k} > {n_classes} classes in column '{cfg.by}'"
        )
    if cfg.num_clients + k - 1 < n_classes:
        raise ConfigError(
            f"{FIELD}.classes_per_client",
            f"{cfg.num_clients} clients x {k} consecutive classes cover only "
            f"{cfg.num_clients + k - 1} of {n_classes} classes; raise num_clients or "
            "classes_per_client",
        )
    part = PathologicalPartitioner(
        num_partitions=cfg.num_clients,
        partition_by=_KEY,
        num_classes_per_partition=k,
        class_assignment_mode="deterministic",
        shuffle=True,
        seed=cfg.seed,
    )
    part.dataset = keys
    try:
        return _rows_of(part, cfg.num_clients)
    except ValueError as exc:  # a class shared by more clients than it has rows
        raise ConfigError(f"{FIELD}.classes_per_client", str(exc).splitlines()[0]) from None


@PARTITIONERS.register("natural", "one client per distinct value of a column (domain, site)")
def _natural(ds: datasets.Dataset, cfg: PartitionConfig) -> list[list[int]]:
    from flwr_datasets.partitioner import NaturalIdPartitioner

    keys = _keys(ds, cfg, binned=False)
    distinct = len(keys.unique(_KEY))
    if distinct != cfg.num_clients:
        raise ConfigError(
            f"{FIELD}.num_clients",
            f"natural partition by '{cfg.by}' has {distinct} distinct values, "
            f"num_clients is {cfg.num_clients}",
        )
    part = NaturalIdPartitioner(partition_by=_KEY)
    part.dataset = keys
    # flwr-datasets draws a tqdm bar over the rows here with no switch to turn it off: a
    # partition of a few thousand rows is no progress to show.
    with contextlib.redirect_stderr(io.StringIO()):
        return _rows_of(part, cfg.num_clients)


def quantity_sizes(n: int, num_clients: int, alpha: float, min_size: int, seed: int) -> list[int]:
    """Client sizes ``min_size + Multinomial(n - num_clients*min_size, Dir(alpha))``; sum = n.

    Raises:
        ConfigError: ``n < num_clients * min_size``.
    """
    spare = n - num_clients * min_size
    if spare < 0:
        raise ConfigError(
            f"{FIELD}.min_size", f"{num_clients} clients x min_size {min_size} > {n} rows"
        )
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.full(num_clients, alpha))
    extra = rng.multinomial(spare, shares)
    return [int(min_size + e) for e in extra]


@PARTITIONERS.register("quantity", "quantity skew: client sizes ~ Dirichlet(alpha), labels mixed")
def _quantity(ds: datasets.Dataset, cfg: PartitionConfig) -> list[list[int]]:
    from flwr_datasets.partitioner import SizePartitioner

    sizes = quantity_sizes(len(ds), cfg.num_clients, cfg.alpha, max(cfg.min_size, 1), cfg.seed)
    part = SizePartitioner(partition_sizes=sizes)
    part.dataset = _shuffled_rows(ds, cfg.seed + 1)
    return _rows_of(part, cfg.num_clients)
