"""All-layer features of texts: one hidden state per layer, embedding output included.

FedHDS (Qin et al., arXiv:2410.10926) represents each sample by the last token's hidden
state of every layer of the LLM, embedding output included; FedHDS-Turbo takes them from a
small separate model. Every feature model here has one interface, :class:`LayerFeatures`:
``features(texts, layers=None, batch_size=16, pool="last") -> (n, len(layers), hidden)``.

* The causal LM of a :class:`~fedfm.fm.FoundationModel` (with a chosen adapter set), or a
  separate small causal LM (:class:`CausalLMFeatures`): hidden state ``0`` is the embedding
  output and ``l`` the output of decoder layer ``l``; as in transformers, the last one is taken
  after the final norm.
* A sentence-transformers encoder such as MiniLM (:class:`EncoderFeatures`): its transformer's
  embedding output and each layer's output, tokenised with the encoder's own special tokens.

Only the backbone runs (``model.model`` of a ``LlamaForCausalLM``, the ``auto_model`` of a
sentence encoder): the LM head is never computed. Texts are right-padded in batches of
similar length; ``pool="last"`` takes each row's last non-padding token, ``"mean"`` the mean
over its non-padding tokens. Results do not depend on the batch size beyond float error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import peft
import torch
from torch import Tensor, nn

from fedfm.devices import model_device
from fedfm.errors import ConfigError
from fedfm.models.generation import eval_mode, pad_id_of

Pool = Literal["last", "mean"]


class LayerFeatures(Protocol):
    """What FedHDS-like methods need from a feature model."""

    @property
    def num_layers(self) -> int:
        """Transformer layers; features have ``num_layers + 1`` entries (embeddings first)."""
        ...

    @property
    def hidden_size(self) -> int:
        """Width of each hidden state."""
        ...

    def features(
        self,
        texts: Sequence[str] | Sequence[Sequence[int]],
        layers: Sequence[int] | None = None,
        batch_size: int = 16,
        pool: Pool = "last",
    ) -> Tensor:
        """``(n, len(layers), hidden)`` float32 CPU features; every layer when ``None``."""
        ...


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
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
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


class BackboneFeatures:
    """The :class:`LayerFeatures` of a transformer backbone; subclasses say how texts become
    token ids (:meth:`rows`).

    Args:
        backbone: The transformer without its head.
        tokenizer: Its tokenizer (for the pad id and in :meth:`rows`).
        autocast: Context for each forward pass.
    """

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: Any,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.autocast = autocast
        config: Any = backbone.config
        self._layers = int(config.num_hidden_layers)
        self._hidden = int(config.hidden_size)

    @property
    def num_layers(self) -> int:
        return self._layers

    @property
    def hidden_size(self) -> int:
        return self._hidden

    def rows(self, texts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each text (token id lists are taken as they are)."""
        raise NotImplementedError

    def features(
        self,
        texts: Sequence[str] | Sequence[Sequence[int]],
        layers: Sequence[int] | None = None,
        batch_size: int = 16,
        pool: Pool = "last",
    ) -> Tensor:
        return layer_features(
            self.backbone,
            self.rows(texts),
            self._layers,
            pad_id_of(self.tokenizer),
            layers,
            batch_size,
            pool,
            self.autocast,
        )


class CausalLMFeatures(BackboneFeatures):
    """All-layer features from a causal LM (e.g. a small separate model for FedHDS-Turbo).

    Args:
        model: A ``transformers`` causal LM, or a ``PeftModel`` around one (adapters as active).
        tokenizer: Its tokenizer; texts are complete strings, tokenised without added special
            tokens (fedfm's convention for causal LMs).
        max_length: Keep only the last ``max_length`` tokens of a longer text (the last token's
            state is what ``pool="last"`` reads); ``None`` keeps all.
        autocast: Context for each forward pass.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        max_length: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        super().__init__(causal_backbone(model), tokenizer, autocast)
        self.max_length = max_length

    def rows(self, texts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each text, cut to the last ``max_length`` tokens."""
        rows = [
            list(self.tokenizer(t, add_special_tokens=False)["input_ids"])
            if isinstance(t, str)
            else list(t)
            for t in texts
        ]
        return [r[-self.max_length :] for r in rows] if self.max_length else rows


class EncoderFeatures(BackboneFeatures):
    """All-layer features from a sentence-transformers encoder (e.g. all-MiniLM-L6-v2).

    Texts are tokenised by the encoder's tokenizer with its special tokens (``[CLS] ... [SEP]``
    for BERT-like models) and cut to its ``max_seq_length``; ``pool="last"`` therefore reads
    the ``[SEP]`` token, ``pool="mean"`` averages every token as sentence-transformers does.

    Args:
        encoder: A loaded ``SentenceTransformer`` whose first module is a Transformer.
    """

    def __init__(self, encoder: Any) -> None:
        first = encoder[0]
        super().__init__(first.auto_model, encoder.tokenizer)
        self.max_length = int(getattr(first, "max_seq_length", None) or 512)

    def rows(self, texts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each text with the encoder's special tokens, cut to its length."""
        return [
            list(self.tokenizer(t, truncation=True, max_length=self.max_length)["input_ids"])
            if isinstance(t, str)
            else list(t)
            for t in texts
        ]


def load_feature_model(name: str, device: Any = None, **args: Any) -> LayerFeatures:
    """A separate feature model from the model registry.

    Args:
        name: A causal LM (``tiny-llama``, ``smollm2-135m-instruct``, ``causal-lm`` with
            ``name_or_path``) or a sentence encoder (``all-minilm-l6-v2``,
            ``sentence-encoder``).
        device: Where the model computes (a ``torch.device``; the CPU when ``None``);
            features come back on the CPU either way.
        **args: Arguments of the registry builder.

    Raises:
        ConfigError: ``name`` is unknown or not a text model (field ``features.model``).
    """
    from sentence_transformers import SentenceTransformer

    from fedfm.models.causal_lm import LMBundle
    from fedfm.models.registry import build_model

    built = build_model(name, **args)
    if isinstance(built, LMBundle):
        if device is not None:
            torch.nn.Module.to(built.model, device)  # in place (transformers types .to narrowly)
        return CausalLMFeatures(built.model, built.tokenizer)
    if isinstance(built, SentenceTransformer):
        return EncoderFeatures(built.to(device) if device is not None else built)
    raise ConfigError("features.model", f"'{name}' gives no text features")
