"""Linear centred kernel alignment (CKA) and HSIC as pure functions.

Kornblith et al. 2019, "Similarity of Neural Network Representations Revisited" (ICML): for
features ``X`` [n, p] and ``Y`` [n, q] of the same n examples, with Gram matrices
``P = X Xᵀ`` and ``Q = Y Yᵀ`` and the centring matrix ``H = I − 11ᵀ/n``,

    HSIC(P, Q) = tr(P H Q H) / (n − 1)²
    CKA(X, Y)  = HSIC(P, Q) / sqrt(HSIC(P, P) · HSIC(Q, Q)).

CKA compares how two models arrange a batch (which examples are alike), so ``p`` and ``q``
may differ. It is 1 for identical features and invariant to isotropic scaling and orthogonal
transforms of either side (not to arbitrary invertible linear maps). FedRD uses
``L_CKA = −CKA`` as a feature-alignment loss between teacher and student.

Written by hand: a few lines of tensor algebra that must stay differentiable in torch; the
libraries that ship CKA (e.g. ``torch_cka``) work on numpy or hook whole models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedfm.errors import ConfigError

_EPS = 1e-12


def _check_pair(x: Tensor, y: Tensor) -> None:
    if x.ndim != 2 or y.ndim != 2:
        raise ConfigError("cka", f"features must be [n, d] matrices, got {x.shape} and {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise ConfigError(
            "cka", f"features of different batch sizes: {x.shape[0]} and {y.shape[0]} examples"
        )
    if x.shape[0] < 2:
        raise ConfigError("cka", f"CKA needs at least 2 examples, got {x.shape[0]}")


def centre_gram(k: Tensor) -> Tensor:
    """``H K H`` for a symmetric [n, n] Gram matrix, without building H.

    ``H K H`` subtracts the row means and the column means and adds back the grand mean.
    """
    return k - k.mean(0, keepdim=True) - k.mean(1, keepdim=True) + k.mean()


def hsic(p: Tensor, q: Tensor) -> Tensor:
    """Biased empirical HSIC of two [n, n] Gram matrices: ``tr(P H Q H) / (n − 1)²``.

    Since H is symmetric and idempotent, ``tr(P H Q H) = <H P H, H Q H>`` (elementwise sum).
    """
    if p.shape != q.shape or p.ndim != 2 or p.shape[0] != p.shape[1]:
        raise ConfigError("hsic", f"need two [n, n] Gram matrices, got {p.shape} and {q.shape}")
    n = p.shape[0]
    return (centre_gram(p) * centre_gram(q)).sum() / (n - 1) ** 2


def gram_cka(p: Tensor, q: Tensor) -> Tensor:
    """CKA from Gram matrices: ``HSIC(P, Q) / sqrt(HSIC(P, P) · HSIC(Q, Q))``."""
    pc, qc = centre_gram(p), centre_gram(q)
    # (n-1)² cancels between numerator and denominator.
    den = ((pc * pc).sum() * (qc * qc).sum()).clamp_min(_EPS).sqrt()
    return (pc * qc).sum() / den


def linear_cka(x: Tensor, y: Tensor) -> Tensor:
    """Linear CKA of features ``x`` [n, p] and ``y`` [n, q] (p and q may differ).

    Uses the feature-space identity of Kornblith et al. (eq. 5) when ``n`` exceeds the widths
    (``||Yᶜᵀ Xᶜ||²_F / (||Xᶜᵀ Xᶜ||_F ||Yᶜᵀ Yᶜ||_F`` with column-centred features) and the
    [n, n] Gram form otherwise; both give the same number, whichever is cheaper.

    Returns:
        A scalar in [0, 1]; 0 when either side is constant over the batch.

    Raises:
        ConfigError: Not two [n, d] matrices of the same n >= 2.
    """
    _check_pair(x, y)
    x = x - x.mean(0, keepdim=True)
    y = y - y.mean(0, keepdim=True)
    n, p, q = x.shape[0], x.shape[1], y.shape[1]
    if n > p + q:
        xy = (y.T @ x).square().sum()
        xx = (x.T @ x).square().sum()
        yy = (y.T @ y).square().sum()
    else:
        # Centred features give centred Gram matrices: Xᶜ Xᶜᵀ = H X Xᵀ H.
        kx, ky = x @ x.T, y @ y.T
        xy, xx, yy = (kx * ky).sum(), kx.square().sum(), ky.square().sum()
    return xy / (xx * yy).clamp_min(_EPS).sqrt()


def cka_loss(f_t: Tensor, f_s: Tensor) -> Tensor:
    """FedRD's feature-alignment loss ``L_CKA = −CKA(f_t, f_s)`` (in [−1, 0])."""
    return -linear_cka(f_t, f_s)


def cka_reference(x: Tensor, y: Tensor) -> Tensor:
    """Slow reference: explicit H matrix and traces, in float64 (for tests and audits)."""
    _check_pair(x, y)
    x, y = x.double(), y.double()
    n = x.shape[0]
    h = torch.eye(n, dtype=torch.float64) - torch.full((n, n), 1.0 / n, dtype=torch.float64)
    p, q = x @ x.T, y @ y.T

    def _hsic(a: Tensor, b: Tensor) -> Tensor:
        return torch.trace(a @ h @ b @ h) / (n - 1) ** 2

    return _hsic(p, q) / torch.sqrt(_hsic(p, p) * _hsic(q, q))
