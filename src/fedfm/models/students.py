"""Small student models: MLP, SmallCNN and a fastText-style text classifier.

Students are the per-client private models of knowledge-distillation methods (FedeKD) and the small
models of the tabular/image/text baselines. They share one shape so that server code can treat them
alike:

* ``features(x)`` returns the penultimate representation ``[B, feature_dim]`` (used by CKA and
  feature distillation);
* ``head`` is the final ``nn.Linear(feature_dim, num_classes)``, a plain submodule, so a server can
  share or replace it by assignment (``model.head = shared_head``), and
  ``forward(x) == head(features(x))``;
* ``feature_dim`` is the width of ``features``.

``FeatureModel`` states this contract for type checking; the EfficientNet-Lite0 backbone in
``fedfm.models.vision`` follows it too.

References:
    McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (the two-conv-layer CNN that ``SmallCNN`` scales down).
    Joulin et al. 2017, "Bag of Tricks for Efficient Text Classification" (fastText: averaged
    word and bigram embeddings with the hashing trick, ``TextClassifier``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from sklearn.feature_extraction.text import HashingVectorizer
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from fedfm.errors import ConfigError
from fedfm.models.registry import MODELS

# Token ids: 0 is padding (ignored by the mean), hashed n-grams land in 1..vocab_size-1.
PAD_ID = 0


@runtime_checkable
class FeatureModel(Protocol):
    """A classifier split into a feature extractor and a final linear ``head``."""

    feature_dim: int
    head: nn.Linear

    def features(self, x: Tensor) -> Tensor:
        """Inputs -> [B, feature_dim] penultimate features."""
        ...


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"model.{name}", f"must be a positive integer, got {value!r}")


@MODELS.register("mlp", help="Multi-layer perceptron with ReLU hidden layers")
class MLP(nn.Module):
    """Multi-layer perceptron: ``[Linear -> ReLU -> Dropout] * len(hidden)`` then ``head``.

    Args:
        in_dim: Input width.
        out_dim: Number of outputs (classes, or 1 for regression).
        hidden: Hidden widths; widths and depth may differ per client. Empty gives a linear model
            whose ``features`` are the inputs themselves.
        dropout: Dropout after each hidden activation (train mode only).
    """

    def __init__(
        self, in_dim: int, out_dim: int, hidden: Sequence[int] = (64, 64), dropout: float = 0.0
    ) -> None:
        super().__init__()
        _check_positive(in_dim=in_dim, out_dim=out_dim)
        for width in hidden:
            _check_positive(hidden=width)
        if not 0.0 <= dropout < 1.0:
            raise ConfigError("model.dropout", f"must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.body = nn.Sequential(*layers)
        self.feature_dim = width
        self.head = nn.Linear(width, out_dim)

    def features(self, x: Tensor) -> Tensor:
        """[B, in_dim] -> [B, feature_dim]."""
        return self.body(x.flatten(1))

    def forward(self, x: Tensor) -> Tensor:
        """[B, in_dim] -> [B, out_dim] logits (or predictions for regression)."""
        return self.head(self.features(x))


@MODELS.register("small-cnn", help="Two conv blocks + FC, for 28x28/32x32 images")
class SmallCNN(nn.Module):
    """Two ``conv3x3 -> ReLU -> maxpool2`` blocks, an FC feature layer and ``head``.

    The blocks have ``width`` and ``2*width`` channels; a scaled-down version of the FedAvg CNN of
    McMahan et al. (2017), which uses 5x5 kernels, 32/64 channels and a 512-wide FC layer.

    Args:
        in_channels: Image channels (1 for Fashion-MNIST).
        num_classes: Classes.
        width: Channels of the first conv block; the second has twice as many.
        image_size: Height and width of the (square) input images.
        hidden: Width of the FC feature layer (``feature_dim``).
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 32,
        image_size: int = 28,
        hidden: int = 128,
    ) -> None:
        super().__init__()
        _check_positive(
            in_channels=in_channels, num_classes=num_classes, width=width, hidden=hidden
        )
        if not isinstance(image_size, int) or image_size < 4:
            raise ConfigError("model.image_size", f"must be an integer >= 4, got {image_size!r}")
        self.in_channels = in_channels
        self.image_size = image_size
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 2 // 2  # each max-pool floors the size
        self.fc = nn.Sequential(nn.Linear(2 * width * side * side, hidden), nn.ReLU())
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def _as_images(self, x: Tensor) -> Tensor:
        """Accepts [B, C, H, W], [B, H, W] (single channel) or flat [B, C*H*W] inputs."""
        c, s = self.in_channels, self.image_size
        if x.ndim == 2 and x.shape[1] == c * s * s:
            x = x.view(-1, c, s, s)
        elif x.ndim == 3 and c == 1:
            x = x.unsqueeze(1)
        if x.ndim != 4 or tuple(x.shape[1:]) != (c, s, s):
            raise ConfigError(
                "model.image_size", f"SmallCNN expects {c}x{s}x{s} images, got {tuple(x.shape)}"
            )
        return x

    def features(self, x: Tensor) -> Tensor:
        """Images -> [B, hidden] penultimate features."""
        return self.fc(self.conv(self._as_images(x)).flatten(1))

    def forward(self, x: Tensor) -> Tensor:
        """Images -> [B, num_classes] logits."""
        return self.head(self.features(x))


