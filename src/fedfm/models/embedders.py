"""Sentence embedders by name: texts -> L2-normalised vectors (voting, evaluation, distances).

* ``all-minilm-l6-v2`` (default everywhere): all-MiniLM-L6-v2 through sentence-transformers
  (:mod:`fedfm.models.encoder`), 384-d, loaded once per process and shared.
* ``hashed-ngrams``: word uni- and bigram counts hashed into ``dim`` buckets (fedfm's
  :class:`~fedfm.models.students.HashingTokenizer`), L2-normalised. No model to load: for
  tests and for machines without the MiniLM package. Written here because it is eight lines
  over the tokenizer fedfm already has.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedfm.registry import Registry

Embedder = Callable[[Sequence[str]], np.ndarray]
"""Texts -> ``(n, dim)`` float32, each row of L2 norm 1 (0 for a text with nothing to embed)."""

EMBEDDERS: Registry[Callable[..., Embedder]] = Registry("embedder", "algo.embedder")


@functools.cache
def get_embedder(name: str, device: str = "cpu") -> Embedder:
    """The embedder ``name``, built once per process and device.

    Args:
        name: A registered embedder.
        device: Where its model computes (a builder without a ``device`` argument, such as
            ``hashed-ngrams``, has no model and ignores it).

    Raises:
        UnknownNameError: No such embedder (field ``algo.embedder``).
    """
    builder = EMBEDDERS.get(name)
    takes_device = "device" in inspect.signature(builder).parameters
    # Ordinary weights even when first asked inside a no-grad handler (inference mode), so
    # the server can use the same embedder outside it.
    with torch.inference_mode(False):
        return builder(device=device) if takes_device else builder()


def known_embedder(name: str) -> str:
    """``name`` when it is a registered embedder (a pydantic validator of config fields).

    Raises:
        ValueError: It is not, naming the choices.
    """
    if name not in EMBEDDERS:
        raise ValueError(f"unknown embedder '{name}' (choose from {', '.join(EMBEDDERS)})")
    return name


@EMBEDDERS.register("all-minilm-l6-v2", "all-MiniLM-L6-v2 sentence embeddings (384-d)")
def _minilm(device: str = "cpu") -> Embedder:
    from fedfm.models.encoder import MINILM, encode, load_sentence_encoder

    model = load_sentence_encoder(MINILM, device=device)

    def embed(texts: Sequence[str]) -> np.ndarray:
        return encode(model, list(texts), batch_size=64, normalize=True)

    return embed


@EMBEDDERS.register("hashed-ngrams", "hashed word uni/bigram counts, L2-normalised (256-d)")
def _hashed(dim: int = 256) -> Embedder:
    from fedfm.models.students import HashingTokenizer

    tok = HashingTokenizer(dim + 1)  # bucket 0 is padding

    def embed(texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), dim), dtype=np.float32)
        if not texts:
            return out
        flat, offsets = tok.encode(list(texts))
        ends = [*offsets[1:].tolist(), flat.numel()]
        for i, (s, e) in enumerate(zip(offsets.tolist(), ends, strict=True)):
            np.add.at(out[i], flat[s:e].numpy() - 1, 1.0)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)

    return embed
