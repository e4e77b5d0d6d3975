"""The comparison of two final models: it fails on disjoint keys, on a perturbed tensor, on a
shape or key of one side only, and agrees on equal sets (also within a tolerance); the
benchmark maps Flower's peft parameter names to fedfm's saved keys before comparing."""

from __future__ import annotations

import math

import torch

from fedfm.core.agreement import compare_tensors


def _adapter(prefix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"{prefix}q_proj.lora_{ab}.weight": torch.randn(4, 4, generator=g) for ab in "AB"}


def test_equal_sets_agree_and_a_perturbed_tensor_differs() -> None:
    ours, theirs = _adapter(), _adapter()
    same = compare_tensors(ours, theirs, 0.0)
    assert same.ok and same.common == 2 and same.gap == 0.0
    assert same.line().startswith("agree: 2 tensors in common")
    theirs["q_proj.lora_B.weight"][1, 2] += 1e-3
    off = compare_tensors(ours, theirs, 1e-4)
    assert not off.ok and math.isclose(off.gap, 1e-3, rel_tol=1e-3)
    assert off.line().startswith("DIFFER: 2 tensors in common")
    assert compare_tensors(ours, theirs, 2e-3).ok  # within a stated tolerance


def test_disjoint_keys_a_missing_key_or_a_shape_never_agree() -> None:
    ours = _adapter()
    disjoint = compare_tensors(ours, _adapter("base_model.model."), 1.0)
    assert not disjoint.ok and disjoint.common == 0 and math.isnan(disjoint.gap)
    assert "0 tensors in common (2 only in ours, 2 only in theirs" in disjoint.line()
    fewer = dict(ours)
    del fewer["q_proj.lora_A.weight"]
    assert not compare_tensors(ours, fewer, 1.0).ok
    reshaped = {**ours, "q_proj.lora_A.weight": torch.zeros(2, 8)}
    assert not compare_tensors(ours, reshaped, 1.0).ok
    assert not compare_tensors({}, {}, 1.0).ok  # nothing compared proves nothing
