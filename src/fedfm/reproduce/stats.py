"""Statistics of the reproduction studies: means with standard errors over seeds, paired.

Every run of a study is one draw per seed, and a seed fixes the partition, so two methods of
one seed see the same clients: their difference is *paired*. A difference is estimated as the
mean over seeds of the per-seed differences d_s = a_s − b_s, and its standard error is the
sample standard deviation of d_s (ddof = 1) divided by √n, n the number of seeds both have.
Pairing removes the between-seed (partition) variance that two independent means would carry.
A value is "resolved" when it lies more than two standard errors from zero (about a 95 %
interval under normality; with 5 seeds, 4 degrees of freedom, the t quantile is 2.78, so 2 SE
is a lenient screen, not a test).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its standard error.

    Attributes:
        mean: Mean of the values (NaN when there are none).
        se: Standard error, sample std (ddof = 1) / √n (NaN for fewer than two values).
        n: Number of values (seeds).
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

    def resolved(self, k: float = 2.0) -> int:
        """+1 when the mean is more than ``k`` SE above zero, −1 when below, 0 otherwise."""
        if self.n < 2 or not math.isfinite(self.se):
            return 0
        if self.mean > k * self.se:
            return 1
        return -1 if self.mean < -k * self.se else 0


def mean_se(values: Sequence[float]) -> Estimate:
    """Mean and standard error (sample std with ddof = 1, over √n) of ``values``."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    if len(v) == 0:
        return Estimate(math.nan, math.nan, 0)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return Estimate(float(v.mean()), se, len(v))


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> Estimate:
    """Mean of the per-seed differences a_s − b_s over the seeds both have, with its SE."""
    seeds = sorted(set(a) & set(b))
    return mean_se([a[s] - b[s] for s in seeds])


def pooled_paired(pairs: Sequence[tuple[Mapping[int, float], Mapping[int, float]]]) -> Estimate:
    """A paired difference pooled over cells (datasets, settings) of one unit.

    Per seed, the differences a_s − b_s of every cell are averaged; the estimate is the mean
    and SE of these per-seed averages over the seeds that every cell has (so each seed weighs
    every cell equally, and the SE still comes from the spread over seeds).
    """
    if not pairs:
        return Estimate(math.nan, math.nan, 0)
    seeds = set.intersection(*(set(a) & set(b) for a, b in pairs))
    return mean_se([float(np.mean([a[s] - b[s] for a, b in pairs])) for s in sorted(seeds)])
