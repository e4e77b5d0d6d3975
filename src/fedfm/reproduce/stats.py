"""Statistics of the reproduction studies, in one place: means with standard errors, paired
differences, a paired bootstrap, and the verdict rule of a readout.

Two runs of a study that share their units of variation are compared *paired*. A unit is a
seed (a seed fixes the partition, the splits and the initialisations, so two methods of one
seed see the same clients), an evaluated item or a test row (every method is scored on the
same ones). The difference is the mean over the units both have of d_u = a_u − b_u, and its
standard error is the sample standard deviation of d_u (ddof = 1) over √n: pairing removes
the between-unit variance that two independent means would carry. :func:`paired` does this
for every kind of unit (its keys are seeds, item ids or row ids).

A statistic that is not a mean over units (macro-F1) gets its SE from a paired bootstrap:
the same resampled rows for both sides (:func:`paired_bootstrap`, :func:`macro_f1_diff`).

Where every seed is scored on every test row (seeds of a noise draw, each scored on the same
held-out rows), the two are crossed random factors: :func:`crossed` gives the SE of a mean
over both, :func:`crossed_bootstrap` that of a statistic such as macro-F1 (Owen 2007, "The
pigeonhole bootstrap").

A value is *resolved* when it lies more than two standard errors from zero (about a 95 %
interval under normality; with 5 seeds, 4 degrees of freedom, the t quantile is 2.78, so 2 SE
is a lenient screen, not a test). :func:`verdict` applies that rule to a readout: in the
paper's direction beyond 2 SE, against it beyond 2 SE, or not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

K = TypeVar("K")  # a unit: a seed, an item id, a test row id

BOOTSTRAP = 1000
"""Paired bootstrap resamples of a statistic that is not a mean (macro-F1)."""


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error.

    Attributes:
        mean: Mean of the values (NaN when there are none).
        se: Standard error, sample std (ddof = 1) / √n (NaN for fewer than two values).
        n: Number of values (seeds, items, rows).
    """

    mean: float
    se: float
    n: int

    def fmt(self, digits: int = 3, signed: bool = False) -> str:
        """``mean ± se``; the mean alone for one value; an em dash for none."""
        if self.n == 0:
            return "—"
        sign = "+" if signed else ""
        m = f"{self.mean:{sign}.{digits}f}"
        return m if self.n < 2 else f"{m} ± {self.se:.{digits}f}"

    def resolved(self, k: float = 2.0, null: float = 0.0) -> int:
        """+1 when the mean is more than ``k`` SE above ``null``, −1 when below, 0 otherwise."""
        if self.n < 2 or not math.isfinite(self.se) or not math.isfinite(self.mean):
            return 0
        if self.mean - null > k * self.se:
            return 1
        return -1 if self.mean - null < -k * self.se else 0


NONE = Estimate(math.nan, math.nan, 0)


