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
changes no number: tested to the bit).
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
    n = rows.shape[0]
    # The head sees N rounded up to a multiple of ROWS: every distinct matmul shape under
    # autocast leaves a kernel behind in torch's CPU backend, and N differs batch by batch.
    rows = torch.cat([rows, rows.new_zeros(-n % ROWS, rows.shape[1])])
    logits = hf.get_output_embeddings()(rows)[:n]  # [N, V]
    loss = F.cross_entropy(logits.float(), targets[keep])  # every kept target is scored
    return loss, CausalLMOutputWithPast(loss=loss)


def _plain_head_model(model: nn.Module) -> Any:
    """The Hugging Face model under ``model`` when the fast path computes its loss, else None."""
    hf: Any = model
    if hasattr(model, "peft_config"):  # a PeftModel: only LoRA adapters act inside the layers
        peft_cfg: Any = getattr(model, "active_peft_config", None)
        if peft_cfg is None or peft_cfg.is_prompt_learning:
            return None
        hf = hf.get_base_model()
    config = getattr(hf, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES:
        return None
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None
    return hf
