"""A causal LM's training loss with the output head applied to the scored positions only.

Instruction tuning scores the response tokens only (labels are -100 on the prompt and the
padding), yet a Hugging Face causal LM computes the logits of every position before its loss
drops most of them: for SmolLM2 the head is 576 x 49152, about a fifth of the model's
multiply-adds per token, and its float32 logits, log-probabilities and their gradients are
the largest tensors of a training step. :func:`response_loss` runs the decoder, keeps the
hidden states of the positions whose next token is scored, and applies the head and the
cross-entropy to those alone: the same mean over the same tokens as the model's own loss
(its float32 logits, ``ignore_index`` -100), in a fraction of the time and memory. Only for
architectures whose logits are the head of the last hidden state (no scaling or soft cap)
and plain LoRA adapters; any other model gets its own forward pass and loss. The head's
rows are padded with zeros to a multiple of :data:`ROWS` (their logits dropped before the
loss): the scored count changes batch by batch, and under autocast each new matmul shape
leaves a kernel in torch's CPU backend, which grew a 100-client round's memory (padding
changes no number: tested to the bit). The head and its loss run :data:`CHUNK` rows at a
time, each chunk's gradient taken as it is computed (:class:`_ChunkedHeadLoss`): the logits of a
whole batch (and their float32 copy, log-probabilities and gradients, about 250 MB for 450
scored tokens of SmolLM2) were the largest memory of a training step; a chunk's are a seventh
of that, for the same loss and gradients to the bit (tested).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

IGNORE = -100
"""The label of a position that is not scored (Hugging Face's ``ignore_index``)."""

ROWS = 32
"""The head's row count is a multiple of this (padding rows of zeros, whose logits are dropped)."""

CHUNK = 64
"""Scored rows whose logits exist at a time (a multiple of :data:`ROWS`)."""

PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"})
"""``config.model_type`` of architectures whose logits are ``lm_head(last hidden state)``."""


def response_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Any]:
    """Mean cross-entropy of the scored next tokens, and an output carrying it.

    Args:
        model: A causal LM, bare or a ``PeftModel`` with LoRA adapters.
        batch: ``input_ids``, ``attention_mask`` and ``labels`` (each ``[B, T]``), labels -100
            where nothing is scored.

    Returns:
        ``(loss, output)``: on the fast path the output has the loss and no logits; else the
        model's own output.
    """
    hf = _plain_head_model(model)
    if hf is None or "labels" not in batch:
        out = model(**batch)
        return out.loss, out
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = hf.get_decoder()(**inputs, use_cache=False).last_hidden_state  # [B, T, H]
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = targets != IGNORE
    rows = hidden[:, :-1][keep]  # [N, H], N scored tokens
    head = hf.get_output_embeddings()
    if any(p.requires_grad for p in head.parameters()):  # a head that trains (LoRA on it)
        loss = F.cross_entropy(_logits(head, rows).float(), targets[keep])  # autograd through it
    else:
        loss = _ChunkedHeadLoss.apply(rows, targets[keep], head)  # every kept target is scored
    return loss, CausalLMOutputWithPast(loss=loss)


