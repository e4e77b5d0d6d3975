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
weights in bfloat16), where autocast paid them per step and per process. Once cast, the
float32 weights are read only outside autocast; where they are pages of the model's file
(safetensors are mapped, not copied), :func:`page_out_file_weights` asks the kernel to
reclaim them (``MADV_PAGEOUT``, which never changes what a page holds: a later read maps
the file's page again), so the run does not keep two copies of the base resident.
"""

from __future__ import annotations

import ctypes
import functools
import os
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


MADV_PAGEOUT = 21
"""Linux's ``madvise`` advice to reclaim pages now (5.4 and later; content-preserving)."""


def _file_mappings() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's mappings of regular files (``/proc/self/maps``)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    spans.append((start, end))
    except OSError:  # not Linux
        return []
    return spans


def page_out_file_weights(model: nn.Module) -> int:
    """Asks the kernel to reclaim the float32 pages of the cast weights mapped from a file.

    Only the pages inside a mapping of a file (a safetensors checkpoint loaded without a
    copy), whole pages within each weight, of weights whose cast copy is current: their
    reads go to the copy under autocast, and any other read maps the page from the file
    again. Nothing happens where ``madvise`` cannot (not Linux, an older kernel) or where
    the weights live in anonymous memory (which ``MADV_PAGEOUT`` would swap out).

    Args:
        model: A model after :func:`cast_frozen_linears`.

    Returns:
        The bytes advised (0 where nothing could be).
    """
    spans = _file_mappings()
    if not spans:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    done: set[int] = set()
    advised = 0
    for module in model.modules():
        copy: CastCopy | None = getattr(module, CAST_ATTR, None)
        if copy is None or not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if w.data_ptr() in done or not copy.current(w, copy.weight.dtype):
            continue
        done.add(w.data_ptr())
        a, b = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
        if not any(s <= a and b <= e for s, e in spans):
            continue
        lo, hi = -(-a // page) * page, b // page * page  # whole pages inside the weight
        if hi > lo:
            if libc.madvise(lo, hi - lo, MADV_PAGEOUT) != 0:
                return advised  # EINVAL: a kernel without MADV_PAGEOUT
            advised += hi - lo
    return advised
