"""Instruction formatting, tokenisation and batching for causal language models.

A row ``(instruction, input, output)`` becomes one user turn (the instruction, then the input
after a blank line when non-empty) rendered with the tokenizer's chat template and
``add_generation_prompt=True`` (ChatML for SmolLM2). Without a template, or with
``use_chat_template=False``, the Alpaca prompt (Taori et al., 2023, "Stanford Alpaca") is used.

Conventions that every trainer and evaluator in fedfm shares:

* A prompt string is complete: it is tokenised with ``add_special_tokens=False`` everywhere
  (chat templates write their own special tokens; the Alpaca fallback writes the BOS text itself
  when the tokenizer is configured to add one), so training and generation see identical prompt
  tokens.
* The response is tokenised on its own and followed by the end-of-turn token (``<|im_end|>`` for
  ChatML, otherwise ``eos``). Labels are ``-100`` on every prompt token, so the loss falls on the
  response tokens and the end-of-turn token only.
* Truncation: the prompt is cut to ``max_prompt_length`` tokens by removing tokens from the *end of
  the user text* (the input first, then the instruction), keeping the template's own tokens (system
  turn, role headers, generation prompt) intact; then the response is cut from the right to fit
  ``max_length``. A cut response keeps no end-of-turn token (teaching the model to stop at an
  arbitrary cut would teach it to stop early). Because ``max_prompt_length < max_length`` is
  enforced, a non-empty response always keeps at least one token.
* Rows with an empty (or whitespace-only) response are dropped: :func:`encode_example` returns
  ``None`` for them and :func:`encode_dataset` filters them out.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pydantic
import torch
from torch import Tensor

# Re-exported: the batch format every trainer and evaluator shares lives in the core.
from fedfm.core.batching import IGNORE_INDEX as IGNORE_INDEX
from fedfm.core.batching import collate as collate
from fedfm.errors import ConfigError, FedfmError

ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request."
)
ALPACA_PREAMBLE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request."
)

_SENTINEL = "\x00fedfm-response\x00"


class PromptConfig(pydantic.BaseModel):
    """How instruction rows are turned into token sequences.

    Attributes:
        max_length: Maximum tokens of prompt + response.
        max_prompt_length: Maximum prompt tokens (must be smaller than ``max_length``).
        system: System message; ``None`` keeps the template's default (SmolLM2's template adds
            its own system turn).
        use_chat_template: Use the tokenizer's chat template when it has one; ``False`` forces the
            Alpaca prompt.
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    max_length: int = pydantic.Field(256, ge=2)
    max_prompt_length: int = pydantic.Field(192, ge=1)
    system: str | None = None
    use_chat_template: bool = True

    @pydantic.model_validator(mode="after")
    def _prompt_shorter_than_total(self) -> PromptConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be smaller than max_length "
                f"({self.max_length}) so that every response keeps at least one token"
            )
        return self


def build_messages(instruction: str, input: str = "", system: str | None = None) -> list[dict]:
    """Chat messages for one row: an optional system turn and one user turn.

    Args:
        instruction: Task instruction.
        input: Optional context, appended to the user turn after a blank line when non-empty.
        system: Optional system message.

    Returns:
        ``[{"role": ..., "content": ...}, ...]`` ready for ``apply_chat_template``.
    """
    content = f"{instruction}\n\n{input}" if input else instruction
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": content})
    return messages


def uses_chat_template(tokenizer: Any, cfg: PromptConfig) -> bool:
    """Whether prompts for ``tokenizer`` are rendered with its chat template."""
    return cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(
    tokenizer: Any, instruction: str, input: str = "", cfg: PromptConfig | None = None
) -> str:
    """The complete prompt string, ending where the model's answer starts (no truncation).

    Args:
        tokenizer: A transformers tokenizer.
        instruction: Task instruction.
        input: Optional context.
        cfg: Prompt settings (defaults when ``None``).

    Returns:
        The chat-template rendering with ``add_generation_prompt=True``, or the Alpaca prompt.
    """
    cfg = cfg or PromptConfig()
    if uses_chat_template(tokenizer, cfg):
        return tokenizer.apply_chat_template(
            build_messages(instruction, input, cfg.system),
            tokenize=False,
            add_generation_prompt=True,
        )
    preamble = cfg.system or (ALPACA_PREAMBLE_INPUT if input else ALPACA_PREAMBLE)
    bos = tokenizer.bos_token if getattr(tokenizer, "add_bos_token", False) else None
    text = f"{bos or ''}{preamble}\n\n### Instruction:\n{instruction}\n\n"
    if input:
        text += f"### Input:\n{input}\n\n"
    return text + "### Response:\n"