def mean_se(values: Sequence[float]) -> Estimate:
    """Mean and standard error (sample std with ddof = 1, over √n) of the finite ``values``."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    if len(v) == 0:
        return NONE
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return Estimate(float(v.mean()), se, len(v))


def paired(a: Mapping[K, float], b: Mapping[K, float]) -> Estimate:
    """Mean of the per-unit differences a_u − b_u over the units both have, with its SE.

    The keys are the units: seeds (paired over seeds), item ids (paired over items) or test
    row ids (paired over rows).
    """
    units = sorted(set(a) & set(b))  # type: ignore[type-var]
    return mean_se([a[u] - b[u] for u in units])


def pooled_paired(pairs: Sequence[tuple[Mapping[int, float], Mapping[int, float]]]) -> Estimate:
    """A paired difference pooled over cells (datasets, settings) of one unit.

    Per seed, the differences a_s − b_s of every cell are averaged; the estimate is the mean
    and SE of these per-seed averages over the seeds that every cell has (so each seed weighs
    every cell equally, and the SE still comes from the spread over seeds).
    """
    if not pairs:
        return NONE
    seeds = set.intersection(*(set(a) & set(b) for a, b in pairs))
    return mean_se([float(np.mean([a[s] - b[s] for a, b in pairs])) for s in sorted(seeds)])


def mean_of(parts: Sequence[Estimate]) -> Estimate:
    """The mean of independent estimates (e.g. one per domain) with SE √(Σ SE²) / G.

    ``n`` is the units summed over the parts; a part without values is left out.
    """
    parts = [p for p in parts if p.n > 0]
    if not parts:
        return NONE
    se = math.sqrt(sum(p.se**2 for p in parts)) / len(parts)
    return Estimate(float(np.mean([p.mean for p in parts])), se, sum(p.n for p in parts))


def crossed(d: np.ndarray) -> Estimate:
    """The mean of a ``(seeds, rows)`` array of paired differences, with a two-way SE.

    ``d[s, i]`` is a − b for seed ``s`` on test row ``i``. Seeds and rows are crossed random
    factors, so the SE combines both: ``SE² = s²_seeds / S + s²_rows / N``, where
    ``s²_seeds`` is the sample variance (ddof 1) of the ``S`` per-seed means (over rows) and
    ``s²_rows`` that of the ``N`` per-row means (over seeds). Each term also holds the
    interaction's share ``σ²_e / (S·N)`` once, so the sum counts it twice: slightly
    conservative. A factor with one level contributes nothing (one seed: the SE of rows alone,
    as :func:`paired` over rows). ``n`` is ``S·N``.
    """
    d = np.asarray(d, dtype=float)
    if d.ndim != 2 or d.size == 0:
        return NONE
    s_count, n_count = d.shape
    var = 0.0
    if s_count > 1:
        var += float(d.mean(1).var(ddof=1)) / s_count
    if n_count > 1:
        var += float(d.mean(0).var(ddof=1)) / n_count
    se = math.sqrt(var) if d.size > 1 else math.nan
    return Estimate(float(d.mean()), se, int(d.size))


def crossed_bootstrap(
    shape: tuple[int, int],
    diff: Callable[[np.ndarray, np.ndarray], float],
    resamples: int = BOOTSTRAP,
    seed: int = 0,
) -> Estimate:
    """A statistic's difference over ``(seeds, rows)`` with the SE of a two-way bootstrap.

    Each resample draws the seeds and, independently, the test rows with replacement (the
    pigeonhole bootstrap of Owen 2007, as conservative as :func:`crossed`), the same for both
    sides.

    Args:
        shape: ``(S, N)``: seeds and rows.
        diff: The statistic of a minus that of b, given index arrays of seeds ``[S]`` and rows
            ``[N]`` (e.g. the mean over the seeds of each seed's macro-F1 difference).
        resamples: Bootstrap resamples (seeded).
        seed: Seed of the resampling.
    """
    s_count, n_count = shape
    if s_count == 0 or n_count == 0:
        return NONE
    rng = np.random.default_rng(seed)
    boots = [
        diff(rng.integers(0, s_count, s_count), rng.integers(0, n_count, n_count))
        for _ in range(resamples)
    ]
    full = diff(np.arange(s_count), np.arange(n_count))
    return Estimate(float(full), float(np.std(boots, ddof=1)), s_count * n_count)


def macro_f1_rows(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Macro-F1 of each row of predictions ``pred`` ``(S, N)`` against ``y`` ``(N,)``.

    :func:`fedfm.tasks.base.macro_f1` per row (the mean over the classes present in ``y`` or
    in that row's predictions), vectorised for the bootstrap.
    """
    pred, y = np.asarray(pred), np.asarray(y)
    f1 = []
    for c in np.union1d(np.unique(pred), np.unique(y)):
        is_pred, is_true = pred == c, (y == c)[None, :]
        denom = is_pred.sum(1) + is_true.sum()
        tp = (is_pred & is_true).sum(1)
        f1.append(np.where(denom > 0, 2 * tp / np.maximum(denom, 1), np.nan))
    return np.nanmean(np.stack(f1), axis=0)


def paired_bootstrap(
    n: int, diff: Callable[[np.ndarray], float], resamples: int = BOOTSTRAP, seed: int = 0
) -> Estimate:
    """A statistic's difference on all ``n`` rows with the SE of its paired bootstrap.

    Args:
        n: Rows (shared by both sides, in one order).
        diff: Statistic of a minus that of b on the rows of an index array ``[n]``.
        resamples: Bootstrap resamples (seeded: the same rows give the same SE).
        seed: Seed of the resampling.
    """
    if n == 0:
        return NONE
    rng = np.random.default_rng(seed)
    boots = [diff(rng.integers(0, n, n)) for _ in range(resamples)]
    return Estimate(float(diff(np.arange(n))), float(np.std(boots, ddof=1)), n)


def macro_f1_diff(
    y: Sequence[int], pred_a: Sequence[int], pred_b: Sequence[int], seed: int = 0
) -> Estimate:
    """Macro-F1 of ``pred_a`` minus that of ``pred_b`` on the same rows, with the SE of
    :data:`BOOTSTRAP` paired bootstrap resamples of the rows (``n`` is the row count)."""
    import torch

    from fedfm.tasks.base import macro_f1

    yt, at, bt = (torch.tensor(list(v), dtype=torch.long) for v in (y, pred_a, pred_b))

    def diff(idx: np.ndarray) -> float:
        i = torch.as_tensor(idx)
        return macro_f1(at[i], yt[i]) - macro_f1(bt[i], yt[i])

    return paired_bootstrap(len(yt), diff, seed=seed)


# ----------------------------------------------------------------------------- the verdict

IN_DIRECTION = "in the paper's direction (> 2 SE)"
AGAINST = "against the paper (> 2 SE)"
UNRESOLVED = "not resolved (≤ 2 SE)"


def verdict(est: Estimate, direction: int, null: float = 0.0) -> str:
    """The verdict rule of a readout, fixed for every study.

    Args:
        est: The readout's estimate (a − b, or a ratio).
        direction: +1 when the paper says the value lies above ``null``, −1 below.
        null: The value of "no difference" (0 for a difference, 1 for a ratio).

    Returns:
        In the paper's direction beyond 2 SE, against it beyond 2 SE, not resolved within
        2 SE; "not measured" without a value, and "no SE" for a single value (not resolved).
    """
    if est.n == 0 or not math.isfinite(est.mean):
        return "not measured"
    if est.n < 2 or not math.isfinite(est.se):
        side = "in" if (est.mean - null) * direction > 0 else "not in"
        return f"no SE (one value, {side} the paper's direction): not resolved"
    r = est.resolved(null=null) * direction
    return IN_DIRECTION if r > 0 else AGAINST if r < 0 else UNRESOLVED
