"""Aggregation of LoRA adapters whose clients hold different ranks.

A LoRA module is a pair ``B`` (out x r) and ``A`` (r x in) whose product ``B A`` is the update
of a frozen weight. Clients of different strength train adapters of different ranks ``r_k``;
the server receives client ``k``'s factors ``(B_k, A_k)`` with weight ``p_k`` and must return
one global adapter. The quantity every mode approximates is the dense weighted update
``Σ_k p_k B_k A_k``. Modes (registry :data:`RANK_MODES`):

- ``svd``: re-projection to the fixed global rank ``R`` (NVIDIA NVFlare's heterogeneous-rank
  LoRA example; the best rank-``R`` approximation by Eckart and Young, "The approximation of
  one matrix by another of lower rank", Psychometrika 1936). Computed from the factors without
  forming the dense update: QR of the stacked factors, then the SVD of the small core
  (:func:`svd_reproject`), so the cost is O((out + in) S²) with ``S = Σ r_k``, not O(out·in).
- ``flora``: FLoRA stacking (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models
  with Heterogeneous Low-Rank Adaptations", NeurIPS 2024): ``B = [p_1 B_1, ..., p_K B_K]``,
  ``A = [A_1; ...; A_K]``, so ``B A = Σ p_k B_k A_k`` exactly (:func:`flora_stack`). The price is
  the downlink: the global rank is ``Σ r_k`` per round, and grows by that much every round
  when the stacks are kept.
- ``hetlora``: HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
  Foundation Models", EMNLP 2024): each client's factors zero-padded to ``R`` and averaged with
  sparsity weights ``w_k ∝ ‖B_k A_k‖_F`` (:func:`hetlora_average`). The paper's rank
  self-pruning on the clients is not included.
- ``zeropad``: the naive baseline: zero-padded factors averaged with the example weights
  ``p_k`` (:func:`zeropad_average`); ``Σ p_k B_k · Σ p_k A_k``, not ``Σ p_k B_k A_k``.

Choices of ours: the SVD's singular values are split evenly between the factors
(``B = U √S``, ``A = √S Vᵀ``); the HetLoRA norm is taken over the client's whole adapter (all
modules together); every computation runs in float64 and is cast back to the factors' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfm.registry import Registry

A_SUFFIX = "lora_A.weight"
B_SUFFIX = "lora_B.weight"

Arrays = dict[str, Tensor]


def lora_modules(keys: Iterable[str]) -> dict[str, tuple[str, str]]:
    """LoRA modules among adapter keys: module prefix -> (A key, B key).

    Keys are peft's saved keys (``...q_proj.lora_A.weight``); a module needs both factors.
    """
    names = set(keys)
    out = {}
    for key in sorted(names):
        if key.endswith(A_SUFFIX):
            prefix = key[: -len(A_SUFFIX)]
            if prefix + B_SUFFIX in names:
                out[prefix] = (key, prefix + B_SUFFIX)
    return out


def rank_of(params: Mapping[str, Tensor]) -> int:
    """The LoRA rank of an adapter state (the rows of its first ``A``; 0 without LoRA)."""
    mods = lora_modules(params)
    if not mods:
        return 0
    a_key, _ = next(iter(mods.values()))
    return int(params[a_key].shape[0])


def truncate(params: Mapping[str, Tensor], r: int) -> Arrays:
    """The first ``r`` components of every LoRA module; other tensors unchanged.

    What a rank-``r`` client receives under HetLoRA and the re-projection.
    """
    out = dict(params)
    for a_key, b_key in lora_modules(params).values():
        out[a_key] = params[a_key][:r].clone()
        out[b_key] = params[b_key][:, :r].clone()
    return out


def pad(params: Mapping[str, Tensor], r: int) -> Arrays:
    """Every LoRA module zero-padded to rank ``r`` (components after a client's own are 0)."""
    out = dict(params)
    for a_key, b_key in lora_modules(params).values():
        a, b = params[a_key], params[b_key]
        extra = r - a.shape[0]
        if extra < 0:
            raise ValueError(f"rank {a.shape[0]} is above the padded rank {r}")
        out[a_key] = torch.cat([a, a.new_zeros(extra, a.shape[1])], dim=0)
        out[b_key] = torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)
    return out


@dataclass(frozen=True)
class ClientAdapter:
    """One client's trained adapter and its aggregation weight ``p_k`` (weights sum to 1)."""

    params: Mapping[str, Tensor]
    weight: float


def svd_reproject(
    bs: Sequence[Tensor], as_: Sequence[Tensor], ps: Sequence[float], r: int
) -> tuple[Tensor, Tensor]:
    """The best rank-``r`` factors ``(B, A)`` of ``Σ_k p_k B_k A_k``, from the factors alone.

    ``Σ p_k B_k A_k = B̂ Â`` with ``B̂ = [p_k B_k]`` (out x S) and ``Â = [A_k]`` (S x in). With
    ``B̂ = Q_B R_B`` and ``Âᵀ = Q_A R_A`` (reduced QR), ``B̂ Â = Q_B (R_B R_Aᵀ) Q_Aᵀ``; the SVD
    ``U S Vᵀ`` of the S x S core gives the SVD of the whole, whose top ``r`` terms are the
    best rank-``r`` approximation (Eckart–Young). Ranks below ``r`` are zero-padded.
    """
    dtype = bs[0].dtype
    b_hat = torch.cat([p * b.double() for b, p in zip(bs, ps, strict=True)], dim=1)
    a_hat = torch.cat([a.double() for a in as_], dim=0)
    q_b, r_b = torch.linalg.qr(b_hat)
    q_a, r_a = torch.linalg.qr(a_hat.T)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)
    k = min(r, s.numel())
    root = s[:k].sqrt()
    b = (q_b @ u[:, :k]) * root
    a = root[:, None] * (vh[:k] @ q_a.T)
    if k < r:  # fewer components than the global rank: the rest stays zero
        b = torch.cat([b, b.new_zeros(b.shape[0], r - k)], dim=1)
        a = torch.cat([a, a.new_zeros(r - k, a.shape[1])], dim=0)
    return b.to(dtype), a.to(dtype)