def end_of_turn_token(tokenizer: Any, cfg: PromptConfig | None = None) -> str:
    """The token that closes an assistant turn (``<|im_end|>`` for ChatML), else ``eos``.

    It is read off the chat template: an assistant turn is rendered around a sentinel and the first
    piece after the sentinel is taken when it is a single token of the vocabulary.
    """
    cfg = cfg or PromptConfig()
    if uses_chat_template(tokenizer, cfg):
        rendered = tokenizer.apply_chat_template(
            [*build_messages("x"), {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
        tail = rendered.split(_SENTINEL, 1)[1].strip() if _SENTINEL in rendered else ""
        for token in [tail, *tail.split()]:
            ids = tokenizer(token, add_special_tokens=False)["input_ids"] if token else []
            if len(ids) == 1:
                return token
    if tokenizer.eos_token is None:
        raise FedfmError("tokenizer has neither an end-of-turn token in its template nor eos_token")
    return tokenizer.eos_token


def stop_token_ids(tokenizer: Any, cfg: PromptConfig | None = None) -> list[int]:
    """Token ids that end a generation: the end-of-turn token and ``eos`` (deduplicated)."""
    ids = [tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer, cfg))]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_prompt(
    tokenizer: Any, instruction: str, input: str = "", cfg: PromptConfig | None = None
) -> tuple[str, list[int]]:
    """The prompt string and its token ids, cut to ``cfg.max_prompt_length`` tokens.

    Tokens are removed from the end of the user text (the input first, then the instruction); the
    template's own tokens stay. The cut text is re-rendered and re-tokenised, so the returned ids
    are exactly the tokenisation of the returned string.

    Raises:
        ConfigError: The template alone is longer than ``max_prompt_length``.
    """
    cfg = cfg or PromptConfig()
    text = format_prompt(tokenizer, instruction, input, cfg)
    ids = _ids(tokenizer, text)
    if len(ids) <= cfg.max_prompt_length:
        return text, ids
    inst_ids, inp_ids = _ids(tokenizer, instruction), _ids(tokenizer, input)
    n_content = len(inst_ids) + len(inp_ids)
    cut = len(ids) - cfg.max_prompt_length
    # Re-tokenising cut text can merge differently at the cut, so shave until it fits.
    while True:
        if cut > n_content:
            raise ConfigError(
                "prompt.max_prompt_length",
                f"{cfg.max_prompt_length} tokens cannot hold the prompt template itself",
            )
        keep_inp = max(len(inp_ids) - cut, 0)
        keep_inst = len(inst_ids) - max(cut - len(inp_ids), 0)
        inst = tokenizer.decode(inst_ids[:keep_inst])
        inp = tokenizer.decode(inp_ids[:keep_inp])
        text = format_prompt(tokenizer, inst, inp, cfg)
        ids = _ids(tokenizer, text)
        if len(ids) <= cfg.max_prompt_length:
            break
        cut += len(ids) - cfg.max_prompt_length
    return text, ids


def chat_prompt(tokenizer: Any, user: str, system: str | None, cfg: PromptConfig) -> str:
    """One user turn (after an optional system turn) rendered so that the reply comes next.

    With a chat template: the template with ``add_generation_prompt=True``; ``system=None``
    falls back to ``cfg.system`` and then to the template's own default. Without one:
    ``system``, a blank line and ``user``.
    """
    system = system if system is not None else cfg.system
    if uses_chat_template(tokenizer, cfg):
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token if getattr(tokenizer, "add_bos_token", False) else None
    return f"{bos or ''}{system}\n\n{user}" if system else f"{bos or ''}{user}"


MIDDLE_CUT = " ... "
"""What replaces the tokens :func:`fit_template` removes from the middle of a field."""


def fit_template(
    tokenizer: Any,
    template: str,
    fields: Mapping[str, str],
    cfg: PromptConfig,
    system: str | None = None,
    cut: Sequence[str] = (),
) -> tuple[str, list[int]]:
    r"""A prompt from a user-turn template, cut to ``cfg.max_prompt_length`` tokens in the middle.

    ``template.format(**fields)`` is the user turn, rendered by :func:`chat_prompt`. When it is
    too long, tokens are removed from the **middle** of the fields named in ``cut``, one field
    after the other in that order (a field is emptied before the next is touched), and the
    removed span is marked with :data:`MIDDLE_CUT`. The template's own text, the chat
    template's tokens and every field not named in ``cut`` are never cut, so a marker that
    ends the template (``"### Response:\n"``) always survives, as do the head and the tail of
    a cut field. (FedSD's rewrite prompt is never cut: a reader that must restate a reference
    is given all of it, or the row falls back; see :mod:`fedfm.algorithms.fedsd`.)

    Returns:
        The prompt string and its token ids (the exact tokenisation of the string).

    Raises:
        ConfigError: The prompt cannot fit even with every ``cut`` field emptied (field
            ``prompt.max_prompt_length``), or ``cut`` names a field not in ``fields``.
    """
    unknown = [name for name in cut if name not in fields]
    if unknown:
        raise ConfigError("prompt.cut", f"fields {unknown} are not template fields")
    current = {name: str(value) for name, value in fields.items()}
    field_ids = {name: _ids(tokenizer, current[name]) for name in cut}
    removed = dict.fromkeys(cut, 0)
    text = chat_prompt(tokenizer, template.format(**current), system, cfg)
    ids = _ids(tokenizer, text)
    # Re-tokenising cut text can merge differently at the cut, so shave until it fits.
    while len(ids) > cfg.max_prompt_length:
        name = next((n for n in cut if removed[n] < len(field_ids[n])), None)
        if name is None:
            raise ConfigError(
                "prompt.max_prompt_length",
                f"{cfg.max_prompt_length} tokens cannot hold the template without its cut fields",
            )
        removed[name] = min(len(field_ids[name]), removed[name] + len(ids) - cfg.max_prompt_length)
        current[name] = _cut_middle(tokenizer, field_ids[name], removed[name])
        text = chat_prompt(tokenizer, template.format(**current), system, cfg)
        ids = _ids(tokenizer, text)
    return text, ids


def _cut_middle(tokenizer: Any, ids: list[int], drop: int) -> str:
    """The text of ``ids`` without ``drop`` tokens from its middle (head kept one longer)."""
    keep = len(ids) - drop
    if keep <= 0:
        return ""
    if drop == 0:
        return tokenizer.decode(ids)
    head, tail = (keep + 1) // 2, keep // 2
    return tokenizer.decode(ids[:head]) + MIDDLE_CUT + tokenizer.decode(ids[len(ids) - tail :])


def encode_example(
    tokenizer: Any,
    instruction: str,
    input: str,
    output: str,
    cfg: PromptConfig | None = None,
) -> dict[str, list[int]] | None:
    """Token ids, attention mask and response-only labels for one training row.

    Args:
        tokenizer: A transformers tokenizer.
        instruction: Task instruction.
        input: Optional context ("" when none).
        output: Reference response.
        cfg: Prompt settings.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}`` (lists of equal length, labels ``-100`` on
        the prompt), or ``None`` when the response is empty (such rows are dropped).
    """
    cfg = cfg or PromptConfig()
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer, cfg))
    return _encode(tokenizer, instruction, input, output, cfg, end_id)


