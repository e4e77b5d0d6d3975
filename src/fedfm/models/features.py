"""All-layer features of texts: one hidden state per layer, embedding output included.

FedHDS (Qin et al., arXiv:2410.10926) represents each sample by the last token's hidden
state of every layer of the LLM, embedding output included; FedHDS-Turbo takes them from a
small separate model. Here they are a capability of a text encoder of the encoder registry
(:attr:`fedfm.models.encoders.Encoder.layers`, a :class:`LayerStack`):
``features(texts, layers=None, batch_size=16, pool="last") -> (n, len(layers), hidden)``.

* A causal LM (:func:`causal_lm_layers`): the LLM of a :class:`~fedfm.fm.FoundationModel`
  with a chosen adapter set, or a separate small one: hidden state ``0`` is the embedding
  output and ``l`` the output of decoder layer ``l``; as in transformers, the last one is taken
  after the final norm.
* A sentence-transformers encoder such as MiniLM (:func:`sentence_encoder_layers`): its
  transformer's embedding output and each layer's output, tokenised with the encoder's own
  special tokens.

Only the backbone runs (``model.model`` of a ``LlamaForCausalLM``, the ``auto_model`` of a
sentence encoder): the LM head is never computed. Texts are right-padded in batches of
similar length; ``pool="last"`` takes each row's last non-padding token, ``"mean"`` the mean
over its non-padding tokens. Results do not depend on the batch size beyond float error.

Each stack has its own pooling (:attr:`LayerStack.pool`, used when a call names none): a
causal LM's last token, the only position that has attended to the whole text (what the
FedHDS paper describes); a bidirectional BERT-style encoder's mean over its non-padding
tokens, special tokens included, as sentence-transformers pools all-MiniLM-L6-v2 and as the
FedHDS reference code averages tokens by default (its ``feature_token="avg"``). A BERT-style
encoder's last token is its ``[SEP]``, the same token closing every text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import peft
import torch
from torch import Tensor, nn

from fedfm.devices import model_device
from fedfm.errors import ConfigError
from fedfm.models.generation import eval_mode, pad_id_of

Pool = Literal["last", "mean"]
Texts = Sequence[str] | Sequence[Sequence[int]]
"""Texts, or token id lists taken as they are."""
Scope = Callable[[], contextlib.AbstractContextManager[Any]]
"""A context entered around forward passes (bfloat16 autocast, a set of active adapters)."""


def check_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Layer indices in ``0..num_layers`` (negative ones count from the end), validated.

    Raises:
        ConfigError: An index is out of range (field ``features.layers``).
    """
    if layers is None:
        return list(range(num_layers + 1))
    if len(layers) == 0:
        raise ConfigError("features.layers", "at least one layer is needed")
    out = []
    for layer in layers:
        if not -(num_layers + 1) <= int(layer) <= num_layers:
            raise ConfigError(
                "features.layers",
                f"layer {layer} is out of range: the model has hidden states 0..{num_layers} "
                "(0 is the embedding output)",
            )
        out.append(int(layer) % (num_layers + 1))
    return out


def pool_rows(hidden: Tensor, mask: Tensor, pool: Pool) -> Tensor:
    """Pools ``(B, T, H)`` hidden states of right- or left-padded rows into ``(B, H)``.

    ``last``: the state at each row's last non-padding position; ``mean``: the mean over its
    non-padding positions.
    """
    if pool == "last":
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (mask * positions).argmax(dim=1)  # (B,): index of the last 1 in each row
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pool == "mean":
        weights = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)
    raise ConfigError("features.pool", f"must be 'last' or 'mean', got {pool!r}")


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask``, both ``(B, longest)``, padded on the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def layer_features(
    backbone: nn.Module,
    rows: Sequence[Sequence[int]],
    num_layers: int,
    pad_id: int,
    layers: Sequence[int] | None = None,
    batch_size: int = 16,
    pool: Pool = "last",
    autocast: Scope = contextlib.nullcontext,
) -> Tensor:
    """Pooled hidden states of token rows from a backbone that returns ``hidden_states``.

    Args:
        backbone: A transformer without its head, called as
            ``backbone(input_ids=, attention_mask=, output_hidden_states=True)``.
        rows: Token ids of each text (non-empty).
        num_layers: Transformer layers of the backbone.
        pad_id: Padding id (masked, so its value does not matter).
        layers: Hidden states to keep (``0``: embedding output); all when ``None``.
        batch_size: Rows per forward pass.
        pool: ``"last"`` non-padding token or ``"mean"`` over non-padding tokens.
        autocast: Context for each forward pass (e.g. bfloat16 autocast).

    Returns:
        ``(len(rows), len(layers), hidden)`` float32 CPU tensor, in the order of ``rows``.

    Raises:
        ConfigError: A layer index is out of range (``features.layers``), ``batch_size`` is
            not positive (``features.batch_size``) or a row is empty (``features.texts``).
    """
    keep = check_layers(layers, num_layers)
    if batch_size < 1:
        raise ConfigError("features.batch_size", f"must be >= 1, got {batch_size}")
    if any(len(r) == 0 for r in rows):
        raise ConfigError("features.texts", "cannot take features of an empty text")
    if not rows:
        return torch.zeros((0, len(keep), 0))
    device = model_device(backbone)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths per batch
    out: list[Tensor] = [torch.empty(0)] * len(rows)
    with eval_mode(backbone), torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            ids, mask = right_pad([rows[i] for i in idx], pad_id)
            ids, mask = ids.to(device), mask.to(device)
            with autocast():
                states = backbone(
                    input_ids=ids, attention_mask=mask, output_hidden_states=True
                ).hidden_states
            if len(states) != num_layers + 1:
                raise ConfigError(
                    "features.model", f"expected {num_layers + 1} hidden states, got {len(states)}"
                )
            pooled = torch.stack([pool_rows(states[k], mask, pool) for k in keep], dim=1)
            for row, i in zip(pooled.float().cpu(), idx, strict=True):  # (len(keep), H)
                out[i] = row
    return torch.stack(out)