def flora_stack(
    bs: Sequence[Tensor], as_: Sequence[Tensor], ps: Sequence[float]
) -> tuple[Tensor, Tensor]:
    """FLoRA's stacked factors: ``B = [p_1 B_1 ... p_K B_K]``, ``A = [A_1; ...; A_K]``."""
    b = torch.cat([p * b.double() for b, p in zip(bs, ps, strict=True)], dim=1)
    return b.to(bs[0].dtype), torch.cat(list(as_), dim=0)


def _weighted_padded(clients: Sequence[ClientAdapter], weights: Sequence[float], r: int) -> Arrays:
    out: Arrays = {}
    for c, w in zip(clients, weights, strict=True):
        for key, t in pad(c.params, r).items():
            acc = out.get(key)
            out[key] = w * t.double() if acc is None else acc + w * t.double()
    ref = clients[0].params
    return {k: v.to(ref[k].dtype) for k, v in out.items()}


def zeropad_average(clients: Sequence[ClientAdapter], r: int) -> Arrays:
    """The naive baseline: every client's factors zero-padded to ``r``, averaged by ``p_k``."""
    return _weighted_padded(clients, [c.weight for c in clients], r)


def hetlora_weights(clients: Sequence[ClientAdapter]) -> list[float]:
    """HetLoRA's sparsity weights: ``‖ΔW_k‖_F`` over the client's modules, normalised to 1."""
    norms = []
    for c in clients:
        sq = 0.0
        for a_key, b_key in lora_modules(c.params).values():
            prod = c.params[b_key].double() @ c.params[a_key].double()
            sq += float((prod * prod).sum())
        norms.append(sq**0.5)
    total = sum(norms)
    if total == 0.0:  # every update is zero (B = 0 everywhere): no client stands out
        return [1.0 / len(clients)] * len(clients)
    return [n / total for n in norms]


def hetlora_average(clients: Sequence[ClientAdapter], r: int) -> Arrays:
    """HetLoRA: zero-padded factors averaged with the sparsity weights (:func:`hetlora_weights`)."""
    return _weighted_padded(clients, hetlora_weights(clients), r)


def _by_module(
    clients: Sequence[ClientAdapter],
    r: int,
    combine: Callable[[list[Tensor], list[Tensor], list[float]], tuple[Tensor, Tensor]],
) -> Arrays:
    """Applies ``combine`` to each LoRA module's factors; other tensors averaged by ``p_k``."""
    ps = [c.weight for c in clients]
    ref = clients[0].params
    mods = lora_modules(ref)
    lora_keys = {k for pair in mods.values() for k in pair}
    out: Arrays = {
        key: sum(
            (p * c.params[key].double() for c, p in zip(clients, ps, strict=True)),
            torch.zeros_like(ref[key], dtype=torch.float64),
        ).to(ref[key].dtype)
        for key in ref
        if key not in lora_keys
    }
    for a_key, b_key in mods.values():
        b, a = combine([c.params[b_key] for c in clients], [c.params[a_key] for c in clients], ps)
        out[a_key], out[b_key] = a, b
    return out


def svd_aggregate(clients: Sequence[ClientAdapter], r: int) -> Arrays:
    """Re-projection: each module's ``Σ p_k B_k A_k`` at its best rank ``r``."""
    return _by_module(clients, r, lambda bs, as_, ps: svd_reproject(bs, as_, ps, r))


def flora_aggregate(clients: Sequence[ClientAdapter], r: int) -> Arrays:
    """FLoRA: each module's stacked factors, rank ``Σ r_k`` (``r`` is not used)."""
    return _by_module(clients, r, flora_stack)


Aggregate = Callable[[Sequence[ClientAdapter], int], Arrays]


@dataclass(frozen=True)
class RankMode:
    """How adapters of different ranks are combined.

    Attributes:
        aggregate: Client adapters and the global rank -> the global adapter.
        exact: The global adapter's product equals ``Σ p_k B_k A_k`` exactly.
        caps_rank: Client ranks may not exceed the global rank (they are projected or padded).
    """

    aggregate: Aggregate
    exact: bool
    caps_rank: bool


RANK_MODES: Registry[RankMode] = Registry("LoRA rank aggregation", "task.lora.rank_mode")
RANK_MODES.register("svd", "re-projection of Σ p_k B_k A_k to the global rank (NVFlare)")(
    RankMode(svd_aggregate, exact=False, caps_rank=True)
)
RANK_MODES.register("flora", "FLoRA stacking: exact Σ p_k B_k A_k, rank Σ r_k (NeurIPS 2024)")(
    RankMode(flora_aggregate, exact=True, caps_rank=False)
)
RANK_MODES.register("hetlora", "HetLoRA: zero-padding, sparsity-weighted (EMNLP 2024)")(
    RankMode(hetlora_average, exact=False, caps_rank=True)
)
RANK_MODES.register("zeropad", "naive zero-padded factor averaging (baseline)")(
    RankMode(zeropad_average, exact=False, caps_rank=True)
)