def _encode(
    tokenizer: Any, instruction: str, input: str, output: str, cfg: PromptConfig, end_id: int
) -> dict[str, list[int]] | None:
    if not output or not output.strip():
        return None
    _, prompt_ids = fit_prompt(tokenizer, instruction, input, cfg)
    response_ids = [*_ids(tokenizer, output), end_id]
    response_ids = response_ids[: cfg.max_length - len(prompt_ids)]
    input_ids = prompt_ids + response_ids
    return {
        "input_ids": input_ids,
        "attention_mask": [1] * len(input_ids),
        "labels": [IGNORE_INDEX] * len(prompt_ids) + response_ids,
    }


def encode_dataset(tokenizer: Any, dataset: Any, cfg: PromptConfig | None = None) -> Any:
    """Encodes a ``datasets.Dataset`` of ``instruction, input, output`` rows for training.

    Rows with an empty response are dropped; every original column is kept beside the new
    ``input_ids``, ``attention_mask`` and ``labels`` columns.
    """
    cfg = cfg or PromptConfig()
    missing = {"instruction", "output"} - set(dataset.column_names)
    if missing:
        raise FedfmError(f"instruction dataset lacks column(s) {sorted(missing)}")
    has_input = "input" in dataset.column_names
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer, cfg))

    def _encode_batch(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in [*batch, "input_ids", "attention_mask", "labels"]}
        n = len(batch["instruction"])
        for i in range(n):
            inp = (batch["input"][i] or "") if has_input else ""
            enc = _encode(tokenizer, batch["instruction"][i], inp, batch["output"][i], cfg, end_id)
            if enc is None:
                continue
            for k, v in batch.items():
                out[k].append(v[i])
            for k, v in enc.items():
                out[k].append(v)
        return out

    # A batched map may return fewer rows than it receives: that is how empty responses are dropped.
    # The closure holds a tokenizer that datasets cannot hash; a fresh fingerprint skips the hashing
    # (and its warning) at the cost of never reusing a cached encoding.
    return dataset.map(
        _encode_batch,
        batched=True,
        remove_columns=dataset.column_names,
        new_fingerprint=uuid.uuid4().hex,
    )


