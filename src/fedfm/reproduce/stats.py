"""Statistics of the reproduction studies.

Means with standard errors, paired differences, bootstraps and the verdict rule of a readout.

Two runs that share their units (seeds: a seed fixes the partition, splits and
initialisations; evaluated items; test rows) are compared *paired*: the mean over the shared
units of d_u = a_u − b_u, with SE = sd(d_u, ddof 1) / √n, free of the between-unit variance
two independent means would carry. A statistic that is not a mean (macro-F1) gets its SE from
a paired bootstrap; seeds each scored on the same rows are crossed factors (:func:`crossed`,
:func:`crossed_bootstrap`; Owen 2007, "The pigeonhole bootstrap").

A value is *resolved* beyond 2 SE from zero (about 95 % under normality; with 5 seeds the t
quantile is 2.78, so 2 SE is a lenient screen, not a test). A readout's *minimum detectable
effect* is that threshold stated before its verdict: 2 · SD / √n from its unit count and the
per-unit SD of its differences (:func:`mde`), so a reader sees whether the grid could resolve
the paper's margin at all.

Classifiers are read by balanced metrics (scikit-learn's ``balanced_accuracy_score`` and
macro ``f1_score`` over the gold classes, as the evaluator's
:func:`fedfm.eval.metrics.class_balanced_scores`) where classes are unbalanced: a scorer
that answers the majority label scores the majority share in accuracy and 1 / C in balanced
accuracy. Balanced accuracy is a
weighted mean of the items' correctness (:func:`balanced_weights`), so its paired difference
and SE come from the same item-level arithmetic as accuracy's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

K = TypeVar("K")  # a unit: a seed, an item id, a test row id

BOOTSTRAP = 1000  # bootstrap resamples of a statistic that is not a mean (macro-F1)


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error over ``n`` values (NaN where undefined)."""

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
        d = self.mean - null
        return 1 if d > k * self.se else -1 if d < -k * self.se else 0


NONE = Estimate(math.nan, math.nan, 0)


def mean_se(values: Iterable[float] | Mapping[Any, float]) -> Estimate:
    """Mean and SE (ddof = 1, over √n) of the finite ``values`` (or a mapping's values)."""
    xs = values.values() if isinstance(values, Mapping) else values
    v = np.asarray([x for x in xs if math.isfinite(x)], dtype=float)
    if len(v) == 0:
        return NONE
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return Estimate(float(v.mean()), se, len(v))


def paired(a: Mapping[K, float], b: Mapping[K, float]) -> Estimate:
    """Mean and SE of the differences a_u − b_u over the units (seeds, ids) both have."""
    units = sorted(set(a) & set(b))  # type: ignore[type-var]
    return mean_se([a[u] - b[u] for u in units])


def mde(sd: float, n: int, k: float = 2.0) -> float:
    """The minimum detectable effect of a mean difference over ``n`` units with per-unit SD ``sd``.

    ``k · sd / √n`` (NaN for fewer than two units).
    """
    return k * sd / math.sqrt(n) if n > 1 and math.isfinite(sd) else math.nan


def units_for(sd: float, effect: float, k: float = 2.0) -> int:
    """The units a mean difference needs for ``effect`` to be detectable.

    With per-unit SD ``sd``, ``effect`` reaches the minimum detectable effect at ``⌈(k · sd /
    effect)²⌉`` units.
    """
    return math.ceil((k * sd / abs(effect)) ** 2)


def mde_of(est: Estimate, k: float = 2.0) -> float:
    """The minimum detectable effect of an estimate's own grid: ``k`` SE (NaN without an SE)."""
    return k * est.se if est.n > 1 and math.isfinite(est.se) else math.nan


def balanced_accuracy(y: Sequence[Any] | np.ndarray, pred: Sequence[Any] | np.ndarray) -> float:
    """Balanced accuracy: mean per-class recall of ``pred`` over ``y``'s classes.

    :func:`fedfm.eval.metrics.class_balanced_scores`'s ``bal_acc`` (scikit-learn's; an
    off-label answer is a miss of its item's class; NaN for no rows).
    """
    return _gold_scores(y, pred)["bal_acc"]


def macro_f1(y: Sequence[Any] | np.ndarray, pred: Sequence[Any] | np.ndarray) -> float:
    """Macro-F1 over the gold classes (the classes of ``y``).

    :func:`fedfm.eval.metrics.class_balanced_scores`'s ``f1_macro``, the one definition of the
    studies and the evaluator: scikit-learn's ``f1_score(average="macro", labels=<classes of
    y>, zero_division=0)``. An off-label answer (another label, no label) is an error of its
    item's class (a lost recall), never a class of its own; a gold class never predicted
    scores 0. NaN for no rows.
    """
    return _gold_scores(y, pred)["f1_macro"]


def _gold_scores(
    y: Sequence[Any] | np.ndarray, pred: Sequence[Any] | np.ndarray
) -> dict[str, float]:
    from fedfm.eval.metrics import class_balanced_scores

    if not len(y):
        return {"bal_acc": math.nan, "f1_macro": math.nan}
    return class_balanced_scores([str(v) for v in y], [str(v) for v in pred])


