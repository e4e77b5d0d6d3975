"""dpsyn's mechanisms and its selection by votes: numbers in, numbers out.

Paper: "Resource-Adaptive Federated Text Generation with Differential Privacy" (ICLR 2026,
arXiv:2603.07027); :mod:`fedfm.algorithms.dpsyn` runs the stages and lists the choices of
ours. Here: Gaussian noise on a released vector (:func:`noisy`), the DP profile's counts and
the allotment of synthetic samples per code (:func:`code_counts`, :func:`allot`), a private
sample's K-NN votes within its code (:func:`knn_votes`, Private Evolution's unit-norm votes),
PrE-Text's threshold (:func:`clip_votes`), and the selection of the synthetic set by the
clipped votes (:func:`select`: resampling or ranking, per code or over the whole set).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor


class VoteSelection(Protocol):
    """The settings :func:`select` reads (dpsyn's ``algo`` section)."""

    selection: Literal["resample", "rank"]
    keep_fraction: float
    resample_scope: Literal["code", "all"]
    resample_size: int | None
    num_samples: int


def noisy(values: Tensor, sigma: float, seed: int) -> Tensor:
    """``values`` plus ``N(0, sigma²)`` noise drawn from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return values + sigma * torch.randn(values.shape, generator=gen, dtype=values.dtype)


def code_counts(codes: Tensor, num_codes: int) -> Tensor:
    """``(num_codes,)`` float64 count of each code among ``codes``."""
    return torch.bincount(codes, minlength=num_codes).to(torch.float64)


def allot(profile: Tensor, total: int) -> list[int]:
    """``s_j = round(total · P[j] / Σ P)`` of the clipped profile (uniform when it sums to 0)."""
    p = profile.clamp_min(0).double()
    if float(p.sum()) <= 0:
        p = torch.ones_like(p)
    return [round(total * float(x)) for x in p / p.sum()]


def knn_votes(
    private: np.ndarray,
    private_codes: np.ndarray,
    synthetic: np.ndarray,
    synthetic_codes: np.ndarray,
    k: int,
) -> np.ndarray:
    """Each private sample's votes for its ``k`` nearest synthetic samples of its own code.

    Args:
        private: ``(n, d)`` L2-normalised embeddings of the private samples.
        private_codes: ``(n,)`` their codes.
        synthetic: ``(S, d)`` L2-normalised embeddings of the synthetic samples.
        synthetic_codes: ``(S,)`` their codes.
        k: Votes per private sample, each worth ``1/√k`` (one sample's votes have L2 norm 1,
            less when its code has fewer than ``k`` synthetic samples).

    Returns:
        ``(S,)`` float64 vote histogram.
    """
    votes = np.zeros(len(synthetic), dtype=np.float64)
    for code in np.unique(private_codes):
        cand = np.flatnonzero(synthetic_codes == code)  # synthetic samples of this code
        if not len(cand):
            continue
        sims = private[private_codes == code] @ synthetic[cand].T  # (n_c, S_c) cosine
        top = np.argsort(-sims, axis=1, kind="stable")[:, : min(k, len(cand))]
        np.add.at(votes, cand[top].ravel(), 1.0 / math.sqrt(k))
    return votes


def clip_votes(total: np.ndarray, threshold: float) -> np.ndarray:
    """The server's summed noisy votes after PrE-Text's threshold: ``max(h − H, 0)``."""
    return np.maximum(total - threshold, 0.0)


def quotas(
    codes: np.ndarray, allotment: list[int], size: int, scope: Literal["code", "all"] = "code"
) -> list[tuple[np.ndarray, int]]:
    """The groups a selection draws from and how many samples each keeps.

    Args:
        codes: ``(S,)`` code of each synthetic sample.
        allotment: ``s_j`` of each code.
        size: Samples to keep in all.
        scope: ``code``: one group per code, keeping ``round(s_j · size / Σ s)``; ``all``: the
            whole set, keeping ``size``.

    Returns:
        ``(indices of the group's samples, samples to keep)`` per group (per code, in order).
    """
    if scope == "all":
        return [(np.arange(len(codes)), size)]
    scale = size / max(sum(allotment), 1)
    return [(np.flatnonzero(codes == j), round(s * scale)) for j, s in enumerate(allotment)]


def draw_by_votes(
    votes: np.ndarray, idx: np.ndarray, want: int, rng: np.random.Generator, replace: bool = True
) -> list[int]:
    """``want`` of the samples ``idx``, drawn in proportion to their votes.

    Uniformly when their votes sum to 0; with or without replacement. A uniform draw is this
    function given equal votes (``np.ones``): the same code path, so a uniform control draws
    exactly as the resampling does when nobody voted.
    """
    v = votes[idx]
    if float(v.sum()) <= 0:
        v = np.ones_like(v)
    return idx[rng.choice(len(idx), size=want, replace=replace, p=v / v.sum())].tolist()


def top_by_votes(votes: np.ndarray, idx: np.ndarray, keep: int) -> list[int]:
    """The ``keep`` samples of ``idx`` with the most votes (ties to the lower index), sorted."""
    top = np.argsort(-votes[idx], kind="stable")[:keep]
    return sorted(idx[top].tolist())


def select(
    votes: np.ndarray,
    codes: np.ndarray,
    allotment: list[int],
    cfg: VoteSelection,
    seed: int,
) -> tuple[list[int], list[int]]:
    """Indices of the synthetic samples kept after voting, and the codes left unvoted.

    Args:
        votes: ``(S,)`` clipped noisy votes.
        codes: ``(S,)`` code of each synthetic sample.
        allotment: ``s_j`` of each code.
        cfg: ``selection``, ``keep_fraction``, ``resample_scope``, ``resample_size``.
        seed: Seeds the draws.

    Returns:
        Kept indices (with repeats when resampling) and the codes whose votes were all 0.
    """
    rng = np.random.default_rng(seed)
    size = cfg.resample_size or cfg.num_samples
    unvoted: list[int] = []
    kept: list[int] = []
    for j, (idx, want) in enumerate(quotas(codes, allotment, size, cfg.resample_scope)):
        if not len(idx):
            continue
        if float(votes[idx].sum()) <= 0:
            unvoted.append(j)
        if cfg.selection == "rank":
            kept += top_by_votes(votes, idx, max(1, math.ceil(cfg.keep_fraction * len(idx))))
        else:
            kept += draw_by_votes(votes, idx, want, rng)
    return kept, unvoted