class InstructionBatches:
    """Shuffled, collated batches over an encoded dataset (see :func:`encode_dataset`).

    Each pass over the object is one epoch; epoch ``e`` shuffles with a ``torch.Generator`` seeded
    with ``seed + e``, so a seed fixes the whole sequence of batches. With ``bucket=True`` the
    shuffled rows are grouped into pools of ``bucket_size`` batches, each pool is sorted by length
    and cut into batches, and the batches are shuffled again: batches hold rows of similar length
    (less padding) while their order stays random.

    Args:
        dataset: A ``datasets.Dataset`` (or list of dicts) with ``input_ids`` and ``labels``.
        batch_size: Rows per batch.
        pad_id: Padding token id.
        seed: Shuffling seed.
        shuffle: Shuffle rows (``False`` keeps dataset order, no bucketing).
        bucket: Group rows of similar length.
        bucket_size: Batches per sorting pool when bucketing.
        drop_last: Drop a final incomplete batch.
        pad_multiple: Pad each batch's length up to a multiple of this (see :func:`collate`).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
        bucket: bool = False,
        bucket_size: int = 50,
        drop_last: bool = False,
        pad_multiple: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {batch_size}")
        columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if dataset else [])
        if "input_ids" not in columns:
            raise FedfmError("InstructionBatches needs an encoded dataset (run encode_dataset)")
        keep = [c for c in ("input_ids", "attention_mask", "labels") if c in columns]
        # Materialise the token lists once: indexing a datasets.Dataset row by row is slow.
        self._rows = [{c: row[c] for c in keep} for row in dataset]
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self.bucket = bucket
        self.bucket_size = bucket_size
        self.drop_last = drop_last
        self.pad_multiple = pad_multiple
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next pass yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self._rows)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def batch_indices(self, epoch: int) -> list[list[int]]:
        """Row indices of every batch of ``epoch``, in yield order."""
        n = len(self._rows)
        gen = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
        if self.shuffle and self.bucket:
            pool = self.batch_size * self.bucket_size
            order = [
                i
                for start in range(0, n, pool)
                for i in sorted(
                    order[start : start + pool], key=lambda j: len(self._rows[j]["input_ids"])
                )
            ]
        batches = [order[s : s + self.batch_size] for s in range(0, n, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle and self.bucket:
            perm = torch.randperm(len(batches), generator=gen).tolist()
            batches = [batches[p] for p in perm]
        return batches

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        epoch = self.epoch
        self.epoch += 1
        for idx in self.batch_indices(epoch):
            yield collate([self._rows[i] for i in idx], self.pad_id, self.pad_multiple)