class HashingTokenizer:
    """Maps texts to bags of hashed word and word-bigram ids (the fastText hashing trick).

    Tokenising, n-gram building and hashing are sklearn's ``HashingVectorizer`` (MurmurHash3 with a
    fixed seed, so ids are identical across processes and machines, unlike Python's ``hash``).
    Id ``0`` is reserved for padding; n-grams are hashed into ``1..num_buckets-1``. Collisions are
    accepted, as in fastText.

    Args:
        num_buckets: Size of the id space, padding included (the classifier's ``vocab_size``).
        ngram_range: Smallest and largest word n-gram; (1, 2) is fastText's unigrams + bigrams.
        lowercase: Lowercase before tokenising.
    """

    def __init__(
        self, num_buckets: int, ngram_range: tuple[int, int] = (1, 2), lowercase: bool = True
    ) -> None:
        if not isinstance(num_buckets, int) or num_buckets < 2:
            raise ConfigError("model.vocab_size", f"must be an integer >= 2, got {num_buckets!r}")
        self.num_buckets = num_buckets
        self._vectorizer = HashingVectorizer(
            n_features=num_buckets - 1,
            ngram_range=ngram_range,
            lowercase=lowercase,
            token_pattern=r"(?u)\b\w+\b",  # keep one-letter words, as fastText does
            alternate_sign=False,
            norm=None,
        )

    def _counts(self, texts: Sequence[str]):  # -> csr_matrix [B, num_buckets-1], None if no texts
        if isinstance(texts, str):
            raise ConfigError("texts", "expected a list of strings, got a single string")
        texts = list(texts)
        return self._vectorizer.transform(texts) if texts else None

    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Encodes texts as one flat id tensor plus bag offsets, the ``nn.EmbeddingBag`` format.

        An n-gram that occurs k times appears k times, so the bag mean weighs it by its count.
        Ids inside a bag are in bucket order (a bag has no order).

        Returns:
            ``ids`` [N] int64 and ``offsets`` [B] int64 (start of each text's bag in ``ids``).
        """
        counts = self._counts(texts)
        if counts is None:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        ids = np.repeat(counts.indices.astype(np.int64) + 1, counts.data.astype(np.int64))
        lengths = np.asarray(counts.sum(axis=1), dtype=np.int64).ravel()
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(offsets)

    def encode_padded(self, texts: Sequence[str]) -> Tensor:
        """Encodes texts as a [B, L] id matrix padded with ``PAD_ID`` (L = longest bag).

        Handy when batches must be plain tensors (DataLoader collation, message payloads).
        """
        ids, offsets = self.encode(texts)
        if offsets.numel() == 0:
            return torch.zeros(0, 1, dtype=torch.long)
        lengths = torch.diff(offsets, append=torch.tensor([ids.numel()]))
        bags = list(torch.split(ids, lengths.tolist()))
        return pad_sequence(bags, batch_first=True, padding_value=PAD_ID)


@MODELS.register("text-classifier", help="fastText-style bag of hashed n-grams + MLP")
class TextClassifier(nn.Module):
    """Mean of hashed word/bigram embeddings, one ReLU layer, then ``head``.

    After Joulin et al. 2017, with a hidden layer added so ``features`` has a width independent of
    the embedding table.

    Inputs are token ids from ``HashingTokenizer(vocab_size)`` (see ``encode``), either a padded
    [B, L] matrix or flat ids [N] with offsets [B]; a ``(ids, offsets)`` tuple is accepted too.

    Args:
        vocab_size: Number of hash buckets, padding id 0 included.
        num_classes: Classes.
        embed_dim: Embedding width.
        hidden: Width of the feature layer (``feature_dim``).
    """

    def __init__(
        self, vocab_size: int, num_classes: int, embed_dim: int = 64, hidden: int = 64
    ) -> None:
        super().__init__()
        _check_positive(num_classes=num_classes, embed_dim=embed_dim, hidden=hidden)
        self.tokenizer = HashingTokenizer(vocab_size)  # validates vocab_size
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean", padding_idx=PAD_ID)
        self.fc = nn.Sequential(nn.Linear(embed_dim, hidden), nn.ReLU())
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Texts -> (ids [N], offsets [B]) for this model's vocabulary."""
        return self.tokenizer.encode(texts)

    def features(
        self, ids: Tensor | tuple[Tensor, Tensor], offsets: Tensor | None = None
    ) -> Tensor:
        """Token ids -> [B, hidden] features; an empty text gives the features of a zero mean."""
        if isinstance(ids, tuple):
            ids, offsets = ids
        if ids.ndim == 1 and offsets is None:
            raise ConfigError("offsets", "flat token ids need offsets (or pass a padded [B, L])")
        if ids.ndim == 2 and ids.shape[1] == 0:  # all texts empty: EmbeddingBag needs L >= 1
            ids = ids.new_full((ids.shape[0], 1), PAD_ID)
        return self.fc(self.embedding(ids, offsets))

    def forward(self, ids: Tensor | tuple[Tensor, Tensor], offsets: Tensor | None = None) -> Tensor:
        """Token ids -> [B, num_classes] logits."""
        return self.head(self.features(ids, offsets))
