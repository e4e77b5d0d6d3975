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
(safetensors are mapped, not copied) and hold its bytes, :func:`release_file_weights` drops
them from the process (they stay in the page cache; a later read maps the file's page
again), so the run does not keep two copies of the base resident.
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


MADV_DONTNEED = 4
"""Linux's ``madvise`` advice to drop a range's pages from this process (not from the page
cache): a later read of a private file mapping maps the file's page again."""

CHUNK = 16 << 20
"""Bytes compared with the file at a time."""


@dataclass(frozen=True)
class _Mapping:
    """A mapping of a regular file: ``[start, end)`` in memory from ``offset`` in ``path``."""

    start: int
    end: int
    offset: int
    inode: int
    path: str


def _file_mappings() -> list[_Mapping]:
    """This process's mappings of regular files (``/proc/self/maps``; none off Linux)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    where = (int(fields[2], 16), int(fields[4]), fields[5].rstrip("\n"))
                    spans.append(_Mapping(start, end, *where))
    except OSError:
        return []
    return spans


def _same_as_file(lo: int, hi: int, where: _Mapping) -> bool:
    """Whether memory ``[lo, hi)`` holds the bytes its file has there (read in chunks)."""
    try:
        fd = os.open(where.path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != where.inode:  # the path names another file now
            return False
        for at in range(lo, hi, CHUNK):
            n = min(CHUNK, hi - at)
            if os.pread(fd, n, where.offset + at - where.start) != ctypes.string_at(at, n):
                return False
    finally:
        os.close(fd)
    return True


def release_file_weights(model: nn.Module) -> int:
    """Drops from this process the float32 pages of cast weights that are their file's bytes.

    A safetensors checkpoint is mapped, not copied: after :func:`cast_frozen_linears` the
    float32 weights are read only outside autocast, so their pages need not stay resident.
    For each cast weight whose copy is current, the whole pages inside it that lie in a
    private mapping of a file and hold exactly the file's bytes (compared first: a weight
    changed in place is left alone) are dropped with ``MADV_DONTNEED``. They stay in the
    page cache, and a later read maps the file's page again, with the same bytes. Nothing
    happens off Linux or for weights in anonymous memory.

    Args:
        model: A model after :func:`cast_frozen_linears`.

    Returns:
        The bytes dropped (0 where nothing could be).
    """
    spans = _file_mappings()
    if not spans:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    seen: set[int] = set()
    dropped = 0
    for module in model.modules():
        copy: CastCopy | None = getattr(module, CAST_ATTR, None)
        if copy is None or not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if w.data_ptr() in seen or not copy.current(w, copy.weight.dtype):
            continue
        seen.add(w.data_ptr())
        a, b = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
        lo, hi = -(-a // page) * page, b // page * page  # whole pages inside the weight
        where = next((m for m in spans if m.start <= a and b <= m.end), None)
        if where is None or hi <= lo or not _same_as_file(lo, hi, where):
            continue
        if libc.madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            dropped += hi - lo
    return dropped