class _ChunkedHeadLoss(torch.autograd.Function):
    """``cross_entropy(head(rows).float(), targets)``, its gradient taken chunk by chunk.

    For a frozen head only (its weights get no gradient here). The loss is the last
    operation of a training step, so each chunk's gradient can be taken
    in the forward pass, as ``cross_entropy``'s backward would give it for an output gradient
    of 1, and only the rows' gradient (``[N, H]``) kept: no ``[N, V]`` tensor outlives its
    chunk. The backward multiplies it by the output gradient it gets (exact for 1, the
    plain ``loss.backward()``; a scaled loss rounds once more than the unchunked loss did).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, targets: Tensor, head: nn.Module) -> Tensor:
        """The mean cross-entropy of ``rows`` (``[N, H]``) against ``targets`` (``[N]``)."""
        n = rows.shape[0]
        train = rows.requires_grad
        # what nll_loss's mean backward writes at each target for an output gradient of 1
        grad_at_target = -(torch.ones((), device=rows.device) / n)
        picked: list[Tensor] = []
        grads: list[Tensor] = []
        for start in range(0, n, CHUNK):
            part = rows[start : start + CHUNK].detach().requires_grad_(train)
            with torch.enable_grad():
                logp = _log_probs(head, part)  # [k, V]
                pick = logp.gather(1, targets[start : start + CHUNK, None])  # [k, 1]
                if train:
                    grads += torch.autograd.grad(pick, part, grad_at_target.expand_as(pick))
            picked.append(pick.detach())
        if train:
            ctx.save_for_backward(torch.cat(grads))
        # nll_loss over the picked log-probabilities sums them as it would over the full rows
        return F.nll_loss(torch.cat(picked), targets.new_zeros(n))

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        """The rows' gradient, scaled by the loss's gradient."""
        (grad_rows,) = ctx.saved_tensors
        return grad_rows * grad_loss, None, None


def label_scores(model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor] | None:
    """Each label token's log-probability and whether it is the top-1 prediction; or None.

    The head is applied to the labelled positions only, :data:`CHUNK` rows at a time (scoring
    needs no logits elsewhere): the same numbers as the full logits' ``log_softmax`` and
    ``argmax`` (tested), without a ``[B, T, V]`` tensor. None where :func:`response_loss`
    would take the model's own forward pass (the caller then does too).

    Args:
        model: A causal LM, bare or a ``PeftModel`` with LoRA adapters.
        batch: ``input_ids``, ``attention_mask`` and ``labels`` (``[B, T]``, on the model's
            device), labels -100 where nothing is scored.

    Returns:
        ``(logprobs, hits)``, each ``[B, T - 1]`` aligned with ``labels[:, 1:]``: float32 (0
        where unlabelled) and bool (False where unlabelled; ties: the first index).
    """
    hf = _plain_head_model(model)
    if hf is None:
        return None
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    hidden = hf.get_decoder()(**inputs, use_cache=False).last_hidden_state  # [B, T, H]
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE
    rows, wanted = hidden[:, :-1][keep], targets[keep]  # [N, H], [N]
    head = hf.get_output_embeddings()
    picked: list[Tensor] = []
    hits: list[Tensor] = []
    for start in range(0, rows.shape[0], CHUNK):
        part, want = rows[start : start + CHUNK], wanted[start : start + CHUNK, None]
        logits = _logits(head, part)  # [k, V]
        hits.append(logits.argmax(-1) == want[:, 0])
        picked.append(F.log_softmax(logits.float(), dim=-1).gather(1, want)[:, 0])
    logp = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
    hit = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    if picked:
        logp[keep], hit[keep] = torch.cat(picked), torch.cat(hits)
    return logp, hit


def _logits(head: nn.Module, rows: Tensor) -> Tensor:
    """``head(rows)`` (``[k, V]``), the head fed ROWS-padded rows.

    Every distinct matmul shape under autocast leaves a kernel behind in torch's CPU backend,
    and the last chunk's row count differs batch by batch: rounding it up to a multiple of
    :data:`ROWS` keeps the shapes few.
    """
    k = rows.shape[0]
    padded = torch.cat([rows, rows.new_zeros(-k % ROWS, rows.shape[1])])
    out: Tensor = head(padded)[:k]
    return out


def _log_probs(head: nn.Module, rows: Tensor) -> Tensor:
    """float32 log-softmax of ``head(rows)`` (``[k, V]``, :func:`_logits`)."""
    return F.log_softmax(_logits(head, rows).float(), dim=-1)


def _plain_head_model(model: nn.Module) -> Any:
    """The Hugging Face model under ``model`` when the fast path computes its loss, else None."""
    hf: Any = model
    if hasattr(model, "peft_config"):  # a PeftModel: only LoRA adapters act inside the layers
        peft_cfg: Any = getattr(model, "active_peft_config", None)
        if peft_cfg is None or peft_cfg.is_prompt_learning:
            return None
        hf = hf.get_base_model()
    return hf if plain_head(getattr(hf, "config", None)) else None


def plain_head(config: Any) -> bool:
    """Whether a model of this config gets its loss here (logits = head(last hidden state))."""
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return False
    return getattr(config, "final_logit_softcapping", None) is None
