"""FedRD's server modules: the reprogramming module φ and the co-trained parts.

FedRD (federated reprogramming knowledge distillation, :mod:`fedfm.algorithms.fedrd`) keeps
on the server a frozen foundation model ``F_t``, a trainable reprogramming module ``φ`` over
its features and the global student, whose Linear ``head`` is the shared head ``g``:
``f_t = φ(F_t(x))``, ``z_t = g(f_t)``, ``f_s = F_s.features(x)``, ``z_s = g(f_s)``.

Choices of ours, not made by the paper:

* ``φ`` = ``Linear(D_t, h)`` → ``blocks`` residual blocks ``x + W₂ ReLU(W₁ LN(x))`` →
  ``ReLU`` → ``Linear(h, d_s)`` → ``ReLU`` (the last ReLU because both students' features
  are post-ReLU, so ``g`` sees teacher and student features in the same range).
* The student's feature width, ``φ``'s output width and ``g``'s input width must agree;
  :func:`build_reprogrammer` and :func:`head_width` check this with both widths named.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from fedfm.errors import ConfigError


class ResidualBlock(nn.Module):
    """``x + W₂ ReLU(W₁ LayerNorm(x))`` (pre-norm residual MLP block)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class Reprogrammer(nn.Module):
    """φ: foundation-model features ``[B, in_dim]`` -> task features ``[B, out_dim]``.

    Args:
        in_dim: Width of the foundation model's features.
        out_dim: Width the shared head ``g`` reads (= the student's feature width).
        hidden: Width of the residual blocks.
        blocks: Number of residual blocks.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.proj_in = nn.Linear(in_dim, hidden)
        self.blocks = nn.Sequential(*[ResidualBlock(hidden) for _ in range(blocks)])
        self.proj_out = nn.Linear(hidden, out_dim)

    @override
    def forward(self, f: Tensor) -> Tensor:
        if f.shape[-1] != self.in_dim:
            raise ConfigError(
                "algo.reprogram_in",
                f"features of width {f.shape[-1]} fed to a reprogrammer built for {self.in_dim}",
            )
        return F.relu(self.proj_out(F.relu(self.blocks(self.proj_in(f)))))


class Student(Protocol):
    """What FedRD asks of the task's model (the student).

    Features ``f_s = features(x)`` ``[B, d_s]`` and a Linear ``head`` (the shared head g)
    over them; :func:`head_width` checks the head when the server half is built.
    """

    head: nn.Linear

    def features(self, x: Any) -> Tensor:
        """Features ``[B, d_s]`` of a batch of inputs."""
        ...


def as_student(model: nn.Module) -> Student:
    """``model`` seen as a :class:`Student` (checked when the server half is built)."""
    return cast(Student, model)


def head_width(student: nn.Module) -> int:
    """Input width of the student's head ``g``; checks the student's ``feature_dim`` agrees."""
    head = getattr(student, "head", None)
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            "task.model", f"{type(student).__name__} has no Linear 'head' to share as g"
        )
    width = getattr(student, "feature_dim", head.in_features)
    if width != head.in_features:
        raise ConfigError(
            "task.model",
            f"student feature width {width} does not match its head's input width "
            f"{head.in_features}",
        )
    return head.in_features


def build_reprogrammer(
    fm_name: str,
    fm_dim: int,
    head_in: int,
    in_dim: int | None = None,
    out_dim: int | None = None,
    hidden: int | None = None,
    blocks: int = 2,
) -> Reprogrammer:
    """Builds φ and checks the widths that must agree.

    Args:
        fm_name: Foundation model name (for messages).
        fm_dim: Width of its features.
        head_in: Input width of the shared head ``g``.
        in_dim: φ's input width; ``None`` takes ``fm_dim``.
        out_dim: φ's output width; ``None`` takes ``head_in``.
        hidden: Width of the residual blocks; ``None`` takes the output width.
        blocks: Residual blocks.

    Raises:
        ConfigError: ``in_dim`` differs from ``fm_dim`` or ``out_dim`` from ``head_in``.
    """
    in_dim = fm_dim if in_dim is None else in_dim
    out_dim = head_in if out_dim is None else out_dim
    if in_dim != fm_dim:
        raise ConfigError(
            "algo.reprogram_in",
            f"reprogramming input width {in_dim} does not match the feature width {fm_dim} "
            f"of foundation model '{fm_name}'",
        )
    if out_dim != head_in:
        raise ConfigError(
            "algo.reprogram_out",
            f"reprogramming output width {out_dim} does not match the shared head's input "
            f"width {head_in} (the student's feature width)",
        )
    return Reprogrammer(in_dim, out_dim, hidden or out_dim, blocks)


class CoTrainer(nn.Module):
    """The server's trainable parts: the student (``head`` = g) and the objective's modules.

    The objective's modules (:data:`OBJECTIVES`) are φ, a teacher head or a hint regressor.
    """

    def __init__(self, student: nn.Module, parts: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.student = student
        self.parts = nn.ModuleDict(parts or {})

    def _part(self, name: str) -> nn.Module | None:
        return dict(self.parts.items()).get(name)

    @property
    def phi(self) -> Reprogrammer | None:
        """φ, when the objective reprograms."""
        return cast(Reprogrammer | None, self._part("phi"))

    @property
    def teacher_head(self) -> nn.Linear | None:
        """The separate teacher head on raw ``F_t`` features (FedRD without φ)."""
        return cast(nn.Linear | None, self._part("thead"))

    @property
    def hint(self) -> nn.Linear | None:
        """The hint regressor ``f_s -> F_t`` feature space (Fed-Hint)."""
        return cast(nn.Linear | None, self._part("hint"))

    @property
    def has_teacher_path(self) -> bool:
        """Whether there are teacher logits ``z_t`` (φ + g, or a teacher head)."""
        return self.phi is not None or self.teacher_head is not None

    def teacher(self, feats: Tensor) -> tuple[Tensor, Tensor]:
        """Cached ``F_t(x)`` ``[B, D_t]`` -> (``f_t``, ``z_t``)."""
        if self.phi is not None:
            f_t = self.phi(feats)
            return f_t, as_student(self.student).head(f_t)
        if self.teacher_head is None:
            raise ConfigError("algo.objective", "this objective has no teacher logits z_t")
        return feats, self.teacher_head(feats)
