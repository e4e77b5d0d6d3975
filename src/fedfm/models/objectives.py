"""FedRD's server objectives: what co-training adds to the student's cross-entropy.

On the public set the server minimises ``CE(y, z_s)`` plus an objective's term (FedRD,
:mod:`fedfm.algorithms.fedrd`; the modules are :mod:`fedfm.models.reprogram`):

* ``fedrd``: ``α·CE(y, z_t) + β·(KL(z_t ‖ z_s) + L_CKA(f_t, f_s))`` with ``L_CKA = −CKA``
  (linear CKA, :mod:`fedfm.core.cka`; ``f_t`` and ``f_s`` may differ in width), through φ
  and the shared head g, or through a separate teacher head on the raw features
  (``reprogram: false``).
* ``hint``: FitNets' hint ``β·mean((W f_s − F_t(x))²)`` with a learned regressor ``W``.
* ``ce``: nothing; the foundation model is never loaded.

Each objective is two pure functions: the trainable server modules it adds, and its term.

Choices of ours, not made by the paper:

* Gradients of the KL and CKA terms flow into both sides (the paper's joint
  back-propagation); ``detach_teacher: true`` makes them distil into the student only.
* KL uses a temperature ``T`` (default 1, i.e. the paper's plain KL), scaled by ``T²``
  (:func:`fedfm.core.kd.kd_kl`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from fedfm.core.cka import cka_loss
from fedfm.core.kd import kd_kl
from fedfm.models.reprogram import CoTrainer, build_reprogrammer
from fedfm.registry import Registry


class ObjectiveConfig(Protocol):
    """The fields of an algorithm's config the objectives read (FedRD's ``algo`` section)."""

    reprogram: bool
    reprogram_in: int | None
    reprogram_out: int | None
    reprogram_hidden: int | None
    reprogram_blocks: int
    alpha: float
    beta: float
    temperature: float
    detach_teacher: bool


@dataclass(frozen=True)
class Objective:
    """What the server's co-training adds to the student's cross-entropy on the public set.

    Attributes:
        uses_teacher: Whether it reads ``F_t`` (False: the foundation model is never loaded).
        teacher_path: Whether it has teacher logits ``z_t`` (what the warm-up trains).
        build: ``(cfg, fm_name, fm_dim, head_in, num_classes) -> {name: module}``, the
            objective's own trainable server modules (checkpointed under their names).
        extra: ``(cotrainer, cfg, y, f_s, z_s, feats) -> (loss, parts)``: the term added to
            ``CE(y, z_s)`` and its parts as floats (logged as ``server_<part>``).
    """

    uses_teacher: bool
    teacher_path: bool
    build: Callable[[ObjectiveConfig, str, int, int, int], dict[str, nn.Module]]
    extra: Callable[
        [CoTrainer, ObjectiveConfig, Tensor, Tensor, Tensor, Tensor],
        tuple[Tensor, dict[str, float]],
    ]


OBJECTIVES: Registry[Objective] = Registry("server objective", "algo.objective")


def _build_fedrd(
    c: ObjectiveConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    if not c.reprogram:
        return {"thead": nn.Linear(fm_dim, classes)}
    phi = build_reprogrammer(
        fm_name, fm_dim, head_in, c.reprogram_in, c.reprogram_out,
        c.reprogram_hidden, c.reprogram_blocks,
    )  # fmt: skip
    return {"phi": phi}


def _fedrd_extra(
    m: CoTrainer, c: ObjectiveConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    f_t, z_t = m.teacher(feats)
    return distillation_terms(
        y, z_s, f_s, z_t, f_t, c.alpha, c.beta, c.temperature, c.detach_teacher
    )


def hint_loss(regressed: Tensor, target: Tensor) -> Tensor:
    """FitNets' hint loss, ``‖r(f_s) − f_t‖²`` as a mean over the batch and the features.

    (The mean over features, not FitNets' ½ sum, keeps the term's scale independent of the
    teacher's width; the weight β then plays the role of the usual hint weight.)

    Args:
        regressed: The regressor's output on student features ``[B, D_t]``.
        target: The teacher's features ``[B, D_t]`` (a constant: ``F_t`` is frozen).
    """
    return F.mse_loss(regressed, target.detach())


def _build_hint(
    c: ObjectiveConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    return {"hint": nn.Linear(head_in, fm_dim)}


def _hint_extra(
    m: CoTrainer, c: ObjectiveConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    assert m.hint is not None
    loss = hint_loss(m.hint(f_s), feats)
    return c.beta * loss, {"hint": float(loss.detach())}


def _no_modules(
    c: ObjectiveConfig, fm_name: str, fm_dim: int, head_in: int, classes: int
) -> dict[str, nn.Module]:
    return {}


def _no_extra(
    m: CoTrainer, c: ObjectiveConfig, y: Tensor, f_s: Tensor, z_s: Tensor, feats: Tensor
) -> tuple[Tensor, dict[str, float]]:
    return z_s.new_zeros(()), {}


OBJECTIVES.register(
    "fedrd", "α·CE(y, z_t) + β·(KL(z_t‖z_s) + L_CKA) with φ (or a teacher head: reprogram false)"
)(Objective(True, True, _build_fedrd, _fedrd_extra))
OBJECTIVES.register("hint", "β·FitNets hint: mean (W f_s − F_t(x))² with a learned regressor W")(
    Objective(True, False, _build_hint, _hint_extra)
)
OBJECTIVES.register("ce", "nothing: the server fine-tunes the student on the public set")(
    Objective(False, False, _no_modules, _no_extra)
)


def distillation_terms(
    y: Tensor,
    z_s: Tensor,
    f_s: Tensor,
    z_t: Tensor,
    f_t: Tensor,
    alpha: float,
    beta: float,
    temperature: float = 1.0,
    detach_teacher: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """FedRD's loss without the student's CE: ``α·CE(y, z_t) + β·(KL(z_t ‖ z_s) + L_CKA)``.

    Args:
        y: Labels ``[B]``.
        z_s: Student logits ``[B, C]``.
        f_s: Student features ``[B, d_s]``.
        z_t: Teacher logits ``[B, C]``.
        f_t: Teacher features ``[B, d_t]`` (``d_t`` may differ from ``d_s``).
        alpha: Weight of the teacher's CE.
        beta: Weight of the KL and CKA terms.
        temperature: KL temperature ``T``; the KL is scaled by ``T²`` (Hinton et al. 2015).
        detach_teacher: Stop the KL and CKA gradients at the teacher side.

    Returns:
        The loss and its parts (``ce_t``, ``kl``, ``cka`` = CKA, not the loss) as floats.
    """
    ce_t = F.cross_entropy(z_t, y)
    kd_z, kd_f = (z_t.detach(), f_t.detach()) if detach_teacher else (z_t, f_t)
    kl = kd_kl(z_s, kd_z, temperature)  # KL(p_t || p_s)·T², mean over the batch
    l_cka = cka_loss(kd_f, f_s)
    parts = {"ce_t": float(ce_t.detach()), "kl": float(kl.detach()), "cka": -float(l_cka.detach())}
    return alpha * ce_t + beta * (kl + l_cka), parts
