"""Tests for the student models and the hashing tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from sklearn.utils import murmurhash3_32
from torch import nn

from fedfm.errors import ConfigError
from fedfm.models.registry import build_model
from fedfm.models.students import (
    MLP,
    PAD_ID,
    FeatureModel,
    HashingTokenizer,
    SmallCNN,
    TextClassifier,
)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def assert_head_contract(model: nn.Module, x, feature_dim: int, out_dim: int) -> None:
    assert isinstance(model, FeatureModel)
    assert isinstance(model.head, nn.Linear)
    assert model.feature_dim == feature_dim
    feats = model.features(x)
    logits = model(x)
    assert feats.shape[1] == feature_dim
    assert logits.shape[1] == out_dim
    torch.testing.assert_close(logits, model.head(feats))


@pytest.mark.parametrize(
    ("hidden", "expected_params", "feature_dim"),
    [
        # 10*64+64 + 64*64+64 + 64*3+3 = 704 + 4160 + 195
        ((64, 64), 5059, 64),
        # 10*16+16 + 16*8+8 + 8*4+4 + 4*3+3 = 176 + 136 + 36 + 15
        ([16, 8, 4], 363, 4),
        # linear model: 10*3+3
        ([], 33, 10),
    ],
)
def test_mlp_sizes(hidden, expected_params: int, feature_dim: int) -> None:
    model = MLP(10, 3, hidden=hidden)
    assert n_params(model) == expected_params
    assert_head_contract(model, torch.randn(5, 10), feature_dim, 3)


def test_mlp_dropout_only_in_train_mode() -> None:
    torch.manual_seed(0)
    model = MLP(8, 2, hidden=[256], dropout=0.5)
    x = torch.randn(4, 8)
    model.eval()
    torch.testing.assert_close(model(x), model(x))
    model.train()
    assert not torch.equal(model.features(x), model.features(x))


def test_small_cnn_sizes_and_layouts() -> None:
    # conv1 1*8*9+8 = 80, conv2 8*16*9+16 = 1168, fc 16*7*7*32+32 = 25120, head 32*10+10 = 330
    model = SmallCNN(in_channels=1, num_classes=10, width=8, image_size=28, hidden=32)
    assert n_params(model) == 26698
    # Defaults (width 32, FC 128): 320 + 18496 + 64*7*7*128+128 (401536) + 1290
    assert n_params(SmallCNN()) == 421642
    x = torch.randn(3, 1, 28, 28)
    assert_head_contract(model, x, 32, 10)
    torch.testing.assert_close(model(x.squeeze(1)), model(x))  # [B, H, W]
    torch.testing.assert_close(model(x.flatten(1)), model(x))  # [B, 784]
    # RGB 32x32: conv1 3*8*9+8 = 224, conv2 1168, fc 16*8*8*32+32 = 32800, head 330
    rgb = SmallCNN(in_channels=3, num_classes=10, width=8, image_size=32, hidden=32)
    assert n_params(rgb) == 34522
    assert rgb(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_small_cnn_rejects_wrong_image_size() -> None:
    with pytest.raises(ConfigError, match=r"model\.image_size: SmallCNN expects 1x28x28"):
        SmallCNN(width=4)(torch.randn(2, 1, 32, 32))


def test_text_classifier_sizes_and_input_forms() -> None:
    # embedding 100*8 (pad row included) + 8*4+4 + 4*3+3 = 800 + 36 + 15
    model = TextClassifier(vocab_size=100, num_classes=3, embed_dim=8, hidden=4)
    assert n_params(model) == 851
    texts = ["the cat sat on the mat", "", "a dog"]
    ids, offsets = model.encode(texts)
    padded = model.tokenizer.encode_padded(texts)
    assert_head_contract(model, padded, 4, 3)
    torch.testing.assert_close(model(ids, offsets), model(padded))
    torch.testing.assert_close(model((ids, offsets)), model(padded))
    with pytest.raises(ConfigError, match="offsets"):
        model(ids)


def test_text_classifier_features_are_mean_of_embeddings() -> None:
    model = TextClassifier(vocab_size=50, num_classes=2, embed_dim=4, hidden=4)
    ids, offsets = model.encode(["x y"])  # x, y and the bigram "x y"
    assert ids.numel() == 3 and offsets.tolist() == [0]
    mean = model.embedding.weight[ids].mean(0, keepdim=True)
    torch.testing.assert_close(model.features(ids, offsets), model.fc(mean))
    # An empty text is all padding: its bag mean is zero.
    empty = model.tokenizer.encode_padded([""])
    torch.testing.assert_close(model.features(empty), model.fc(torch.zeros(1, 4)))


def test_hashing_ids_match_murmurhash_reference() -> None:
    tok = HashingTokenizer(num_buckets=1000)
    ids, offsets = tok.encode(["The cat", "a a a"])
    # Independent reference: |murmurhash3_32(ngram, seed=0)| mod (buckets - 1), + 1 for padding.
    ref = lambda t: abs(murmurhash3_32(t, seed=0)) % 999 + 1  # noqa: E731
    assert offsets.tolist() == [0, 3]
    assert sorted(ids[:3].tolist()) == sorted([ref("the"), ref("cat"), ref("the cat")])
    # Counts are kept: "a" three times, the bigram "a a" twice.
    assert sorted(ids[3:].tolist()) == sorted([ref("a")] * 3 + [ref("a a")] * 2)
    assert PAD_ID not in ids.tolist()
    padded = tok.encode_padded(["The cat", "", "a a a"])
    assert padded.shape == (3, 5)
    assert padded[1].tolist() == [PAD_ID] * 5
    assert (padded[0, 3:] == PAD_ID).all()


_ENCODE_SNIPPET = (
    "from fedfm.models.students import HashingTokenizer;"
    "ids, off = HashingTokenizer(4096).encode(['Federated learning of small students', 'x y']);"
    "print(ids.tolist(), off.tolist())"
)


def test_hashing_is_stable_across_processes() -> None:
    # A child with another str-hash salt: ids built on Python's hash() would differ.
    salt = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": salt}
    out = subprocess.run(
        [sys.executable, "-c", _ENCODE_SNIPPET], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    ids, off = HashingTokenizer(4096).encode(["Federated learning of small students", "x y"])
    assert out.stdout == f"{ids.tolist()} {off.tolist()}\n"


@pytest.mark.parametrize(
    "build",
    [
        lambda: MLP(6, 2, hidden=[5, 7]),
        lambda: SmallCNN(width=4, hidden=8),
        lambda: TextClassifier(64, 2, embed_dim=4, hidden=4),
    ],
)
def test_seeded_init_is_deterministic(build) -> None:
    torch.manual_seed(123)
    a = build().state_dict()
    torch.manual_seed(123)
    b = build().state_dict()
    torch.manual_seed(124)
    c = build().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_mlp_learns_linearly_separable_toy_set() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=g)
    y = (x @ torch.tensor([1.5, -1.0]) + 0.2 > 0).long()
    torch.manual_seed(0)
    model = MLP(2, 2, hidden=[16])
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with torch.no_grad():
        start = (model(x).argmax(1) == y).float().mean().item()
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert start < 0.9  # the seed starts from a model that has to learn
    assert acc > 0.9


def test_text_classifier_learns_keyword_task() -> None:
    texts = [
        f"this movie was {w} {f}" for w in ("great", "awful") for f in ("", "indeed", "really")
    ]
    y = torch.tensor([1, 1, 1, 0, 0, 0])
    torch.manual_seed(0)
    model = TextClassifier(512, 2, embed_dim=16, hidden=16)
    batch = model.tokenizer.encode_padded(texts)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch), y).backward()
        opt.step()
    assert torch.equal(model(batch).argmax(1), y)
    # Held-out phrasing with the same keyword.
    test = model.tokenizer.encode_padded(["awful plot", "great acting"])
    assert model(test).argmax(1).tolist() == [0, 1]


def test_registered_builders_and_bad_values() -> None:
    model = build_model("mlp", in_dim=4, out_dim=2, hidden=[8])
    assert isinstance(model, MLP) and model.feature_dim == 8
    assert isinstance(build_model("small-cnn", width=4), SmallCNN)
    assert isinstance(build_model("text-classifier", vocab_size=32, num_classes=2), TextClassifier)
    with pytest.raises(ConfigError, match=r"model\.hidden: must be a positive integer, got 0"):
        MLP(4, 2, hidden=[8, 0])
    with pytest.raises(ConfigError, match=r"model\.dropout"):
        MLP(4, 2, dropout=1.0)
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        TextClassifier(1, 2)
    with pytest.raises(ConfigError, match="texts"):
        HashingTokenizer(16).encode("a single string")
