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
* The FM (the ``efficientnet-lite0`` encoder of :mod:`fedfm.models.encoders`) runs in eval
  mode without gradients; since it is frozen and the task has no augmentation, its features
  of an image are a pure function of the image's pixels, so they are cached in-process by a
  hash of the pixels (exact; it makes CPU runs affordable, and a simulation's clients share
  the cache, which changes no result).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from fedfm.errors import ConfigError
from fedfm.models.encoders import Encoder, encoder_key, feature_cache, load_encoder
from fedfm.models.registry import MODELS

FM = "efficientnet-lite0"
"""The frozen foundation model (an entry of :data:`fedfm.models.encoders.ENCODERS`)."""


class FrozenFeatures:
    """The process's frozen ``FM`` at ``fm_size`` px, through its feature cache.

    A plain object, not a module: a model holding it keeps it out of its state, its
    parameters and ``train()``.
    """

    def __init__(self, pretrained: bool, fm_size: int) -> None:
        self.options: dict[str, Any] = {"image_size": fm_size, "pretrained": pretrained}
        self.cache = feature_cache(encoder_key(FM, self.options))
        # Loaded now (once per process): building it draws from torch's RNG, and the
        # adapter's layers are initialised after it.
        self.encoder()

    def encoder(self) -> Encoder:
        """The frozen foundation model (on the CPU, where its features are cached)."""
        return load_encoder(FM, **self.options)

    def __call__(self, x: Tensor) -> Tensor:
        """Features ``[B, 1280]`` (CPU) of images ``[B, C, H, W]``."""
        return self.cache(x, lambda rows: self.encoder().encode(rows))


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

        self._fm = FrozenFeatures(pretrained, fm_size)  # a plain attribute: not in the state
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
