"""Jobs run side by side in worker processes forked from the server.

They serve the embedded runtime's ``clients.parallel``.

Up to ``workers`` processes are forked for each call (each exchange of messages), and each
takes the next job when it is done with one, so a worker's warm-up (first allocations, kernel
set-up) is paid once per worker, not once per job. A fork shares the server's memory page by
page until either side writes a page, so the frozen base, the task's data and the
algorithm's client half are never copied: a worker pays only for what its jobs allocate
(activations, gradients, optimizer state, replies). A job is a closure over the server's
objects, so anything the server could run in-process (a handler of any message kind) runs in
a worker unchanged; what it sends back is pickled through a pipe. Results come back in the
order of the jobs, whatever order the workers end them in, and a worker that dies (killed,
out of memory) fails its job; the jobs left go to the other workers or to a new one.

The job's last state of torch's default generator comes back with its result and is set in
the server when the result is handed on, so the server draws after an exchange exactly what
it draws after running the same jobs one after the other.

Memory: a worker maps every allocation of :data:`MMAP_THRESHOLD` bytes or more that no free
block of its heap fits (``mallopt``, GNU C library only; glibc looks in its free blocks first,
and a worker inherits the server's). glibc's default threshold grows to the largest block
freed (up to 32 MiB), after which a training step's activations (1-3 MiB each for SmolLM2 at
4 x 128 tokens) come from the heap, whose holes between steps stay resident: with the fixed
threshold, the two workers' summed peak of ``benchmarks/vs_flower.py --llm``'s fedfm side was
about 0.12 GiB lower at no measured cost in wall time; 1 MiB saved 0.3 GiB but cost 5% (page
faults). Below the threshold, a worker's heap still holds about 0.3 GiB of free holes at a
forward pass's end (``benchmarks/heap_holes.py``): glibc's, which only settings made when the
server's process starts reduce.

Threads: a worker gets its share of the threads. GNU OpenMP (torch's CPU thread pool on
Linux) hangs in a forked child that starts a pool of more than one thread when the parent
had started one; a worker of a process that already runs other threads therefore keeps one
thread (ours: one thread per worker is also how Flower lays out its simulation).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import selectors
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedfm.core.federation import error_reason
from fedfm.errors import FedfmError

MMAP_THRESHOLD = 2 << 20
"""Bytes from which a worker's allocations are mapped, not taken from the heap."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fixes this process's mmap threshold; False where the C library has none.

    glibc serves a large block from the heap's free top before it maps one, and the server's
    top may be tens of MiB (its trim threshold grows with the mmap threshold): the trim
    threshold is fixed at twice the mmap threshold (glibc's own ratio) and the top trimmed.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # not the GNU C library
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    trim.argtypes = [ctypes.c_size_t]
    fixed = mallopt(_M_TRIM_THRESHOLD, 2 * threshold) and mallopt(_M_MMAP_THRESHOLD, threshold)
    trim(0)
    return bool(fixed)


class WorkerFailed(FedfmError):
    """A job that failed in its worker.

    Its exception as the one line the failure log keeps, or the death of the worker.
    """


def _threads_alive() -> int:
    """OS threads of this process (2 where it cannot be read: taken as more than one)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2


def worker_threads(total: int, workers: int) -> int:
    """Torch threads for each of ``workers`` workers sharing ``total`` threads.

    One where this process already runs more than one thread (see the module's note).
    """
    if _threads_alive() > 1:
        return 1
    return max(1, total // max(1, workers))


_LEN = 8  # bytes of a length or job-index header on the pipes
_STOP = (1 << 63) - 1  # the job index that tells a worker to exit


@dataclass
class _Worker:
    """One worker as the server sees it: its pipes, its job, what it has sent so far."""

    pid: int
    cmd: int  # the server writes job indices here
    res: int  # the worker writes length-prefixed results here
    job: int | None = None
    data: bytearray = field(default_factory=bytearray)


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return b""
        out += chunk
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _run_one(job: Callable[[], Any]) -> bytes:
    """One job's (outcome, generator state), pickled; a failure travels as its one line."""
    try:
        outcome: tuple[str, Any] = ("ok", job())
    except Exception as err:
        outcome = ("error", error_reason(err))
    rng = torch.default_generator.get_state()
    try:
        return pickle.dumps((outcome, rng), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # an unpicklable result fails the job, not the worker
        return pickle.dumps((("error", f"result not sent: {error_reason(err)}"), rng))


def _serve(jobs: Sequence[Callable[[], Any]], cmd: int, res: int, threads: int) -> None:
    """The worker's whole life: run the jobs the server names, one at a time, then exit."""
    code = 0
    try:
        # The server's sys.stdout/stderr may be a live display's proxies, whose lock a thread
        # of the server (its refresh) may have held at the fork: write to the streams beneath.
        sys.stdout = sys.__stdout__ or sys.stdout
        sys.stderr = sys.__stderr__ or sys.stderr
        torch.set_num_threads(threads)
        map_large_allocations()
        while True:
            head = _read_exact(cmd, _LEN)
            if not head or int.from_bytes(head, "little") == _STOP:
                break  # told to stop, or the server is gone
            payload = _run_one(jobs[int.from_bytes(head, "little")])
            _write_all(res, len(payload).to_bytes(_LEN, "little") + payload)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _fork(jobs: Sequence[Callable[[], Any]], threads: int, others: list[_Worker]) -> _Worker:
    cmd_r, cmd_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: only its own pipe ends stay open, so it sees the server go
        for fd in [cmd_w, res_r, *(x for w in others for x in (w.cmd, w.res))]:
            os.close(fd)
        _serve(jobs, cmd_r, res_w, threads)
    os.close(cmd_r)
    os.close(res_w)
    os.set_blocking(res_r, False)
    return _Worker(pid, cmd_w, res_r)


def _death(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"its worker process was killed by {name}"
    return f"its worker process exited with code {os.waitstatus_to_exitcode(status)}"


def _results(w: _Worker) -> Iterator[tuple[Any, Any]]:
    """The complete results in a worker's buffer: (result or failure, generator state)."""
    while len(w.data) >= _LEN:
        n = int.from_bytes(w.data[:_LEN], "little")
        if len(w.data) < _LEN + n:
            return
        (kind, value), rng = pickle.loads(bytes(w.data[_LEN : _LEN + n]))
        del w.data[: _LEN + n]
        yield (value if kind == "ok" else WorkerFailed(value)), rng


def side_by_side(jobs: Sequence[Callable[[], Any]], workers: int, threads: int) -> Iterator[Any]:
    """Runs the jobs in up to ``workers`` forked workers, each taking the next job when done.

    A worker lives for this call only (forked from the server as it is now); a job runs in
    whichever worker is free, so a worker's warm-up (first allocations, kernel set-up) is paid
    once per worker, not once per job. A worker that dies fails its job; the jobs left go to
    the others, or to a new worker.

    Args:
        jobs: Closures over this process's objects; each result must pickle.
        workers: Most workers alive at once.
        threads: Torch threads of each worker.

    Yields:
        Each job's result, or a :class:`WorkerFailed` for a job that raised or whose worker
        died, in the order of ``jobs``. Workers still alive when the iterator is closed are
        killed.
    """
    pending = list(range(len(jobs)))[::-1]  # popped from the end: first job first
    live: list[_Worker] = []
    done: dict[int, tuple[Any, Any]] = {}
    sel = selectors.DefaultSelector()

    def give(w: _Worker) -> None:
        w.job = pending.pop() if pending else None
        try:
            _write_all(w.cmd, (_STOP if w.job is None else w.job).to_bytes(_LEN, "little"))
        except BrokenPipeError:  # it died between jobs: the job goes to another worker
            if w.job is not None:
                pending.append(w.job)
            w.job = None

    def start() -> None:
        w = _fork(jobs, threads, live)
        live.append(w)
        sel.register(w.res, selectors.EVENT_READ, w)
        give(w)

    head = 0
    # The server's objects leave the collector's generations: a worker's collections would
    # otherwise write to every page holding one, copying the shared pages (ours).
    gc.freeze()
    try:
        for _ in range(min(workers, len(jobs))):
            start()
        while head < len(jobs):
            while head not in done:
                for key, _ in sel.select():
                    w = key.data
                    chunk = os.read(w.res, 1 << 20)
                    if chunk:
                        w.data += chunk
                        for outcome in _results(w):
                            assert w.job is not None
                            done[w.job] = outcome
                            give(w)
                        continue
                    sel.unregister(w.res)
                    live.remove(w)
                    os.close(w.res)
                    os.close(w.cmd)
                    _, status = os.waitpid(w.pid, 0)
                    if w.job is not None:  # it died on a job: that job failed
                        done[w.job] = (WorkerFailed(_death(status)), None)
                    if pending and len(live) < workers:
                        start()
            while head in done:
                result, rng = done.pop(head)
                if rng is not None:
                    torch.default_generator.set_state(rng)
                head += 1
                yield result
    finally:
        for w in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            os.close(w.res)
            os.close(w.cmd)
            os.waitpid(w.pid, 0)
        sel.close()
        gc.unfreeze()
