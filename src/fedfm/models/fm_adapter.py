"""An adapter on a frozen vision foundation model: the client-side FM baseline for images.

``fm-adapter`` = frozen EfficientNet-Lite0 (ImageNet) pooled features -> a small trainable
residual MLP adapter -> a linear ``head``. Every client holds the whole foundation model; only
the adapter and the head are parameters of the module, so only they are trained, travel and
are averaged (the frozen FM is kept outside the module's state on purpose: its weights and
BatchNorm statistics must not be sent, averaged or put in train mode).

Choices of ours:

* The adapter is ``x + W₂ ReLU(W₁ LayerNorm(x))`` at the FM's width (1280), then
  ``Linear(1280, hidden)`` + ReLU as the feature layer and ``head`` on top; the FM itself
  has no LoRA-ready attention layers (it is a convolutional net), so an adapter over its
  pooled features is the parameter-efficient option.
* The FM runs in eval mode without gradients; since it is frozen and the task has no
  augmentation, its features of an image are a pure function of the image's pixels, so they
  are cached in-process by a hash of the pixels (exact; it makes CPU runs affordable, and a
  simulation's clients share the cache, which changes no result).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from fedfm.errors import ConfigError
from fedfm.models.registry import MODELS

if TYPE_CHECKING:
    from fedfm.models.vision import EfficientNetLite0

_CACHE_ROWS = 200_000  # features kept per process (1280 floats each: about 1 GB at most)


@cache
def _frozen_lite0(pretrained: bool) -> EfficientNetLite0:
    """The process's one frozen EfficientNet-Lite0 (eval mode, no gradients)."""
    from fedfm.models.vision import load_efficientnet_lite0

    model = load_efficientnet_lite0(pretrained=pretrained).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class FeatureCache:
    """Features of images by a hash of their pixels (least recently used rows dropped).

    Args:
        encode: ``[B, C, H, W]`` images -> ``[B, D]`` features.
        key: What else the features depend on (model and resolution).
        capacity: Rows kept.
    """

    def __init__(self, encode: Callable[[Tensor], Tensor], key: str, capacity: int) -> None:
        self.encode, self.key, self.capacity = encode, key, capacity
        self.rows: OrderedDict[bytes, Tensor] = OrderedDict()
        self.misses = 0

    def __call__(self, x: Tensor) -> Tensor:
        """Features ``[B, D]`` of ``x`` ``[B, C, H, W]``, computing only the rows not cached."""
        flat = x.detach().float().contiguous().cpu()
        keys = [hashlib.blake2b(r.numpy().tobytes(), key=self.key.encode()[:64]).digest()
                for r in flat]  # fmt: skip
        todo = sorted({i for i, k in enumerate(keys) if k not in self.rows})
        if todo:
            new = self.encode(flat[todo])
            self.misses += len(todo)
            for i, row in zip(todo, new, strict=True):
                self.rows[keys[i]] = row
        out = torch.stack([self.rows[k] for k in keys])
        for k in keys:
            self.rows.move_to_end(k)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)
        return out


_CACHES: dict[tuple[bool, int], FeatureCache] = {}


def lite0_features(pretrained: bool, fm_size: int) -> FeatureCache:
    """The process's cached Lite0 feature function at ``fm_size`` px."""
    from fedfm.models.vision import imagenet_preprocess

    k = (pretrained, fm_size)
    if k not in _CACHES:
        fm = _frozen_lite0(pretrained)

        @torch.no_grad()
        def encode(x: Tensor) -> Tensor:
            return torch.cat(
                [fm.features(imagenet_preprocess(x[s : s + 128], size=fm_size))
                 for s in range(0, len(x), 128)]
            )  # fmt: skip

        _CACHES[k] = FeatureCache(encode, f"lite0-{pretrained}-{fm_size}", _CACHE_ROWS)
    return _CACHES[k]


class FMAdapter(nn.Module):
    """Frozen Lite0 features ``[B, 1280]`` -> residual adapter -> ``Linear`` + ReLU -> head.

    Args:
        in_channels: Image channels (1 or 3; grey images are repeated to RGB).
        num_classes: Classes.
        image_size: Side of the task's images (any; resized to ``fm_size``).
        fm_size: Input side the foundation model sees.
        hidden: Width of the feature layer (``feature_dim``).
        pretrained: ImageNet weights (False: random, for tests).
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        fm_size: int = 64,
        hidden: int = 128,
        pretrained: bool = True,
    ) -> None:
        super().__init__()
        if in_channels not in (1, 3):
            raise ConfigError("model_args", f"fm-adapter reads 1 or 3 channels, got {in_channels}")
        if fm_size < 32 or hidden < 1:
            raise ConfigError("model_args", f"need fm_size >= 32 and hidden >= 1 ({fm_size=})")
        from fedfm.models.vision import FEATURE_DIM

        self._fm = lite0_features(pretrained, fm_size)  # a plain attribute: not in the state
        self.norm = nn.LayerNorm(FEATURE_DIM)
        self.fc1 = nn.Linear(FEATURE_DIM, FEATURE_DIM // 4)
        self.fc2 = nn.Linear(FEATURE_DIM // 4, FEATURE_DIM)
        nn.init.zeros_(self.fc2.weight)  # the adapter starts as the identity
        nn.init.zeros_(self.fc2.bias)
        self.proj = nn.Linear(FEATURE_DIM, hidden)
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Images ``[B, C, H, W]`` in [0, 1] -> adapted features ``[B, hidden]``."""
        f = self._fm(x).to(x.device)  # the frozen features are computed and cached on the CPU
        f = f + self.fc2(F.relu(self.fc1(self.norm(f))))
        return F.relu(self.proj(f))

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


@MODELS.register("fm-adapter", help="frozen EfficientNet-Lite0 + trainable adapter and head")
def fm_adapter(
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: int = 28,
    fm_size: int = 64,
    hidden: int = 128,
    pretrained: bool = True,
) -> FMAdapter:
    """Builds :class:`FMAdapter` (see there)."""
    return FMAdapter(in_channels, num_classes, image_size, fm_size, hidden, pretrained)
