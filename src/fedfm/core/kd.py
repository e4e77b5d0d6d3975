"""Knowledge-distillation losses, private-proxy energies and trust gates, as pure functions.

Shared by the distillation methods (FedeKD's forward and backward distillation, FedRD's
server-side co-training, the ungated FML/FedKD-style baseline). Every function takes model
outputs and returns tensors; none keeps state.

Sources:
    * Hinton, Vinyals, Dean 2015, "Distilling the Knowledge in a Neural Network": softened
      softmax with temperature T and the T² factor that keeps gradient magnitudes comparable
      across temperatures.
    * Nguyen, Wang, Ku 2026, "FedeKD: Energy-Based Gating for Robust Federated Knowledge
      Distillation under Heterogeneity" (arXiv:2605.05553), eq. (1) (entropy-normalised symmetric
      KL energy, ε_H = 1e-8) and eq. (2) (half squared error energy for regression); the gate is
      "batch-normalised" and maps energy to a trust weight that falls as energy rises.

Choices of ours (the paper's text does not fix them):
    * The default gate ``sigmoid``: z = (E − mean_B E) / (std_B E + 1e-8) with the population
      standard deviation (so a batch of one gives z = 0, not NaN), w = sigmoid(−β·z).
    * Gate weights are computed from detached energies, so the gate steers the distillation
      loss without being a loss itself; a gated loss is the weight-normalised mean
      Σ w·D / Σ w.
    * For multi-output regression the energy sums the squared error over outputs.
    * The gate ``level``: w = exp(−β·E / Ē), Ē a running mean of the client's batch-mean energy
      (carried across batches and rounds), and the gated loss Σ w·D / B. Unlike the sigmoid
      gate, which standardises within the batch and renormalises by Σ w (so it can only shift
      trust between the batch's samples), it can down-weight a whole batch whose energy is
      above the client's usual level.
    * The gate ``oracle`` is a measuring bound, not a method: weight 0 on exactly the samples a
      simulation knows to be mislabelled for the proxy (``GateContext.unreliable``), 1
      elsewhere, loss Σ w·D / B; no real client knows that mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fedfm.registry import Registry

Reduction = Literal["none", "mean", "sum"]
# A gate maps per-sample energies [B] and a scale beta to non-negative trust weights [B]
# (a ContextGate also reads a GateContext).
Gate = Callable[[Tensor, float], Tensor]

ENTROPY_EPS = 1e-8  # ε_H of FedeKD eq. (1)
STD_EPS = 1e-8


def _reduce(values: Tensor, reduction: Reduction) -> Tensor:
    if reduction == "none":
        return values
    return values.sum() if reduction == "sum" else values.mean()


def _as_2d(out: Tensor) -> Tensor:
    """Regression outputs as ``[B, D]`` (a ``[B]`` vector is one output per sample)."""
    return out.unsqueeze(-1) if out.dim() == 1 else out.flatten(1)


# ----------------------------------------------------------------------------- KD losses


def kd_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """KL(q_T ‖ p_T)·T² per sample, q the teacher's and p the student's softened softmax.

    Args:
        student_logits: ``[B, C]``; gradients flow into them.
        teacher_logits: ``[B, C]``; detach them when the teacher must not learn.
        temperature: Softmax temperature T (Hinton et al. 2015).
        reduction: ``"none"`` gives ``[B]``; ``"mean"`` averages over the batch.
    """
    t = temperature
    log_p = F.log_softmax(student_logits / t, dim=-1)
    log_q = F.log_softmax(teacher_logits / t, dim=-1)
    per = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)  # [B]
    return _reduce(per * t * t, reduction)


def soft_ce(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """Cross-entropy −Σ q_T·log p_T ·T² against the teacher's soft labels (= KL + H(q_T)·T²)."""
    t = temperature
    log_p = F.log_softmax(student_logits / t, dim=-1)
    q = F.softmax(teacher_logits / t, dim=-1)
    return _reduce(-(q * log_p).sum(-1) * t * t, reduction)


