"""Mixed-rank LoRA aggregation against the dense Σ p_k B_k A_k computed by hand."""

from __future__ import annotations

import pytest
import torch

from fedfm.core.lora_ranks import (
    RANK_MODES,
    ClientAdapter,
    hetlora_weights,
    pad,
    rank_of,
    svd_reproject,
    truncate,
)

KEY_A = "m.q_proj.lora_A.weight"
KEY_B = "m.q_proj.lora_B.weight"


def _client(b: list[list[float]], a: list[list[float]], p: float) -> ClientAdapter:
    return ClientAdapter({KEY_A: torch.tensor(a), KEY_B: torch.tensor(b)}, p)


def _clients() -> list[ClientAdapter]:
    # out = 3, in = 2; ranks 1 and 2; weights 1/4 and 3/4.
    c1 = _client([[1.0], [0.0], [2.0]], [[1.0, 1.0]], 0.25)
    c2 = _client([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], [[2.0, 0.0], [0.0, 4.0]], 0.75)
    return [c1, c2]


def _dense() -> torch.Tensor:
    # 1/4 * [1,0,2]^T [1,1] + 3/4 * [[2,0],[0,4],[0,0]], by hand:
    return torch.tensor([[0.25 + 1.5, 0.25], [0.0, 3.0], [0.5, 0.5]])


def test_flora_stacking_is_exact() -> None:
    out = RANK_MODES.get("flora").aggregate(_clients(), 2)
    assert out[KEY_A].shape == (3, 2) and out[KEY_B].shape == (3, 3)  # rank 1 + 2
    torch.testing.assert_close(out[KEY_B] @ out[KEY_A], _dense())


def test_svd_reprojection_is_the_best_rank_r_approximation() -> None:
    dense = _dense().double()
    u, s, vh = torch.linalg.svd(dense)
    for r in (1, 2):
        out = RANK_MODES.get("svd").aggregate(_clients(), r)
        assert out[KEY_A].shape == (r, 2) and out[KEY_B].shape == (3, r)
        best = (u[:, :r] * s[:r]) @ vh[:r]  # Eckart–Young, from the dense matrix
        torch.testing.assert_close((out[KEY_B] @ out[KEY_A]).double(), best, atol=1e-6, rtol=0)


def test_svd_reprojection_pads_when_the_stack_is_thin() -> None:
    b, a = svd_reproject([torch.ones(4, 1)], [torch.ones(1, 3)], [1.0], 3)
    assert b.shape == (4, 3) and a.shape == (3, 3)
    torch.testing.assert_close(b @ a, torch.ones(4, 3))
    assert float(a[1:].abs().sum()) == 0.0


def test_zeropad_averages_padded_factors_by_example_weight() -> None:
    out = RANK_MODES.get("zeropad").aggregate(_clients(), 2)
    # By hand: B = 1/4 [[1,0],[0,0],[2,0]] + 3/4 I(3x2); A = 1/4 [[1,1],[0,0]] + 3/4 diag(2,4).
    b = torch.tensor([[1.0, 0.0], [0.0, 0.75], [0.5, 0.0]])
    a = torch.tensor([[1.75, 0.25], [0.0, 3.0]])
    torch.testing.assert_close(out[KEY_B], b)
    torch.testing.assert_close(out[KEY_A], a)
    assert not torch.allclose(out[KEY_B] @ out[KEY_A], _dense())  # the bias it is known for


def test_hetlora_weights_by_frobenius_norm() -> None:
    clients = _clients()
    n1 = (1 + 1 + 4 + 4) ** 0.5  # entries 1,1,0,0,2,2
    n2 = (4 + 16) ** 0.5  # diag(2, 4) padded
    w = hetlora_weights(clients)
    assert w == pytest.approx([n1 / (n1 + n2), n2 / (n1 + n2)])
    out = RANK_MODES.get("hetlora").aggregate(clients, 2)
    want_a = w[0] * pad(clients[0].params, 2)[KEY_A] + w[1] * clients[1].params[KEY_A]
    torch.testing.assert_close(out[KEY_A], want_a)


def test_truncate_and_pad_round_trip() -> None:
    full = _clients()[1].params
    low = truncate(full, 1)
    assert rank_of(low) == 1 and rank_of(full) == 2
    torch.testing.assert_close(pad(low, 2)[KEY_A], torch.tensor([[2.0, 0.0], [0.0, 0.0]]))


def test_other_tensors_are_averaged_by_example_weight() -> None:
    clients = [
        ClientAdapter({**c.params, "m.mag": torch.full((2,), float(i))}, c.weight)
        for i, c in enumerate(_clients())
    ]
    out = RANK_MODES.get("svd").aggregate(clients, 2)
    torch.testing.assert_close(out["m.mag"], torch.full((2,), 0.75))
