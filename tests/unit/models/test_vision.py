"""Tests for the EfficientNet-Lite0 backbone and its preprocessing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.vision import (
    MBConvBlock,
    SameConv2d,
    imagenet_preprocess,
    load_efficientnet_lite0,
)

# Sum of the weight tensors in the packaged checkpoint (BatchNorm running stats excluded).
LITE0_PARAMS = 4_652_008


@pytest.fixture(scope="module")
def random_lite0() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_efficientnet_lite0(pretrained=False)


def test_random_lite0_shapes_and_size(random_lite0: torch.nn.Module) -> None:
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        logits = random_lite0(x)
        feats = random_lite0.features(x)
    assert logits.shape == (2, 1000)
    assert feats.shape == (2, 1280)
    assert sum(p.numel() for p in random_lite0.parameters()) == LITE0_PARAMS
    assert isinstance(random_lite0.head, torch.nn.Linear)
    assert random_lite0.feature_dim == 1280
    assert not random_lite0.training
    # Logits are the head applied to the pooled features (dropout is off in eval mode).
    torch.testing.assert_close(logits, random_lite0.head(feats))


def test_lite0_first_block_and_odd_input_size(random_lite0: torch.nn.Module) -> None:
    # Block 0: depthwise 3x3 on 32 ch (288) + BN (64) + 1x1 32->16 (512) + BN (32) = 896.
    block0 = random_lite0._blocks[0]
    assert isinstance(block0, MBConvBlock)
    assert sum(p.numel() for p in block0.parameters()) == 896
    assert len(random_lite0._blocks) == 16
    # "SAME" padding gives ceil(H / 32) after five stride-2 stages, for any input size.
    with torch.no_grad():
        fmap = random_lite0.feature_map(torch.randn(1, 3, 100, 75))
    assert fmap.shape == (1, 1280, 4, 3)


def test_registered_builder_and_head_swap() -> None:
    from fedfm.models.registry import build_model

    model = build_model("efficientnet-lite0", pretrained=False)
    model.head = torch.nn.Linear(model.feature_dim, 10)  # e.g. a shared Fashion-MNIST head
    with torch.no_grad():
        out = model(imagenet_preprocess(np.zeros((2, 28, 28), dtype=np.uint8), size=64))
    assert out.shape == (2, 10)


def test_same_conv_pads_like_tensorflow() -> None:
    # TF "SAME", stride 2, kernel 3 on 4 pixels: total pad 1, all on the right/bottom.
    conv = SameConv2d(1, 1, 3, stride=2)
    with torch.no_grad():
        conv.weight.fill_(1.0)
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    y = conv(x)
    # Output (0,0) sums rows 0-2, cols 0-2 (no left pad): 0+1+2+4+5+6+8+9+10 = 45.
    # Output (1,1) sums rows 2-3, cols 2-3 plus zero padding: 10+11+14+15 = 50.
    assert y.shape == (1, 1, 2, 2)
    assert y[0, 0, 0, 0].item() == 45.0
    assert y[0, 0, 1, 1].item() == 50.0


def test_preprocess_layouts_and_range() -> None:
    gray = np.full((28, 28), 255, dtype=np.uint8)
    out = imagenet_preprocess(gray)
    assert out.shape == (1, 3, 224, 224)
    torch.testing.assert_close(out, torch.full_like(out, (1.0 - 127 / 255) / (128 / 255)))
    black = imagenet_preprocess(np.zeros((5, 28, 28), dtype=np.uint8), size=32)
    assert black.shape == (5, 3, 32, 32)
    torch.testing.assert_close(black, torch.full_like(black, -127 / 128))
    # Channels-last and channels-first float inputs give the same batch.
    rgb = torch.rand(2, 40, 30, 3)
    torch.testing.assert_close(
        imagenet_preprocess(rgb, size=16), imagenet_preprocess(rgb.permute(0, 3, 1, 2), size=16)
    )
    # Center crop keeps the middle square: a wide image with a bright center band.
    wide = np.zeros((10, 30), dtype=np.uint8)
    wide[:, 10:20] = 255
    cropped = imagenet_preprocess(wide, size=10)
    assert torch.allclose(cropped, torch.full_like(cropped, (1.0 - 127 / 255) / (128 / 255)))


def test_preprocess_rejects_bad_shape() -> None:
    with pytest.raises(ConfigError, match="images"):
        imagenet_preprocess(np.zeros((2, 8, 8, 4), dtype=np.uint8))


def test_missing_weights_file_is_reported(tmp_path) -> None:
    with pytest.raises(AssetMissingError, match="not found"):
        load_efficientnet_lite0(weights_path=tmp_path / "absent.pth")


def _stock_photos() -> dict[str, tuple[np.ndarray, int]]:
    """Stock photos shipped by installed packages, with their ImageNet class id."""
    from matplotlib import cbook
    from PIL import Image
    from sklearn.datasets import load_sample_image

    with cbook.get_sample_data("grace_hopper.jpg") as f:
        hopper = np.array(Image.open(f).convert("RGB"))
    return {
        "grace_hopper": (hopper, 652),  # military uniform
        "sklearn_flower": (load_sample_image("flower.jpg"), 985),  # daisy
        "sklearn_china": (load_sample_image("china.jpg"), 698),  # palace (Summer Palace)
    }


@pytest.mark.slow
def test_pretrained_lite0_classifies_stock_photos() -> None:
    model = load_efficientnet_lite0(pretrained=True)
    photos = _stock_photos()
    batch = torch.cat([imagenet_preprocess(img) for img, _ in photos.values()])
    with torch.no_grad():
        probs = model(batch).softmax(-1)
    top1 = probs.argmax(-1).tolist()
    assert top1 == [label for _, label in photos.values()]
    # Confident, not a near tie: each correct class holds over 20 % of the mass.
    assert probs.max(-1).values.min().item() > 0.2
