"""Batched generation with ``transformers``' ``generate``: the one generation path of fedfm.

Prompts are complete strings (see :mod:`fedfm.data.prompt`) and are tokenised with
``add_special_tokens=False``; pre-tokenised prompts (lists of ids) are accepted too. They are sorted
by length so each batch holds prompts of similar length (less padding), left-padded by hand (the
tokenizer's ``padding_side`` is never changed), generated (greedy by default), cut at the first stop
token and returned in the caller's order. Each row stops at its own end-of-turn token: finished
rows are padded while the others go on, and a batch ends when every row has stopped.

Sampling with a ``seed`` draws from a fork of the torch RNG seeded per batch with
``derive_seed(seed, "generate", first row)``: the same prompts, seed and batch size give the same
text, and the global RNG is neither used nor advanced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pydantic
import torch
from torch import nn

from fedfm.core.seeding import derive_seed
from fedfm.data.prompt import PromptConfig, stop_token_ids
from fedfm.devices import model_device
from fedfm.errors import FedfmError


class GenerationConfig(pydantic.BaseModel):
    """How text is decoded (a config section algorithms embed, e.g. ``algo.rewrite``).

    Attributes:
        max_new_tokens: Length limit of each reply.
        do_sample: Sample (``True``) or decode greedily (``False``, the default).
        temperature: Softmax temperature when sampling.
        top_p: Nucleus sampling mass when sampling (1 keeps every token); top-k is off.
        batch_size: Prompts per ``generate`` call.
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    max_new_tokens: int = pydantic.Field(64, ge=1)
    do_sample: bool = False
    temperature: float = pydantic.Field(1.0, gt=0)
    top_p: float = pydantic.Field(1.0, gt=0, le=1)
    batch_size: int = pydantic.Field(16, ge=1)

    def generate_kwargs(self) -> dict[str, Any]:
        """Decoding arguments of ``model.generate`` (the model's own defaults overridden)."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


def unwrap_bundle(bundle_or_model: Any, tokenizer: Any | None) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` from a model plus tokenizer or from an ``LMBundle``-like object."""
    if not isinstance(bundle_or_model, nn.Module) and hasattr(bundle_or_model, "model"):
        tokenizer = tokenizer if tokenizer is not None else bundle_or_model.tokenizer
        bundle_or_model = bundle_or_model.model
    if tokenizer is None:
        raise FedfmError("a tokenizer is needed: pass one or an LMBundle")
    return bundle_or_model, tokenizer


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Puts ``model`` in eval mode and restores its previous training flag afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked, so its value is irrelevant)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise FedfmError("tokenizer has neither pad_token nor eos_token")
    return int(pad)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pads id lists: ``input_ids`` and ``attention_mask``, both ``(batch, longest)``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


@dataclass(frozen=True)
class Reply:
    """One generated reply.

    Attributes:
        text: The decoded new tokens up to (excluding) the first stop token, special tokens
            skipped, surrounding whitespace stripped.
        truncated: No stop token came within ``max_new_tokens``: the reply was cut by the
            budget, not ended by the model.
    """

    text: str
    truncated: bool


def generate(
    bundle_or_model: Any,
    tokenizer: Any | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    prompt_cfg: PromptConfig | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> list[str]:
    """Continuations of ``prompts`` (greedy by default), one string per prompt, in order.

    The texts of :func:`generate_replies`; see there for the arguments.
    """
    replies = generate_replies(
        bundle_or_model,
        tokenizer,
        prompts,
        max_new_tokens,
        batch_size,
        prompt_cfg,
        seed,
        **generate_kwargs,
    )
    return [r.text for r in replies]


def generate_replies(
    bundle_or_model: Any,
    tokenizer: Any | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    batch_size: int = 8,
    prompt_cfg: PromptConfig | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> list[Reply]:
    """Replies to ``prompts`` (greedy by default), one per prompt, in order.

    Args:
        bundle_or_model: A causal LM, or an ``LMBundle`` (then ``tokenizer`` may be ``None``).
        tokenizer: Its tokenizer.
        prompts: Complete prompt strings, or token id lists.
        max_new_tokens: Generation budget per prompt.
        batch_size: Prompts per ``generate`` call.
        prompt_cfg: Decides the end-of-turn stop token (chat template or not).
        seed: Seeds sampling on a fork of the RNG (see the module doc); ``None`` samples from
            the global RNG. Greedy decoding ignores it.
        **generate_kwargs: Passed to ``model.generate``, e.g. ``do_sample=True,
            temperature=0.7`` for sampling (rewriting, synthetic data).

    Returns:
        Each prompt's :class:`Reply`: its text and whether it hit ``max_new_tokens``.
    """
    model, tokenizer = unwrap_bundle(bundle_or_model, tokenizer)
    lm: Any = model  # a transformers model: ``generate`` is not an nn.Module attribute
    if batch_size < 1 or max_new_tokens < 1:
        raise FedfmError(
            f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}"
        )
    rows = [
        list(p)
        if not isinstance(p, str)
        else list(tokenizer(p, add_special_tokens=False)["input_ids"])
        for p in prompts
    ]
    if any(not r for r in rows):
        raise FedfmError("cannot generate from an empty prompt")
    stops = stop_token_ids(tokenizer, prompt_cfg)
    pad = pad_id_of(tokenizer)
    device = model_device(model)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    outputs: list[Reply] = [Reply("", False)] * len(rows)
    with eval_mode(model), torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            ids, mask = left_pad([rows[i] for i in idx], pad)
            with _seeded(seed, start, device):
                out = lm.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=stops,
                    pad_token_id=pad,
                    **{"do_sample": False, "num_beams": 1, **generate_kwargs},
                )
            new = out[:, ids.shape[1] :].cpu()  # (batch, <= max_new_tokens)
            for row, i in zip(new.tolist(), idx, strict=True):
                outputs[i] = _decode_until_stop(tokenizer, row, stops)
    return outputs


def _seeded(
    seed: int | None, start: int, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """A fork of the CPU (and the model's CUDA) RNG seeded for the batch starting at ``start``."""
    if seed is None:
        return contextlib.nullcontext()
    cuda = [device.index or 0] if device.type == "cuda" else []

    @contextmanager
    def fork() -> Iterator[None]:
        with torch.random.fork_rng(devices=cuda):
            batch_seed = derive_seed(seed, "generate", start)
            torch.default_generator.manual_seed(batch_seed)
            if cuda:
                with torch.cuda.device(cuda[0]):
                    torch.cuda.manual_seed(batch_seed)
            yield

    return fork()


def _decode_until_stop(tokenizer: Any, ids: list[int], stops: Sequence[int]) -> Reply:
    # A row without a stop token ran the whole budget: rows that stopped early are padded
    # (with a stop or pad id) until the batch's last row stops or the budget ends.
    cut = next((k for k, t in enumerate(ids) if t in stops), None)
    text = tokenizer.decode(ids[: len(ids) if cut is None else cut], skip_special_tokens=True)
    return Reply(text.strip(), truncated=cut is None)
