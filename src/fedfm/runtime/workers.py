"""Jobs run side by side in worker processes forked from the server (the embedded runtime's
``clients.parallel``).

Each job runs in a process of its own, forked when its turn comes, at most ``workers`` at a
time. A fork shares the server's memory page by page until either side writes a page, so the
frozen base, the task's data and the algorithm's client half are never copied: a worker pays
only for what its job allocates (activations, gradients, optimizer state, its reply). The job
is a closure over the server's objects, so anything the server could run in-process (a
handler of any message kind) runs in a worker unchanged; what it sends back is pickled
through a pipe. Results come back in the order of the jobs, whatever order the workers end
in, and a worker that dies (killed, out of memory) is that job's failure.

The job's last state of torch's default generator comes back with its result and is set in
the server when the result is handed on, so the server draws after an exchange exactly what
it draws after running the same jobs one after the other.

Threads: a worker gets its share of the threads. GNU OpenMP (torch's CPU thread pool on
Linux) hangs in a forked child that starts a pool of more than one thread when the parent
had started one; a worker of a process that already runs other threads therefore keeps one
thread (ours: one thread per worker is also how Flower lays out its simulation).
"""

from __future__ import annotations

import contextlib
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


class WorkerFailed(FedfmError):
    """A job that failed in its worker: its exception as the one line the failure log keeps,
    or the death of the worker."""


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


@dataclass
class _Running:
    pid: int
    fd: int
    data: bytearray = field(default_factory=bytearray)


def _child(job: Callable[[], Any], fd: int, threads: int) -> None:
    """The worker's whole life: run the job, send (outcome, generator state), exit."""
    code = 0
    try:
        # The server's sys.stdout/stderr may be a live display's proxies, whose lock a thread
        # of the server (its refresh) may have held at the fork: write to the streams beneath.
        sys.stdout = sys.__stdout__ or sys.stdout
        sys.stderr = sys.__stderr__ or sys.stderr
        torch.set_num_threads(threads)
        try:
            outcome: tuple[str, Any] = ("ok", job())
        except Exception as err:  # the job's failure travels as its one line
            outcome = ("error", error_reason(err))
        rng = torch.default_generator.get_state()
        try:
            payload = pickle.dumps((outcome, rng), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # an unpicklable result fails the job, not the worker
            payload = pickle.dumps((("error", f"result not sent: {error_reason(err)}"), rng))
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _start(job: Callable[[], Any], threads: int) -> _Running:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        os.close(read)
        _child(job, write, threads)
    os.close(write)
    os.set_blocking(read, False)
    return _Running(pid, read)


def _death(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"its worker process was killed by {name}"
    return f"its worker process exited with code {os.waitstatus_to_exitcode(status)}"


def _finish(run: _Running) -> tuple[Any, Any]:
    """The job's result (or its failure) and the generator state it left, once its pipe closed."""
    os.close(run.fd)
    _, status = os.waitpid(run.pid, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or not run.data:
        return WorkerFailed(_death(status)), None
    (kind, value), rng = pickle.loads(bytes(run.data))
    return (value if kind == "ok" else WorkerFailed(value)), rng


def side_by_side(jobs: Sequence[Callable[[], Any]], workers: int, threads: int) -> Iterator[Any]:
    """Runs each job in a forked worker, at most ``workers`` at once.

    Args:
        jobs: Closures over this process's objects; each result must pickle.
        workers: Most workers alive at once.
        threads: Torch threads of each worker.

    Yields:
        Each job's result, or a :class:`WorkerFailed` for a job that raised or whose worker
        died, in the order of ``jobs``. Workers still running when the iterator is closed
        are killed.
    """
    running: dict[int, _Running] = {}
    done: dict[int, tuple[Any, Any]] = {}
    nxt = head = 0
    sel = selectors.DefaultSelector()
    try:
        while head < len(jobs):
            while nxt < len(jobs) and len(running) < workers:
                running[nxt] = _start(jobs[nxt], threads)
                sel.register(running[nxt].fd, selectors.EVENT_READ, nxt)
                nxt += 1
            while head not in done:
                for key, _ in sel.select():
                    i = key.data
                    chunk = os.read(running[i].fd, 1 << 20)
                    if chunk:
                        running[i].data += chunk
                        continue
                    sel.unregister(running[i].fd)
                    done[i] = _finish(running.pop(i))
                if len(running) < workers and nxt < len(jobs):
                    break  # start the next job while the head still runs
            while head in done:
                result, rng = done.pop(head)
                if rng is not None:
                    torch.default_generator.set_state(rng)
                head += 1
                yield result
    finally:
        for run in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.pid, signal.SIGKILL)
            os.close(run.fd)
            os.waitpid(run.pid, 0)
        sel.close()
