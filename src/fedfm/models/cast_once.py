"""Frozen linear layers cast once to the autocast dtype, not on every forward pass.

Under autocast, ``F.linear`` casts its float32 weight to bfloat16 (or float16) on every call,
and when the input needs a gradient (LoRA below it) autograd keeps that cast copy until the
backward pass: for SmolLM2-135M about 270 MB per training step, per process training side by
side, and the cast itself on every forward (every generated token). A frozen base never
changes, so :func:`cast_frozen_linears` casts each frozen ``nn.Linear`` once and
its forward hands that copy to ``F.linear`` whenever autocast to its dtype is on.
The result is the same to the bit (autocast's cast rounds the same way, and casting an
already cast weight is a no-op); outside autocast, or when the weight trains or changed in
place since, the float32 weight is used as before. Made before clients are forked
(:mod:`fedfm.runtime.workers`), the copy is shared page by page by every worker.

The copy is ours (no paper): it costs the cast weights once (half the float32 linear
weights in bfloat16), where autocast paid them per step and per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CAST_ATTR = "fedfm_cast"
"""The attribute of an ``nn.Linear`` that holds its :class:`CastCopy`."""


@dataclass
class CastCopy:
    """A frozen weight's copy in an autocast dtype.

    Attributes:
        weight: The cast copy (no gradient).
        version: The weight's version counter when it was cast: an in-place change of the
            weight since (``copy_``, an optimizer step) makes the copy stale, and unused.
    """

    weight: Tensor
    version: int

    def current(self, w: Tensor, dtype: torch.dtype) -> bool:
        """Whether this copy is ``w`` in ``dtype``, on its device, and ``w`` unchanged since."""
        return (
            self.weight.dtype == dtype
            and self.weight.device == w.device
            and self.version == w._version
        )


def _forward(module: nn.Linear, x: Tensor) -> Tensor:
    """``F.linear`` with the cast copy when autocast to its dtype is on, else as usual."""
    w: Tensor = module.weight
    copy: CastCopy | None = getattr(module, CAST_ATTR, None)
    if copy is not None and not w.requires_grad:
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and copy.current(w, torch.get_autocast_dtype(kind)):
            w = copy.weight
    return F.linear(x, w, module.bias)


def cast_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Gives every frozen float32 ``nn.Linear`` of ``model`` a cast copy that autocast uses.

    Only plain ``nn.Linear`` modules (not quantised or adapter layers, which subclass or wrap
    it) with a float32 weight that does not train; they stay ``nn.Linear`` (their class is
    what Opacus and peft dispatch on), with the forward of this module. Calling it again
    recasts only what is missing or stale. Tied weights (an LM head tied to the embeddings)
    are cast once.

    Args:
        model: The model (its modules are changed in place).
        dtype: The autocast dtype (``torch.bfloat16`` or ``torch.float16``).

    Returns:
        The bytes of the cast copies made by this call.
    """
    made: dict[int, CastCopy] = {}
    added = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.requires_grad or w.dtype != torch.float32:
            continue
        copy: CastCopy | None = getattr(module, CAST_ATTR, None)
        if copy is None or not copy.current(w, dtype):
            copy = made.get(w.data_ptr())
        if copy is None:
            with torch.no_grad():
                copy = CastCopy(w.detach().to(dtype), w._version)
            added += copy.weight.numel() * copy.weight.element_size()
        made[w.data_ptr()] = copy
        setattr(module, CAST_ATTR, copy)
        module.forward = functools.partial(_forward, module)  # type: ignore[method-assign]
    return added