def kd_mse(student_out: Tensor, teacher_out: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Squared error ‖s − t‖² per sample (summed over outputs): regression distillation."""
    per = (_as_2d(student_out) - _as_2d(teacher_out)).pow(2).sum(-1)
    return _reduce(per, reduction)


# ----------------------------------------------------------------------------- energies


def entropy(logits: Tensor) -> Tensor:
    """Shannon entropy (nats) of softmax(logits), per sample ``[B]``."""
    log_p = F.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def symmetric_kl_energy(private_logits: Tensor, proxy_logits: Tensor) -> Tensor:
    """FedeKD eq. (1): ½(KL(p‖q) + KL(q‖p)) / (H(p) + H(q) + ε_H), per sample ``[B]``.

    p = softmax(f_k(x)) (private), q = softmax(g(x)) (global proxy); symmetric in its arguments
    and 0 when the two distributions agree.
    """
    log_p = F.log_softmax(private_logits, dim=-1)
    log_q = F.log_softmax(proxy_logits, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    # KL(p‖q) + KL(q‖p) = Σ (p − q)(log p − log q): one pass, exactly 0 for identical inputs.
    sym = 0.5 * ((p - q) * (log_p - log_q)).sum(-1)
    h = -(p * log_p).sum(-1) - (q * log_q).sum(-1)
    return sym / (h + ENTROPY_EPS)


def half_squared_error_energy(private_out: Tensor, proxy_out: Tensor) -> Tensor:
    """FedeKD eq. (2): ½‖f_k(x) − g(x)‖², per sample ``[B]``."""
    return 0.5 * (_as_2d(private_out) - _as_2d(proxy_out)).pow(2).sum(-1)


# ----------------------------------------------------------------------------- gates

GATES: Registry[Gate] = Registry("gate", "algo.gate")


def standardize(energy: Tensor) -> Tensor:
    """Batch-standardised energy z = (E − mean_B E) / (std_B E + 1e-8), population std."""
    return (energy - energy.mean()) / (energy.std(unbiased=False) + STD_EPS)


@GATES.register("sigmoid", "(ours) w = sigmoid(-beta * batch-standardised energy); default")
def sigmoid_gate(energy: Tensor, beta: float) -> Tensor:
    """(ours) Trust falls smoothly as energy rises: w = sigmoid(−β·z), z batch-standardised."""
    return torch.sigmoid(-beta * standardize(energy))


@GATES.register("ungated", "w = 1 for every sample (FML / FedKD-style distillation)")
def ungated(energy: Tensor, beta: float) -> Tensor:
    """Uniform trust: every sample's distillation counts fully (β is ignored)."""
    return torch.ones_like(energy)


LEVEL_MOMENTUM = 0.9  # (ours) running mean Ē ← 0.9·Ē + 0.1·mean_B E


@dataclass
class GateContext:
    """What a context gate reads besides a batch's energies.

    Attributes:
        level: The client's running mean energy Ē before this batch (None: none seen yet);
            :func:`gated_kd` updates it with the batch's mean energy.
        unreliable: ``[B]`` bool, True on samples known to be mislabelled for the proxy
            (known only in a simulation: the oracle gate's input).
    """

    level: float | None = None
    unreliable: Tensor | None = None

    def update_level(self, energy: Tensor) -> float:
        """Folds the batch's mean energy into the running mean and returns the new level."""
        batch = float(energy.mean())
        self.level = (
            batch
            if self.level is None
            else (LEVEL_MOMENTUM * self.level + (1 - LEVEL_MOMENTUM) * batch)
        )
        return self.level


@dataclass(frozen=True)
class ContextGate:
    """A gate that reads a :class:`GateContext`.

    Its loss is normalised by the batch size (Σ w·D / B), so its weights can lower a batch's
    whole distillation, not only shift it between the batch's samples.
    """

    fn: Callable[[Tensor, float, GateContext], Tensor]

    def __call__(self, energy: Tensor, beta: float, context: GateContext | None = None) -> Tensor:
        """Weights ``[B]`` of the batch's energies (ValueError without a context)."""
        if context is None:
            raise ValueError("this gate needs a GateContext")
        return self.fn(energy, beta, context)


def _level_gate(energy: Tensor, beta: float, context: GateContext) -> Tensor:
    level = context.update_level(energy)
    return torch.exp(-beta * energy / (level + STD_EPS))


def _oracle_gate(energy: Tensor, beta: float, context: GateContext) -> Tensor:
    if context.unreliable is None:
        raise ValueError("the oracle gate needs the mask of unreliable samples")
    return (~context.unreliable.to(energy.device)).to(energy.dtype)


GATES.register(
    "level",
    "(ours) w = exp(-beta * E / running mean of E), loss normalised by batch size",
)(ContextGate(_level_gate))
GATES.register(
    "oracle", "bound, not a method: w = 0 on exactly the samples known to be unreliable"
)(ContextGate(_oracle_gate))


def gated_mean(values: Tensor, weights: Tensor) -> Tensor:
    """Σ w·v / Σ w over the batch (0 when every weight is 0)."""
    return (weights * values).sum() / weights.sum().clamp_min(1e-12)


def gated_kd(
    divergence: Tensor,
    energy: Tensor,
    gate: str | Gate = "sigmoid",
    beta: float = 1.0,
    context: GateContext | None = None,
) -> tuple[Tensor, Tensor]:
    """Energy-gated distillation loss with w = gate(E) (detached).

    Σ w·D / Σ w for a plain gate; Σ w·D / B for a :class:`ContextGate` (``level``,
    ``oracle``), which reads (and, for ``level``, updates) ``context``.

    Args:
        divergence: Per-sample distillation loss D ``[B]`` (carries the gradient).
        energy: Per-sample private-proxy energy E ``[B]``; detached here.
        gate: A name in :data:`GATES` or a gate function.
        beta: Gate scale.
        context: What a context gate reads; a fresh one when None.

    Returns:
        ``(loss, weights)``; weights ``[B]`` for logging.
    """
    fn = GATES.get(gate) if isinstance(gate, str) else gate
    if isinstance(fn, ContextGate):
        weights = fn(energy.detach(), beta, context or GateContext()).detach()
        return (weights * divergence).mean(), weights
    weights = fn(energy.detach(), beta).detach()
    return gated_mean(divergence, weights), weights
