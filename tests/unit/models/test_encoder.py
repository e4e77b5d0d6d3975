"""Sentence encoder loader: the offline all-MiniLM-L6-v2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.encoder import encode, load_sentence_encoder


def test_missing_local_encoder_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(AssetMissingError, match="sentence encoder folder not found"):
        load_sentence_encoder(str(tmp_path / "missing"))


@pytest.mark.slow
def test_minilm_embeds_normalises_and_ranks_similar_sentences_closer() -> None:
    model = load_sentence_encoder()
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    texts = [
        "A cat is sleeping on the sofa.",
        "A kitten naps on the couch.",
        "The central bank raised interest rates again.",
    ]
    emb = encode(model, texts, batch_size=2)
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[0, 1] > sim[1, 2] + 0.3
    assert encode(model, []).shape == (0, 384)
    # The normalize switch matters for a model without its own Normalize layer.
    pooled = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    raw = encode(pooled, texts, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), emb, atol=1e-5)
    np.testing.assert_allclose(encode(pooled, texts, normalize=True), emb, atol=1e-5)
    with pytest.raises(ConfigError):
        encode(model, texts, batch_size=0)
