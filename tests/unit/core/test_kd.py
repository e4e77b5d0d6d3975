"""KD losses, FedeKD energies and trust gates against hand-computed values and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from fedfm.core.kd import (
    GATES,
    entropy,
    gated_kd,
    half_squared_error_energy,
    kd_kl,
    kd_mse,
    sigmoid_gate,
    soft_ce,
    standardize,
    symmetric_kl_energy,
    ungated,
)
from fedfm.errors import UnknownNameError

LN3 = math.log(3.0)


def _kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))


def _h(a: list[float]) -> float:
    return -sum(x * math.log(x) for x in a)


# ----------------------------------------------------------------------------- energies


def test_symmetric_kl_energy_of_identical_distributions_is_zero():
    logits = torch.randn(8, 5)
    assert torch.equal(symmetric_kl_energy(logits, logits), torch.zeros(8))
    # Softmax is shift-invariant: logits + c describe the same distribution.
    shifted = symmetric_kl_energy(logits, logits + 3.0)
    assert torch.allclose(shifted, torch.zeros(8), atol=1e-6)


def test_symmetric_kl_energy_two_class_hand_example():
    # p = softmax([0, 0]) = (1/2, 1/2); q = softmax([ln 3, 0]) = (3/4, 1/4).
    p, q = [0.5, 0.5], [0.75, 0.25]
    sym = 0.5 * (_kl(p, q) + _kl(q, p))  # ½(0.143841 + 0.130812) = 0.137327
    expected = sym / (_h(p) + _h(q) + 1e-8)  # / (0.693147 + 0.562335) = 0.109382
    assert expected == pytest.approx(0.109382, abs=1e-6)
    got = symmetric_kl_energy(torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]]))
    assert got.item() == pytest.approx(expected, rel=1e-5)
    # Symmetric in its arguments.
    back = symmetric_kl_energy(torch.tensor([[LN3, 0.0]]), torch.tensor([[0.0, 0.0]]))
    assert back.item() == pytest.approx(expected, rel=1e-5)


def test_entropy_hand_values():
    h = entropy(torch.tensor([[0.0, 0.0], [LN3, 0.0]]))
    assert h.tolist() == pytest.approx([math.log(2), _h([0.75, 0.25])], rel=1e-6)


def test_half_squared_error_energy_hand_values():
    f = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    g = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    # ½(1 + 4) = 2.5 and ½(9 + 16) = 12.5
    assert half_squared_error_energy(f, g).tolist() == [2.5, 12.5]
    # Scalar regression outputs, as [B, 1] or [B]: ½(2 − 0.5)² = 1.125, ½(−1 − 1)² = 2.
    assert half_squared_error_energy(
        torch.tensor([[2.0], [-1.0]]), torch.tensor([[0.5], [1.0]])
    ).tolist() == [1.125, 2.0]
    assert half_squared_error_energy(
        torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    ).tolist() == [1.125, 2.0]


# ----------------------------------------------------------------------------- KD losses


def test_kd_kl_hand_values_and_temperature():
    s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]])
    # KL(q ‖ p) with q the teacher (3/4, 1/4), p the student (1/2, 1/2): 0.130812.
    assert kd_kl(s, t).item() == pytest.approx(_kl([0.75, 0.25], [0.5, 0.5]), rel=1e-5)
    # T = 2: teacher softmax([ln3/2, 0]) = (√3, 1)/(√3 + 1); loss scaled by T² = 4.
    r3 = math.sqrt(3)
    q2 = [r3 / (r3 + 1), 1 / (r3 + 1)]
    assert kd_kl(s, t, temperature=2.0).item() == pytest.approx(4 * _kl(q2, [0.5, 0.5]), rel=1e-5)
    # Per-sample values with reduction="none".
    per = kd_kl(torch.cat([s, t]), torch.cat([t, t]), reduction="none")
    assert per.shape == (2,) and per[1].item() == pytest.approx(0.0, abs=1e-7)


def test_soft_ce_is_kl_plus_teacher_entropy():
    s, t = torch.randn(6, 4), torch.randn(6, 4)
    for temp in (1.0, 3.0):
        h_t = entropy(t / temp) * temp * temp
        expected = kd_kl(s, t, temp, "none") + h_t
        assert torch.allclose(soft_ce(s, t, temp, "none"), expected, atol=1e-5)


def test_kd_gradient_is_zero_when_student_equals_teacher():
    teacher = torch.randn(5, 3)
    for temp in (1.0, 2.0):
        student = teacher.clone().requires_grad_(True)
        kd_kl(student, teacher, temp).backward()
        assert torch.allclose(student.grad, torch.zeros_like(teacher), atol=1e-7)
    student = teacher.clone().requires_grad_(True)
    kd_mse(student, teacher).backward()
    assert torch.equal(student.grad, torch.zeros_like(teacher))
    # ... and not zero when they differ.
    student = (teacher + torch.randn(5, 3)).requires_grad_(True)
    kd_kl(student, teacher).backward()
    assert student.grad.abs().sum() > 1e-4


def test_kd_mse_hand_values():
    s = torch.tensor([[1.0], [3.0]])
    t = torch.tensor([[0.0], [1.0]])
    assert kd_mse(s, t, "none").tolist() == [1.0, 4.0]
    assert kd_mse(s, t).item() == 2.5


# ----------------------------------------------------------------------------- gates


def test_gate_weights_fall_as_energy_rises():
    energy = torch.tensor([0.1, 0.5, 2.0, 5.0])
    for beta in (0.5, 1.0, 4.0):
        w = sigmoid_gate(energy, beta)
        assert torch.all(w[1:] < w[:-1])
        assert torch.all((w > 0) & (w < 1))
    # Larger β separates trusted and distrusted samples more.
    assert sigmoid_gate(energy, 4.0)[-1] < sigmoid_gate(energy, 1.0)[-1]


def test_gate_is_batch_normalised_hand_values():
    # E = [1, 3]: mean 2, population std 1, so z = [−1, 1] and w = [σ(β), σ(−β)].
    w = sigmoid_gate(torch.tensor([1.0, 3.0]), 2.0)
    assert w.tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2))], rel=1e-6)
    # Shifting or scaling the whole batch's energies leaves the weights unchanged.
    e = torch.rand(16)
    assert torch.allclose(sigmoid_gate(e, 1.0), sigmoid_gate(10 * e + 7, 1.0), atol=1e-5)
    assert torch.allclose(standardize(e).mean(), torch.tensor(0.0), atol=1e-6)
    # A batch of one (std 0) gives z = 0, w = ½, never NaN; β = 0 gives ½ everywhere.
    assert sigmoid_gate(torch.tensor([3.0]), 1.0).tolist() == [0.5]
    assert sigmoid_gate(e, 0.0).unique().tolist() == [0.5]


def test_ungated_weights_are_one_and_gated_kd_hand_value():
    e = torch.tensor([0.3, 9.0, 1.0])
    assert torch.equal(ungated(e, 5.0), torch.ones(3))
    div = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    loss, w = gated_kd(div, e, "ungated")
    assert loss.item() == pytest.approx(7 / 3) and torch.equal(w, torch.ones(3))
    # Hand-weighted: E = [1, 3] -> w = [σ(1), σ(−1)] = [0.731059, 0.268941]; Σw = 1.
    loss, w = gated_kd(torch.tensor([2.0, 10.0]), torch.tensor([1.0, 3.0]), "sigmoid", 1.0)
    assert loss.item() == pytest.approx(0.731059 * 2 + 0.268941 * 10, rel=1e-5)


def test_gate_weights_are_detached():
    energy = torch.tensor([0.2, 1.5, 0.7], requires_grad=True)
    div = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    loss, w = gated_kd(div, energy, "sigmoid", 2.0)
    assert not w.requires_grad
    loss.backward()
    assert energy.grad is None  # no gradient reaches the energy through the gate
    assert torch.allclose(div.grad, w / w.sum())


def test_gate_registry():
    assert {"sigmoid", "ungated"} <= set(dict(GATES.describe()))
    assert "(ours)" in dict(GATES.describe())["sigmoid"]
    with pytest.raises(UnknownNameError, match=r"algo\.gate"):
        GATES.get("softplus")
    # A plain function works as a gate too (the paper's exact form can drop in).
    loss, w = gated_kd(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0]), lambda e, b: 1 - e)
    assert w.tolist() == [1.0, 0.0] and loss.item() == 1.0