def balanced_weights(y: Sequence[Any]) -> np.ndarray:
    """Per-item weights whose mean with correctness is the balanced accuracy.

    Per-item weights ``N / (C · n_c)`` (``C`` classes of ``y``, ``n_c`` items of the
    item's class): the mean of ``correct · weight`` over the items is the balanced accuracy,
    and a paired difference of such values is the difference of balanced accuracies (with the
    class counts held fixed: the item-level SE of a stratified sample).
    """
    labels = [str(v) for v in y]
    counts: dict[str, int] = {}
    for v in labels:
        counts[v] = counts.get(v, 0) + 1
    n, c = len(labels), len(counts)
    return np.asarray([n / (c * counts[v]) for v in labels], dtype=float)


def pooled_paired(pairs: Sequence[tuple[Mapping[int, float], Mapping[int, float]]]) -> Estimate:
    """A paired difference pooled over cells (datasets, settings).

    The mean and SE over the seeds every cell has of each seed's average of a_s − b_s over the
    cells.
    """
    if not pairs:
        return NONE
    seeds = set.intersection(*(set(a) & set(b) for a, b in pairs))
    return mean_se([float(np.mean([a[s] - b[s] for a, b in pairs])) for s in sorted(seeds)])


def mean_of(parts: Sequence[Estimate]) -> Estimate:
    """The mean of independent estimates with its SE.

    The mean of independent estimates (e.g. one per domain, a part without values left
    out) with SE √(Σ SE²) / G over the units of all parts.
    """
    parts = [p for p in parts if p.n > 0]
    if not parts:
        return NONE
    se = math.sqrt(sum(p.se**2 for p in parts)) / len(parts)
    return Estimate(float(np.mean([p.mean for p in parts])), se, sum(p.n for p in parts))


def crossed(d: np.ndarray) -> Estimate:
    """The mean of paired differences over seeds and rows with the two-way SE.

    The mean of paired differences ``d[seed, row]`` with the two-way SE of crossed factors,
    ``SE² = s²_seeds / S + s²_rows / N`` (each variance holds the interaction once: slightly
    conservative); a factor with one level adds nothing; ``n`` is ``S·N``.
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
    """A statistic's difference over seeds and rows with a two-way bootstrap SE.

    A statistic's difference over ``(S, N)`` seeds and rows, with the SE of a two-way
    bootstrap (seeds and rows drawn independently, the same for both sides): ``diff(seeds,
    rows)`` gets index arrays and returns a's statistic minus b's.
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
    """Macro-F1 of each row of ``pred`` ``(S, N)`` against ``y`` ``(N,)``, vectorised."""
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
    """A statistic's difference on ``n`` shared rows, with the SE of its paired bootstrap.

    ``diff(rows)`` gets an index array and returns a's statistic minus b's; the ``resamples`` are
    drawn from ``seed``.
    """
    if n == 0:
        return NONE
    rng = np.random.default_rng(seed)
    boots = [diff(rng.integers(0, n, n)) for _ in range(resamples)]
    return Estimate(float(diff(np.arange(n))), float(np.std(boots, ddof=1)), n)


def macro_f1_diff(
    y: Sequence[int], pred_a: Sequence[int], pred_b: Sequence[int], seed: int = 0
) -> Estimate:
    """Macro-F1 of ``pred_a`` minus that of ``pred_b`` with a paired bootstrap SE.

    Macro-F1 of ``pred_a`` minus that of ``pred_b`` on the same rows, with the SE of
    :data:`BOOTSTRAP` paired bootstrap resamples of the rows (``n`` is the row count).
    """
    import torch

    from fedfm.tasks.base import macro_f1

    yt, at, bt = (torch.tensor(list(v), dtype=torch.long) for v in (y, pred_a, pred_b))

    def diff(idx: np.ndarray) -> float:
        i = torch.as_tensor(idx)
        return macro_f1(at[i], yt[i]) - macro_f1(bt[i], yt[i])

    return paired_bootstrap(len(yt), diff, seed=seed)


IN_DIRECTION = "in the paper's direction (> 2 SE)"
AGAINST = "against the paper (> 2 SE)"
UNRESOLVED = "not resolved (≤ 2 SE)"


def verdict(est: Estimate, direction: int, null: float = 0.0) -> str:
    """The verdict rule of a readout, the same for every study.

    In the paper's ``direction`` (+1: above ``null``, −1: below) beyond 2 SE, against it beyond 2
    SE, or not resolved; "not measured" without a value, "no SE" for a single value (not resolved).
    """
    if est.n == 0 or not math.isfinite(est.mean):
        return "not measured"
    if est.n < 2 or not math.isfinite(est.se):
        side = "in" if (est.mean - null) * direction > 0 else "not in"
        return f"no SE (one value, {side} the paper's direction): not resolved"
    r = est.resolved(null=null) * direction
    return IN_DIRECTION if r > 0 else AGAINST if r < 0 else UNRESOLVED
