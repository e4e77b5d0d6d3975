"""The process's one cache of causal LMs: each frozen base with the ``PeftModel`` around it.

A base is loaded once per process and key (model name, dtype, builder arguments,
quantisation, device) and shared by every handle (:class:`fedfm.fm.FoundationModel`), every
simulated client and every task of the process. Its adapters live in the same entry: peft
wraps the base once, when its first adapter is made.

The causal LMs of the model registry are encoders too (:data:`CAUSAL_LMS`, entries of
:data:`fedfm.models.encoders.ENCODERS` under the same names): such an encoder reads the
shared base of this cache with no adapter active, never a second copy of the model.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import peft
import torch

from fedfm.errors import ConfigError
from fedfm.models.causal_lm import TINY_MODELS, LMBundle
from fedfm.models.encoders import Encoder, lm_encoder, register_encoder
from fedfm.models.gated_mlp import fuse_gated_mlps
from fedfm.models.lora import active_adapters, set_active, trainable_adapters
from fedfm.models.registry import build_model

CAUSAL_LMS = ("smollm2-135m-instruct", "causal-lm", "tiny-llama", "tiny-qwen2", "tiny-gemma")
"""Causal LMs of the model registry that are also encoders (under the same names)."""


@dataclass
class SharedLM:
    """One cached causal LM.

    Attributes:
        bundle: The frozen base model and its tokenizer.
        adapted: The ``PeftModel`` around the base once an adapter exists, else ``None``
            (its LoRA layers sit inside ``bundle.model``).
        cast: The autocast dtypes its frozen linear weights are also kept in
            (:func:`fedfm.models.cast_once.cast_frozen_linears`).
    """

    bundle: LMBundle
    adapted: peft.PeftModel | None = None
    cast: set[torch.dtype] = field(default_factory=set)


_SHARED: dict[str, SharedLM] = {}


def base_key(
    name: str,
    dtype: str = "float32",
    args: Mapping[str, Any] | None = None,
    quantization: str | None = None,
    device: torch.device | None = None,
) -> str:
    """The key under which a base model is shared in this process (one base per device)."""
    parts: list[Any] = [name, dtype, dict(args or {})]
    if quantization is not None:  # unquantised keys stay as they always were
        parts.append(quantization)
    if device is not None and device.type != "cpu":  # so do the CPU's
        parts.append(str(device))
    return json.dumps(parts, sort_keys=True, default=str)


def cached(key: str) -> SharedLM | None:
    """The entry under ``key`` when it is loaded (nothing is loaded here)."""
    return _SHARED.get(key)


def forget(key: str) -> None:
    """Drops the entry under ``key`` (a base built on a device that must not be reused)."""
    _SHARED.pop(key, None)


def shared_lm(
    name: str,
    dtype: str = "float32",
    args: Mapping[str, Any] | None = None,
    quantization: str | None = None,
    device: torch.device | None = None,
) -> SharedLM:
    """The cache entry of ``(name, dtype, args)`` on ``device``, loaded on first use.

    Raises:
        ConfigError: ``name`` is not a causal language model (field ``task.model``).
    """
    args = dict(args or {})
    key = base_key(name, dtype, args, quantization, device)
    if key not in _SHARED:
        kwargs = dict(args)
        if name not in TINY_MODELS:  # the tiny test models are built in float32, then cast
            kwargs["dtype"] = dtype
        if quantization is not None:  # bitsandbytes places the weights as it quantises them
            kwargs["quantization"] = quantization
            if device is not None:
                kwargs["device"] = device
        bundle = build_model(name, **kwargs)
        if not isinstance(bundle, LMBundle):
            raise ConfigError("task.model", f"'{name}' is not a causal language model")
        if quantization is None:  # a quantised model keeps the dtypes bitsandbytes chose
            # Built on the CPU; in place (transformers types .to narrowly).
            torch.nn.Module.to(bundle.model, device=device, dtype=getattr(torch, dtype))
        fuse_gated_mlps(bundle.model)  # the same gradients, a third less MLP memory
        _SHARED[key] = SharedLM(bundle)
    return _SHARED[key]


def shared_base(
    name: str,
    dtype: str = "float32",
    args: dict[str, Any] | None = None,
    quantization: str | None = None,
    device: torch.device | None = None,
) -> LMBundle:
    """The process-wide frozen base model and tokenizer for ``(name, dtype, args)``.

    Both live on ``device`` (the CPU when ``None``).

    Loaded on first use and then shared by every simulated client and every task of the
    process. Once an adapter exists, its linear layers carry LoRA wrappers (inactive adapters
    leave its outputs unchanged). With ``quantization`` (``4bit``/``8bit``) the base is loaded
    quantised by bitsandbytes and ``dtype`` is its compute dtype.

    Raises:
        ConfigError: ``name`` is not a causal language model (field ``task.model``).
    """
    return shared_lm(name, dtype, args, quantization, device).bundle


@contextlib.contextmanager
def bare(entry: SharedLM) -> Iterator[None]:
    """Within the block the shared base computes as the plain model.

    No adapter is active and the model is in eval mode; the adapters' choice and the training
    flag come back on exit.
    """
    model, adapted = entry.bundle.model, entry.adapted
    training = model.training
    before = None
    if adapted is not None:
        before = (active_adapters(adapted), trainable_adapters(adapted))
        set_active(adapted, [], [])
    model.eval()
    try:
        yield
    finally:
        model.train(training)
        if adapted is not None and before is not None:
            set_active(adapted, *before)


def _causal_lm_encoder(
    name: str,
    device: torch.device | str | None = None,
    dtype: str = "float32",
    quantization: str | None = None,
    **args: Any,
) -> Encoder:
    """The causal LM ``name`` of the model registry (built with ``args``) as an encoder.

    It is the process's shared base, read with no adapter active.
    """
    where = torch.device(device) if device is not None else None
    entry = shared_lm(name, dtype, args, quantization, where)
    bundle = entry.bundle
    return lm_encoder(name, bundle.model, bundle.tokenizer, scope=lambda: bare(entry))


for _name in CAUSAL_LMS:
    register_encoder(
        _name, "texts", f"the causal LM {_name}: last token's hidden states", places=True
    )(functools.partial(_causal_lm_encoder, _name))
