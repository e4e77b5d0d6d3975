"""The C allocator of a training command: jemalloc where it is installed, on glibc.

A training step's activations are freed and allocated again in the same sizes step after
step. Torch allocates them 64-byte aligned (``posix_memalign``), and glibc (2.36 measured)
leaves the freed blocks as holes it rarely reuses for the next block of the same size: a
worker of ``benchmarks/vs_flower.py --llm`` holds about 0.3 GiB of free heap at a forward
pass's end (``benchmarks/heap_holes.py``). jemalloc reuses them; an allocator is chosen when
a process starts, and the embedded runtime's workers are forked from the command's process
(so that they share the base model), so ``fedfm run`` and ``fedfm reproduce`` start again
with jemalloc preloaded (``LD_PRELOAD``) where the library is found. Measured on that
workload: fedfm's summed peak PSS 2.35 and 2.39 GiB with glibc (104.2 and 111.6 s), 1.81 GiB
with jemalloc (97.1 and 100.9 s).

``FEDFM_ALLOCATOR``: ``auto`` (the default: jemalloc where found), ``system`` (never), or
``jemalloc`` (required: a one-line error where it is not found). Numbers do not depend on the
allocator (a run's metrics and adapters are the same to the bit).
"""

from __future__ import annotations

import glob
import os
import platform
import sys
from collections.abc import Mapping, Sequence

ENV = "FEDFM_ALLOCATOR"
CHOICES = ("auto", "system", "jemalloc")
COMMANDS = ("run", "reproduce")  # the commands that train in this process or its workers
_PATHS = (
    "/usr/lib/*-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


class AllocatorError(RuntimeError):
    """``FEDFM_ALLOCATOR`` names no allocator, or jemalloc was asked for and is not found."""


def find_jemalloc() -> str | None:
    """The path of jemalloc's shared library on this machine, if any."""
    for pattern in _PATHS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def preloaded(env: Mapping[str, str]) -> bool:
    """Whether ``env`` preloads jemalloc already."""
    return "jemalloc" in env.get("LD_PRELOAD", "")


def relaunch_env(
    argv: Sequence[str], env: Mapping[str, str], lib: str | None, glibc: bool
) -> dict[str, str] | None:
    """The environment to start this command again with, or None to go on as it is.

    Args:
        argv: The command line (``sys.argv``); only :data:`COMMANDS` start again.
        env: The environment.
        lib: jemalloc's library (:func:`find_jemalloc`).
        glibc: Whether this process runs on the GNU C library (elsewhere nothing changes).

    Raises:
        AllocatorError: ``FEDFM_ALLOCATOR`` is not one of :data:`CHOICES`, or is ``jemalloc``
            where it is not found.
    """
    choice = env.get(ENV, "auto") or "auto"
    if choice not in CHOICES:
        raise AllocatorError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    command = next((a for a in argv[1:] if not a.startswith("-")), None)
    if command not in COMMANDS or choice == "system" or not glibc or preloaded(env):
        return None
    if lib is None:
        if choice == "jemalloc":
            raise AllocatorError(f"{ENV}=jemalloc: no libjemalloc.so.2 (Debian: libjemalloc2)")
        return None
    before = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{lib}:{before}" if before else lib}


def command_process() -> bool:
    """Whether this process was started as the ``fedfm`` command (its script or ``-m fedfm``).

    A program that calls the command line's entry point in its own process (a test) is never
    started again.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "fedfm.__main__":
        return True
    return os.path.basename(str(getattr(main, "__file__", ""))) == "fedfm"


def relaunch_if_wanted(argv: Sequence[str] | None = None) -> None:
    """Starts this command again with jemalloc preloaded where :func:`relaunch_env` says so.

    Only where this process is the ``fedfm`` command itself (:func:`command_process`).

    Raises:
        AllocatorError: as :func:`relaunch_env`.
    """
    if not command_process():
        return
    argv = list(sys.argv if argv is None else argv)
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    env = relaunch_env(argv, os.environ, find_jemalloc(), glibc)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "fedfm", *argv[1:]], env)
