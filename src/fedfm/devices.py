"""Devices: the ``device`` config value, its checks, and what a device supports.

A leaf module (it imports only ``fedfm.errors``, and torch inside the functions), so the config
layer can validate ``device`` without importing torch for the common values.

``device`` takes ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``. ``auto`` is CUDA when torch
sees a CUDA device, else the CPU. It never picks Apple's MPS: on MPS, float64 (FedHDS's
features, the accountants' inputs) is missing, Opacus's per-sample gradients and some
generation kernels fall back to the CPU or are unsupported, and bfloat16 autocast depends on
the macOS version, so a run that works on the CPU could fail or differ there. ``mps`` is
accepted when asked for by name.

Autocast: bfloat16 where the device computes it natively (CPUs with AVX512-BF16 or AMX, CUDA
from compute capability 8.0, Ampere on); on other GPUs float16 with a gradient scaler
(:func:`needs_grad_scaler`); on other CPUs none (float32), because there bfloat16 and float16
matrix products are emulated, about ten times slower than float32's.

Placement: a model lives on the run's device; what it computes on follows the model
(:func:`model_device`, :func:`to_device`), and what leaves a client (messages, client state,
checkpoints) is copied back to the CPU where it leaves (``fedfm.core.train.get_params``).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N", "mps")
_PATTERN = re.compile(r"auto|cpu|mps|cuda(?::(\d+))?")


def check(name: str) -> str:
    """Validates a ``device`` value against this machine.

    Args:
        name: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

    Returns:
        ``name`` unchanged (``auto`` stays ``auto``: it is resolved when used).

    Raises:
        ValueError: The name is unknown, or names a device this machine does not have (the
            reason reads as one line; the config layer adds the field).
    """
    m = _PATTERN.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown device {name!r} (choose from {', '.join(DEVICE_NAMES)})")
    if name in ("auto", "cpu"):
        return name
    import torch

    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{name!r} asked for, but torch sees no CUDA device on this machine")
        index, count = int(m.group(1) or 0), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"{name!r} asked for, but this machine has {count} CUDA device(s)")
    elif not torch.backends.mps.is_available():
        raise ValueError("'mps' asked for, but torch sees no MPS device on this machine")
    return name


def resolve(name: str = "auto") -> torch.device:
    """The torch device a ``device`` value stands for on this machine.

    Args:
        name: A value :func:`check` accepts.

    Returns:
        ``cuda`` (device 0) for ``auto`` when CUDA is present, else ``cpu``; other names as
        given.

    Raises:
        ValueError: See :func:`check`.
    """
    import torch

    check(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_bf16_native() -> bool:
    """Whether this CPU has bfloat16 instructions (x86: AVX512-BF16 or AMX).

    Other architectures are taken to have them (ARMv8.6 and later; fedfm cannot ask torch).
    """
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def supports_bf16(device: torch.device) -> bool:
    """Whether autocast on ``device`` can compute in bfloat16 natively."""
    import torch

    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return device.type == "cpu" and cpu_bf16_native()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 where :func:`supports_bf16`.

    Else float16 on an accelerator and None (no autocast, float32) on a CPU, where half-precision
    products are emulated and slower.
    """
    import torch

    if supports_bf16(device):
        return torch.bfloat16
    return None if device.type == "cpu" else torch.float16


def needs_grad_scaler(device: torch.device) -> bool:
    """Whether training under :func:`autocast_dtype` needs a gradient scaler (float16 only)."""
    import torch

    return autocast_dtype(device) == torch.float16


def memory_available(device: torch.device) -> int:
    """Bytes a run could still use on ``device``: free device memory, or available RAM.

    For the CPU (and MPS, which shares it) psutil's ``available`` RAM; for CUDA the free
    memory of that device as the driver reports it.
    """
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def describe(device: torch.device) -> str:
    """One short phrase for logs: ``cpu`` or ``cuda:0 (NVIDIA H100, 80.0 GiB)``."""
    if device.type != "cuda":
        return device.type
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (CPU for a parameterless module)."""
    import torch

    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (tuples, lists and dicts walked).

    Anything else (texts, ids, numbers) is returned as it is; a tensor already there is not
    copied, so on the CPU this changes nothing.
    """
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def autocast_in_effect(device: torch.device, enabled: bool) -> torch.dtype | None:
    """The dtype a run's ``autocast_bf16: enabled`` computes in on ``device`` (None: none)."""
    return autocast_dtype(device) if enabled else None


def autocast(
    device: torch.device, enabled: bool = True, *, half: bool = True
) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision autocast on ``device`` when ``enabled``, else a no-op.

    The dtype is :func:`autocast_dtype`'s: bfloat16 where native; float16 on other
    accelerators (CUDA before compute capability 8.0, MPS) when ``half``, whose training
    needs the gradient scaler that :func:`fedfm.core.train.local_train` adds on such a
    device (:func:`needs_grad_scaler`); none on a CPU without bfloat16 instructions.
    DP-SGD passes ``half=False``: it clips per-sample gradients, which a scaled loss would
    scale, so there it stays in the model's dtype.
    """
    import torch

    dtype = autocast_in_effect(device, enabled)
    if dtype is None or (dtype == torch.float16 and not half):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for float16 training on ``device`` (None where bfloat16 is native).

    It starts at 2^12 rather than torch's 2^16: a local round is a few steps, and every step
    skipped while the scale falls to where the gradients fit is a step the client loses.
    """
    if not needs_grad_scaler(device):
        return None
    import torch

    return torch.amp.GradScaler(device.type, init_scale=2.0**12)


def fork_refused(device: torch.device) -> str | None:
    """Why clients cannot be trained in processes forked from the server on ``device``, or None.

    Forked workers share the server's frozen base through copy-on-write pages; a CUDA context
    does not survive a fork, and some platforms have no fork at all.
    """
    import os

    if not hasattr(os, "fork"):
        return "worker processes are forked from the server, and this platform cannot fork"
    if device.type != "cpu":
        return (
            f"worker processes share the base by fork, which {device.type} does not survive;"
            " on an accelerator clients run one after the other (clients.parallel: 1 or auto)"
        )
    return None


def cores() -> int:
    """CPU cores this process may run on."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
