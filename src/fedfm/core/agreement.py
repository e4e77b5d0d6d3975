"""Whether two sets of named tensors agree (two runs that should end with the same model).

Two sets agree when they name the same tensors (at least one), every pair has one shape, and
the largest absolute difference of any element is within a stated tolerance. A set that
shares no tensor with the other never agrees: a comparison of nothing proves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Agreement:
    """The comparison of two tensor sets.

    Attributes:
        common: Names in both sets.
        only_ours: Names in the first set only; ``only_theirs``: in the second only.
        shapes: Common names whose shapes differ.
        gap: Largest ``|ours - theirs|`` over the common tensors of one shape (NaN: none).
        scale: Largest ``|ours|`` over them, to read the gap against.
        tolerance: The largest gap that agrees.
    """

    common: int
    only_ours: int
    only_theirs: int
    shapes: int
    gap: float
    scale: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """Same names (at least one), same shapes, and every difference within the tolerance."""
        same = self.common > 0 and not (self.only_ours or self.only_theirs or self.shapes)
        return same and self.gap <= self.tolerance

    def line(self) -> str:
        """The comparison in one line, its verdict first."""
        verdict = "agree" if self.ok else "DIFFER"
        return (
            f"{verdict}: {self.common} tensors in common ({self.only_ours} only in ours,"
            f" {self.only_theirs} only in theirs, {self.shapes} of another shape), max |ours -"
            f" theirs| = {self.gap:.2e} (tolerance {self.tolerance:.1e}, max |value|"
            f" {self.scale:.2e})"
        )


def compare_tensors(
    ours: Mapping[str, Tensor], theirs: Mapping[str, Tensor], tolerance: float
) -> Agreement:
    """Compares two sets of named tensors (keys must already be in one format).

    Args:
        ours: Name -> tensor.
        theirs: Name -> tensor.
        tolerance: The largest absolute difference of an element that agrees.
    """
    common = sorted(set(ours) & set(theirs))
    same = [k for k in common if ours[k].shape == theirs[k].shape]
    filled = [k for k in same if ours[k].numel()]
    gap = scale = math.nan if not same else 0.0
    if filled:
        gap = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in filled)
        scale = max(float(ours[k].double().abs().max()) for k in filled)
    return Agreement(
        common=len(common),
        only_ours=len(set(ours) - set(theirs)),
        only_theirs=len(set(theirs) - set(ours)),
        shapes=len(common) - len(same),
        gap=gap,
        scale=scale,
        tolerance=tolerance,
    )