def causal_backbone(model: nn.Module) -> nn.Module:
    """The decoder without its LM head, LoRA layers included when ``model`` is a PeftModel."""
    if isinstance(model, peft.PeftModel):
        model = model.get_base_model()
    backbone = getattr(model, "base_model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        raise ConfigError("features.model", f"{type(model).__name__} has no separate backbone")
    return backbone


@dataclass
class LayerStack:
    """Every layer's hidden states of a transformer backbone, pooled per text.

    Attributes:
        backbone: The transformer without its head.
        tokenize: Texts -> token ids of each (token id lists are taken as they are).
        pad_id: Padding id (masked, so its value does not matter).
        autocast: Context for each forward pass.
        scope: Context around a whole call (e.g. a foundation model's active adapters).
        pool: The pooling of this kind of model, used when a call names none: ``"last"`` for
            a causal LM, ``"mean"`` for a bidirectional encoder (see the module doc).
    """

    backbone: nn.Module
    tokenize: Callable[[Texts], list[list[int]]]
    pad_id: int
    autocast: Scope = contextlib.nullcontext
    scope: Scope = contextlib.nullcontext
    pool: Pool = "last"

    @property
    def num_layers(self) -> int:
        """Transformer layers; features have ``num_layers + 1`` entries (embeddings first)."""
        config: Any = self.backbone.config
        return int(config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        """Width of each hidden state."""
        config: Any = self.backbone.config
        return int(config.hidden_size)

    def features(
        self,
        texts: Texts,
        layers: Sequence[int] | None = None,
        batch_size: int = 16,
        pool: Pool | None = None,
    ) -> Tensor:
        """``(n, len(layers), hidden)`` float32 CPU features.

        Every layer when ``None`` (see :func:`layer_features`); pooled by ``pool``, or by
        this stack's own :attr:`pool` when ``None``.
        """
        with self.scope():
            rows = self.tokenize(texts)
            return layer_features(
                self.backbone, rows, self.num_layers, self.pad_id, layers, batch_size,
                pool or self.pool, self.autocast,
            )  # fmt: skip


def causal_lm_layers(
    model: nn.Module,
    tokenizer: Any,
    max_length: int | None = None,
    autocast: Scope = contextlib.nullcontext,
    scope: Scope = contextlib.nullcontext,
) -> LayerStack:
    """The all-layer features of a causal LM.

    Args:
        model: A ``transformers`` causal LM, or a ``PeftModel`` around one (adapters as active).
        tokenizer: Its tokenizer; texts are complete strings, tokenised without added special
            tokens (fedfm's convention for causal LMs).
        max_length: Keep only the last ``max_length`` tokens of a longer text (the last token's
            state is what ``pool="last"`` reads); ``None`` keeps all.
        autocast: Context for each forward pass.
        scope: Context around each call.
    """

    def tokenize(texts: Texts) -> list[list[int]]:
        rows = [
            list(tokenizer(t, add_special_tokens=False)["input_ids"]) if isinstance(t, str)
            else list(t)
            for t in texts
        ]  # fmt: skip
        return [r[-max_length:] for r in rows] if max_length else rows

    return LayerStack(causal_backbone(model), tokenize, pad_id_of(tokenizer), autocast, scope)


def sentence_encoder_layers(encoder: Any) -> LayerStack:
    """The all-layer features of a sentence-transformers encoder (e.g. all-MiniLM-L6-v2).

    Texts are tokenised by the encoder's tokenizer with its special tokens (``[CLS] ... [SEP]``
    for BERT-like models) and cut to its ``max_seq_length``. The stack pools by the mean over
    each text's non-padding tokens, as sentence-transformers does (``pool="last"`` would read
    the ``[SEP]`` token).

    Args:
        encoder: A loaded ``SentenceTransformer`` whose first module is a Transformer.
    """
    first = encoder[0]
    tokenizer = encoder.tokenizer
    max_length = int(getattr(first, "max_seq_length", None) or 512)

    def tokenize(texts: Texts) -> list[list[int]]:
        return [
            list(tokenizer(t, truncation=True, max_length=max_length)["input_ids"])
            if isinstance(t, str)
            else list(t)
            for t in texts
        ]

    return LayerStack(first.auto_model, tokenize, pad_id_of(tokenizer), pool="mean")
