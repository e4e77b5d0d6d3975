"""Tiny models: a foundation-model handle on a random two-layer Llama, and Llamas whose
weights are built by hand so that their greedy output is known."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fedfm.fm import FoundationModel
from fedfm.models.lora import LoraConfigSpec

TINY_FM_LORA = LoraConfigSpec(r=4, alpha=8, dropout=0.0)
_bases = itertools.count(100)


def tiny_fm(**kw: Any) -> FoundationModel:
    """A handle on a base of its own (the base seed makes the process-wide key unique)."""
    args = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": next(_bases)}
    return FoundationModel("tiny-llama", "float32", args, lora=TINY_FM_LORA, **kw)


def randomize(fm: FoundationModel, name: str, seed: int, scale: float = 0.1) -> None:
    """Gives adapter ``name`` random non-zero tensors so that it changes the output."""
    gen = torch.Generator().manual_seed(seed)
    state = fm.get_adapter(name)
    fm.set_adapter(name, {k: scale * torch.randn(v.shape, generator=gen) for k, v in state.items()})


HIDDEN = 32


def tiny_llama(vocab_size: int, seed: int = 0, init: float = 0.2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        initializer_range=init,  # peaked logits, so greedy choices are not float-noise ties
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _silence_layers(model: LlamaForCausalLM) -> None:
    """Zero every attention and MLP output: the final hidden state is the current token's
    embedding, so the logits depend on the current token only."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


@torch.no_grad()
def bigram_llama(tok, chain: list[int]) -> LlamaForCausalLM:
    """A Llama whose greedy continuation after ``chain[0]`` is ``chain[1:]``.

    Token ``chain[k]`` gets embedding ``e_k`` (every other token ``e_{HIDDEN-1}``); RMSNorm maps
    ``e_k`` to ``sqrt(HIDDEN) e_k``, and ``lm_head[chain[k+1], k] = 1`` makes ``chain[k+1]`` the
    only non-zero logit (≈5.7) after ``chain[k]``.
    """
    model = tiny_llama(len(tok))
    _silence_layers(model)
    emb = model.model.embed_tokens.weight
    emb.zero_()
    emb[:, HIDDEN - 1] = 1.0
    model.lm_head.weight.zero_()
    for k, (cur, nxt) in enumerate(itertools.pairwise(chain)):
        emb[cur] = 0.0
        emb[cur, k] = 1.0
        model.lm_head.weight[nxt, k] = 1.0
    return model


@torch.no_grad()
def constant_llama(vocab_size: int, logprobs: torch.Tensor) -> LlamaForCausalLM:
    """A Llama whose next-token log-probabilities are ``logprobs`` at every position."""
    model = tiny_llama(vocab_size)
    _silence_layers(model)
    v = torch.ones(HIDDEN)
    model.model.embed_tokens.weight.copy_(v.expand(vocab_size, HIDDEN))
    h = model.model.norm(v)  # the final hidden state of every position
    model.lm_head.weight.copy_(torch.outer(logprobs, h) / h.dot(h))
    return model


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer(corpus: list[str], template: bool = True) -> PreTrainedTokenizerFast:
    """A ~350-token byte-level BPE trained on ``corpus``, with SmolLM2's special tokens
    (ids 0, 1, 2) and (with ``template``) its ChatML chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=CHATML if template else None,
    )


# A BERT-style encoder small enough to compute by hand: words "a" and "b", hidden width 2.
TINY_BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
# Embedding of each token (position and segment embeddings are zero): after the embedding
# LayerNorm, (1, 0) becomes (1, -1) and (0, 1) becomes (-1, 1).
TINY_BERT_EMBEDDING = {"[PAD]": (0, 1), "[CLS]": (1, 0), "[SEP]": (1, 0), "a": (1, 0), "b": (0, 1)}


class TinySentenceEncoder:
    """A sentence-transformers-shaped wrapper (``encoder[0].auto_model``, ``.tokenizer``,
    ``[0].max_seq_length``) around a one-layer, 2-wide random ``BertModel`` whose embedding
    output is known by hand (:data:`TINY_BERT_EMBEDDING`)."""

    def __init__(self, seed: int = 0) -> None:
        from tokenizers import processors
        from transformers import BertConfig, BertModel

        vocab = {t: i for i, t in enumerate(TINY_BERT_VOCAB)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        self.tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]",
        )  # fmt: skip
        torch.manual_seed(seed)
        config = BertConfig(
            vocab_size=len(vocab), hidden_size=2, num_hidden_layers=1, num_attention_heads=1,
            intermediate_size=4, max_position_embeddings=32, layer_norm_eps=1e-12,
        )  # fmt: skip
        self.auto_model = BertModel(config, add_pooling_layer=False).eval()
        emb = self.auto_model.embeddings
        with torch.no_grad():
            emb.position_embeddings.weight.zero_()
            emb.token_type_embeddings.weight.zero_()
            emb.LayerNorm.weight.fill_(1.0)
            emb.LayerNorm.bias.zero_()
            for token, vec in TINY_BERT_EMBEDDING.items():
                emb.word_embeddings.weight[vocab[token]] = torch.tensor(vec, dtype=torch.float)
        self.max_seq_length = 32

    def __getitem__(self, index: int) -> TinySentenceEncoder:
        assert index == 0  # the Transformer module: this object plays it too
        return self


TINY_BERT = "test-tiny-bert"


def register_tiny_bert() -> str:
    """Registers :class:`TinySentenceEncoder` as the text encoder ``test-tiny-bert``."""
    from fedfm.models.encoders import ENCODERS, Encoder, register_encoder
    from fedfm.models.features import sentence_encoder_layers

    def build() -> Encoder:
        st = TinySentenceEncoder()
        stack = sentence_encoder_layers(st)
        return Encoder(TINY_BERT, 2, lambda t: stack.features(t, [-1])[:, 0], st.auto_model, stack)

    if TINY_BERT not in ENCODERS:
        register_encoder(TINY_BERT, "texts", "a 2-wide BERT computable by hand")(build)
    return TINY_BERT
