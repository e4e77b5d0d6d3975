"""The encoder registry: entries, loading once per process, the feature cache, and the
sentence-transformers loader (the offline all-MiniLM-L6-v2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from fedfm.errors import AssetMissingError, ConfigError, UnknownNameError
from fedfm.fm import FoundationModel
from fedfm.fm.bases import CAUSAL_LMS
from fedfm.models.encoders import (
    Encoder,
    FeatureCache,
    clear_encoders,
    encode,
    encoder_reads,
    known_encoder,
    load_encoder,
    load_sentence_encoder,
)


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


# ----------------------------------------------------------------------------- the registry


def test_feature_cache_encodes_each_row_once_in_order() -> None:
    calls: list[torch.Tensor] = []

    def encode_rows(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.clone())
        return x.flatten(1) * 2

    cache = FeatureCache(capacity=3)
    x = torch.arange(8.0).reshape(4, 1, 2)  # four distinct rows
    out = cache(x[[0, 1]], encode_rows)
    assert torch.equal(out, x[[0, 1]].flatten(1) * 2) and cache.misses == 2
    out = cache(x[[2, 1, 0]], encode_rows)  # only row 2 is new
    assert torch.equal(calls[-1], x[[2]]) and cache.misses == 3
    assert torch.equal(out, x[[2, 1, 0]].flatten(1) * 2)
    cache(x[[3]], encode_rows)  # capacity 3: the least recently used row (2) is dropped
    assert len(cache.rows) == 3
    cache(x[[2]], encode_rows)
    assert cache.misses == 5
    # A set seen for the first time is encoded in one call, in its order (duplicates too).
    fresh = FeatureCache()
    fresh(x[[3, 0, 3]], encode_rows)
    assert torch.equal(calls[-1], x[[3, 0, 3]])


def test_feature_cache_keys_texts_by_content() -> None:
    seen: list[list[str]] = []

    def encode_texts(texts: list[str]) -> torch.Tensor:
        seen.append(list(texts))
        return torch.tensor([float(len(t)) for t in texts]).reshape(-1, 1)

    cache = FeatureCache()
    assert cache(["ab", "c"], encode_texts).tolist() == [[2.0], [1.0]]
    assert cache(["c", "abc", "ab"], encode_texts).tolist() == [[1.0], [3.0], [2.0]]
    assert seen == [["ab", "c"], ["abc"]]
    assert cache([], encode_texts).shape == (0, 1)  # nothing to look up: the encoder's answer


def test_unknown_names_and_options_are_one_line_errors() -> None:
    with pytest.raises(UnknownNameError, match=r"encoder: unknown encoder 'nope' \(choose from"):
        load_encoder("nope")
    with pytest.raises(ConfigError, match=r"encoder\.options: bad options for encoder 'hashed"):
        load_encoder("hashed-ngrams", width=3)
    assert known_encoder("hashed-ngrams", "texts", unit_norm=True) == "hashed-ngrams"
    with pytest.raises(ValueError, match="unknown text encoder with unit-norm rows 'tiny-llama'"):
        known_encoder("tiny-llama", "texts", unit_norm=True)  # its rows are not normalised
    with pytest.raises(ValueError, match=r"unknown image encoder 'minilm' \(choose from .*efficie"):
        known_encoder("minilm", "images")
    assert encoder_reads("efficientnet-lite0") == "images" and encoder_reads("minilm") == "texts"


def test_encoders_load_once_per_options_and_check_their_shape() -> None:
    clear_encoders()
    a = load_encoder("hashed-ngrams", dim=8)
    assert load_encoder("hashed-ngrams", dim=8) is a and load_encoder("hashed-ngrams") is not a
    emb = a.encode(["a good film", "a good film", "tax law", ""])
    assert emb.shape == (4, 8) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert torch.equal(emb[0], emb[1])
    with pytest.raises(ConfigError, match="'hashed-ngrams' has no per-layer features"):
        a.layer_features(["x"])
    bad = Encoder("bad", 3, lambda x: torch.zeros(len(x), 2))
    with pytest.raises(ConfigError, match=r"'bad' gave features of shape \(2, 2\), expected"):
        bad.encode(["a", "b"])
    clear_encoders()


def test_causal_lm_encoders_are_the_model_registry_s_causal_lms() -> None:
    from fedfm.models.causal_lm import LMBundle  # noqa: F401  (registers the causal LMs)
    from fedfm.models.registry import load_builtin_models

    models = load_builtin_models()
    assert all(name in models and encoder_reads(name) == "texts" for name in CAUSAL_LMS)
    tiny = load_encoder("tiny-llama", hidden=16, layers=1, heads=2, seed=3)
    assert tiny.dim == 16 and tiny.num_layers == 1
    clear_encoders()


def test_a_causal_lm_encoder_reads_the_shared_base_without_its_adapters() -> None:
    args = {"hidden": 16, "layers": 1, "heads": 2, "seed": 4}
    fm = FoundationModel("tiny-llama", args=args)
    texts = ["What is 3 + 4?", "hi"]
    enc = load_encoder("tiny-llama", **args)
    assert enc.stack().backbone is fm.bundle.model.model  # the shared base, no second copy
    plain = enc.encode(texts)
    fm.ensure_adapter("enc-test", seed=1)
    state = fm.get_adapter("enc-test")
    fm.set_adapter("enc-test", {k: torch.full_like(v, 0.1) for k, v in state.items()})
    with fm.use(["enc-test"]):
        assert torch.equal(enc.encode(texts), plain)  # adapters are off while it encodes
        assert fm.active == ["enc-test"]  # and back on afterwards
        assert not torch.equal(fm.features(texts, ["enc-test"], layers=[-1])[:, 0], plain)
    fm.delete_adapter("enc-test")
    clear_encoders()
