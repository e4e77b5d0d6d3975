"""Per-layer features pool as their encoder does: a BERT-style encoder by the mean over its
non-padding tokens (checked by hand on a 2-wide BERT), a causal LM by its last token."""

from __future__ import annotations

import torch

from fedfm.models.encoders import Encoder, load_encoder
from fedfm.models.features import sentence_encoder_layers
from helpers.models import TinySentenceEncoder

# "[CLS] a b a [SEP]" and "[CLS] b [SEP]": in one batch the second is padded by two tokens.
TEXTS = ["a b a", "b"]


def _bert() -> Encoder:
    st = TinySentenceEncoder()
    stack = sentence_encoder_layers(st)
    return Encoder("tiny-bert", 2, lambda texts: stack.features(texts, [-1])[:, 0], None, stack)


def test_a_bert_style_encoder_pools_by_the_mean_over_its_non_padding_tokens() -> None:
    bert = _bert()
    assert bert.stack().pool == "mean"
    feats = bert.layer_features(TEXTS, batch_size=2)  # its own pooling; one padded batch
    assert feats.shape == (2, 2, 2)  # texts, hidden states (embeddings, layer 1), width
    # Embedding output by hand: [CLS], [SEP] and "a" are (1, -1), "b" and [PAD] (-1, 1).
    # Text 1: four of (1, -1) and one of (-1, 1) over 5 tokens -> (0.6, -0.6).
    # Text 2: two of (1, -1) and one of (-1, 1) over 3 tokens -> (1/3, -1/3); with its two
    # [PAD] tokens counted it would be (-0.2, 0.2), and its last token ([SEP]) is (1, -1)
    # for every text.
    torch.testing.assert_close(feats[:, 0], torch.tensor([[0.6, -0.6], [1 / 3, -1 / 3]]))
    # Layer 1: the mean of the unpadded text's own token states, whatever the batch.
    st = TinySentenceEncoder()
    for i, text in enumerate(TEXTS):
        ids = st.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            states = st.auto_model(**ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(feats[i, 1], states[1][0].mean(0), rtol=0, atol=1e-5)
    last = bert.layer_features(TEXTS, pool="last")  # the [SEP] reading, still available
    torch.testing.assert_close(last[:, 0], torch.tensor([[1.0, -1.0], [1.0, -1.0]]))


def test_a_causal_lm_pools_by_its_last_token() -> None:
    small = load_encoder("tiny-llama", hidden=16, layers=1, heads=2, seed=3)
    assert small.stack().pool == "last"
    texts = ["one two three", "four"]
    torch.testing.assert_close(
        small.layer_features(texts), small.layer_features(texts, pool="last"), rtol=0, atol=0
    )
