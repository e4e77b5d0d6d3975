"""Linear CKA and HSIC: hand-computed values, invariances, widths, a slow reference."""

from __future__ import annotations

import pytest
import torch

from fedfm.core.cka import centre_gram, cka_loss, cka_reference, gram_cka, hsic, linear_cka
from fedfm.errors import ConfigError


def _rand(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_hand_computed_one_dimensional_cka_is_squared_correlation() -> None:
    # x centred = [-1, 0, 1], y = [1, 0, 2] centred = [0, -1, 1]:
    # (Σxy)² / (Σx² Σy²) = 1² / (2 · 2) = 0.25.
    x = torch.tensor([[1.0], [2.0], [3.0]])
    y = torch.tensor([[1.0], [0.0], [2.0]])
    assert float(linear_cka(x, y)) == pytest.approx(0.25, abs=1e-7)
    assert float(cka_reference(x, y)) == pytest.approx(0.25, abs=1e-12)


def test_hand_computed_hsic() -> None:
    # P = x xᵀ with x = [-1, 0, 1] (already centred, so HPH = P); HSIC(P, P) = ||P||²_F / 4
    # = (1 + 1 + 1 + 1) / 4 = 1.
    x = torch.tensor([[-1.0], [0.0], [1.0]])
    p = x @ x.T
    assert float(hsic(p, p)) == pytest.approx(1.0)
    # centring a Gram matrix of a constant column gives zeros
    c = torch.ones(3, 1)
    assert torch.allclose(centre_gram(c @ c.T), torch.zeros(3, 3))


def test_identical_features_give_one() -> None:
    x = _rand(16, 5, 0)
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-12)
    assert float(cka_loss(x, x)) == pytest.approx(-1.0, abs=1e-12)


def test_invariant_to_isotropic_scaling_and_orthogonal_transforms() -> None:
    x, y = _rand(24, 6, 1), _rand(24, 9, 2)
    base = float(linear_cka(x, y))
    q, _ = torch.linalg.qr(_rand(6, 6, 3))  # orthogonal 6x6
    assert float(linear_cka(3.7 * x, y)) == pytest.approx(base, rel=1e-10)
    assert float(linear_cka(x, 0.02 * y)) == pytest.approx(base, rel=1e-10)
    assert float(linear_cka(x @ q, y)) == pytest.approx(base, rel=1e-10)
    # a generic (non-orthogonal) invertible map does change CKA: the check above can fail
    a = torch.eye(6, dtype=torch.float64)
    a[0, 0] = 25.0
    assert abs(float(linear_cka(x @ a, y)) - base) > 1e-3


@pytest.mark.parametrize(("n", "p", "q"), [(10, 40, 3), (200, 8, 5), (7, 7, 1)])
def test_matches_slow_reference_across_widths(n: int, p: int, q: int) -> None:
    # (10, 40, 3) takes the Gram path, (200, 8, 5) the feature-space path.
    x, y = _rand(n, p, n), _rand(n, q, p) ** 2
    ref = float(cka_reference(x, y))
    assert 0.0 < ref < 1.0
    assert float(linear_cka(x, y)) == pytest.approx(ref, rel=1e-9)
    assert float(gram_cka(x @ x.T, y @ y.T)) == pytest.approx(ref, rel=1e-9)


def test_hsic_matches_explicit_centring_matrix() -> None:
    x, y = _rand(12, 4, 5), _rand(12, 3, 6)
    p, q = x @ x.T, y @ y.T
    h = torch.eye(12, dtype=torch.float64) - 1.0 / 12
    expected = torch.trace(p @ h @ q @ h) / 11**2
    assert float(hsic(p, q)) == pytest.approx(float(expected), rel=1e-12)


def test_loss_is_differentiable_and_constant_features_give_zero() -> None:
    x = _rand(8, 4, 7).float().requires_grad_()
    y = _rand(8, 2, 8).float()
    cka_loss(x, y).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    c = torch.ones(8, 3, requires_grad=True)
    out = linear_cka(c, y)
    out.backward()
    assert float(out.detach()) == 0.0 and torch.isfinite(c.grad).all()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ConfigError, match="batch sizes"):
        linear_cka(torch.zeros(4, 2), torch.zeros(5, 2))
    with pytest.raises(ConfigError, match="at least 2"):
        linear_cka(torch.zeros(1, 2), torch.zeros(1, 3))
    with pytest.raises(ConfigError, match=r"\[n, d\]"):
        linear_cka(torch.zeros(4), torch.zeros(4, 2))
