"""Causal LM loaders: tiny test Llamas, generation on them, the conversion cache, SmolLM2."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from fedfm.data.prompt import PromptConfig, chat_prompt
from fedfm.errors import AssetMissingError, ConfigError, FedfmError
from fedfm.models.causal_lm import (
    LMBundle,
    _build_once,
    load_causal_lm,
    small_tokenizer,
    smollm2_tokenizer,
    tiny_llama,
)
from fedfm.models.generation import generate
from fedfm.models.registry import MODELS, build_model

CHAT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"


def format_chat(tok, prompt: str, system: str | None = None) -> str:
    """A user turn rendered with the chat template, as generation reads it."""
    return chat_prompt(tok, prompt, system, PromptConfig())


def generate_text(model, tok, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 8):
    """fedfm's one generation path on chat-formatted ``prompts``."""
    texts = [format_chat(tok, p) for p in prompts]
    return generate(model, tok, texts, max_new_tokens, batch_size)


def _check_frozen(bundle: LMBundle) -> None:
    assert not bundle.model.training
    assert not any(p.requires_grad for p in bundle.model.parameters())


def test_small_tokenizer_is_byte_level_chatml_with_smollm2_ids() -> None:
    tok = small_tokenizer()
    assert 512 < len(tok) <= 1024
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert format_chat(tok, "What is 3 + 4?") == CHAT
    assert format_chat(tok, "hi", system="Be brief.").startswith("<|im_start|>system\nBe brief.")
    # Byte-level: any text, accents and emoji included, survives encode/decode.
    text = "Café au lait, 42 ☕ — naïve résumé!"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert 0 not in ids  # nothing falls back to the unknown token
    # Trained merges: common words are single pieces, so text is shorter than its bytes.
    assert len(tok("The capital of France is Paris.").input_ids) < len(b"The capital of France")


def test_tiny_llama_small_forward_and_generate() -> None:
    bundle = tiny_llama(vocab="small", hidden=64, layers=2, heads=4, seed=0)
    _check_frozen(bundle)
    cfg = bundle.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (
        64,
        2,
        len(bundle.tokenizer),
    )
    ids = bundle.tokenizer([CHAT], return_tensors="pt").input_ids
    logits = bundle.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    out = bundle.model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)
    assert torch.equal(out[:, : ids.shape[1]], ids)


def test_tiny_llama_is_seeded_without_touching_the_global_rng() -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    a = tiny_llama(seed=0).model.state_dict()
    assert torch.equal(torch.rand(1), expected_draw)
    b = tiny_llama(seed=0).model.state_dict()
    c = tiny_llama(seed=1).model.state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[key], b[key])
    assert not torch.equal(a[key], c[key])


def test_generate_text_batches_left_padded_and_restores_padding_side() -> None:
    bundle = tiny_llama(seed=0)
    tok = bundle.tokenizer
    prompts = ["What is 3 + 4?", "Write a short poem about the sea and the waves.", "hi"]
    together = generate_text(bundle.model, tok, prompts, max_new_tokens=6, batch_size=2)
    alone = [generate_text(bundle.model, tok, [p], max_new_tokens=6)[0] for p in prompts]
    assert len(together) == 3 and all(isinstance(t, str) for t in together)
    # Left padding with an attention mask: a prompt's greedy reply does not depend on its batch.
    assert together == alone
    assert tok.padding_side == "right"
    with pytest.raises(FedfmError, match="batch_size"):
        generate_text(bundle.model, tok, prompts, batch_size=0)


def test_tiny_llama_with_the_smollm2_tokenizer() -> None:
    bundle = tiny_llama(vocab="smollm2", hidden=32, layers=1, heads=2)
    _check_frozen(bundle)
    tok = bundle.tokenizer
    assert len(tok) == bundle.model.config.vocab_size == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    rendered = format_chat(tok, "What is 3 + 4?")
    # SmolLM2's template adds its default system turn when none is given.
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith(CHAT)
    reply = generate_text(bundle.model, tok, ["What is 3 + 4?"], max_new_tokens=3)
    assert len(reply) == 1 and isinstance(reply[0], str)
    assert smollm2_tokenizer()("Paris").input_ids == tok("Paris").input_ids


def test_bad_arguments_give_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        tiny_llama(hidden=30, heads=4)
    with pytest.raises(ConfigError, match=r"model\.layers"):
        tiny_llama(layers=0)
    with pytest.raises(ConfigError, match=r"model\.vocab"):
        tiny_llama(vocab="gpt2")  # type: ignore[arg-type]
    with pytest.raises(AssetMissingError, match="folder not found"):
        load_causal_lm(str(tmp_path / "no-such-model"))
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        load_causal_lm(str(tmp_path), dtype="int8")


def test_registry_builds_and_checks_arguments() -> None:
    bundle = build_model("tiny-llama", hidden=32, heads=2)
    assert isinstance(bundle, LMBundle) and bundle.model.config.hidden_size == 32
    assert {"smollm2-135m-instruct", "causal-lm", "tiny-llama"} <= set(MODELS)
    with pytest.raises(ConfigError, match="bad arguments for model 'tiny-llama'"):
        build_model("tiny-llama", width=3)


def test_cache_build_is_atomic_and_runs_once_under_concurrency(tmp_path: Path) -> None:
    target = tmp_path / "models" / "thing"
    target.parent.mkdir()

    def failing(out: Path) -> None:
        (out / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        _build_once(target, failing)
    # Nothing half-written is left behind: neither the target nor the temporary folder.
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == []

    calls: list[int] = []

    def slow(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (out / "weights.bin").write_bytes(b"ok")

    threads = [threading.Thread(target=_build_once, args=(target, slow)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert (target / "weights.bin").read_bytes() == b"ok"


@pytest.mark.slow
def test_smollm2_loads_and_answers() -> None:
    bundle = load_causal_lm("smollm2-135m-instruct")  # converts once (~22 s), then ~1 s
    _check_frozen(bundle)
    assert bundle.num_parameters() == 134_515_008
    cfg = bundle.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings
    questions = ["What is the capital of France?", "What is 2 + 2? Answer with a number."]
    replies = generate_text(bundle.model, bundle.tokenizer, questions, max_new_tokens=16)
    assert "paris" in replies[0].lower()
    assert "4" in replies[1]
    assert bundle.tokenizer("Paris").input_ids == smollm2_tokenizer()("Paris").input_ids
