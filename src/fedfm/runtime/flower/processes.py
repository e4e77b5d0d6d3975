"""Starting, watching and stopping the Flower processes fedfm runs (each in its own group).

Flower's processes start helpers of their own in new sessions (the SuperLink starts
``flower-superexec``, which starts the ServerApp process), out of reach of a signal to the
process group fedfm started. :func:`stop` therefore stops each process's whole tree of
descendants, found before the first signal is sent. :func:`stop_on_signals` turns SIGTERM
and SIGINT into :class:`Stopped`, so the commands stop what they started and remove their
temporary files on the way out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm.errors import FedfmError
from fedfm.runtime.flower.options import flower_env_vars

log = logging.getLogger("fedfm")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (Flower colours its log lines)."""
    return _ANSI.sub("", text)


class DeployError(FedfmError):
    """A Flower process failed to start or a run failed on the deployment engine."""


def bin_path(name: str) -> str:
    """The path of a Flower command of this interpreter's environment.

    Found even when the environment is not on PATH; the bare name when it is not there.
    """
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def free_port(host: str = "127.0.0.1", udp: bool = False) -> int:
    """A TCP (or UDP) port free on ``host`` right now."""
    with socket.socket(type=socket.SOCK_DGRAM if udp else socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A started process (in its own process group) and its log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def process_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Flower process started by fedfm.

    ``extra`` overrides this process's variables, except ``PYTHONPATH``: its folders come
    first and this process's follow, so the child still imports what this process imports.
    """
    env = dict(os.environ)
    env.update(flower_env_vars(home))
    # Flower starts its helpers (flower-superexec, flwr-serverapp) by name from PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    extra = dict(extra or {})
    dirs = [p for p in extra.pop("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(extra)
    return with_pythonpath(env, dirs)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: the child gets SIGTERM when the thread that started it ends, so a `fedfm
    # serve` or `fedfm client` killed with SIGKILL leaves no SuperLink or SuperNode behind.
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start(
    name: str,
    cmd: Sequence[str],
    env: Mapping[str, str],
    log_dir: Path,
    die_with_parent: bool = False,
) -> Proc:
    """Starts ``cmd`` in a new process group, output to ``log_dir/<name>.log``.

    Args:
        name: Name of the process (and of its log file).
        cmd: Command line.
        env: Environment.
        log_dir: Folder of the log file.
        die_with_parent: On Linux, end the process when the calling thread ends (for
            long-running commands started from the main thread).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{name}.log"
    hook = _die_with_parent if die_with_parent and sys.platform == "linux" else None
    with path.open("wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=hook,
        )
    return Proc(name, popen, path)


def stop(procs: Iterable[Proc], grace_s: float = 5.0) -> None:
    """Stops processes and everything they started.

    SIGTERM to each process group and to every descendant (also those in sessions of their own),
    then SIGKILL to what is left.
    """
    procs = list(procs)
    # Found before any signal: a descendant whose parent dies is re-parented out of reach.
    tree = sorted({d for p in procs for d in descendants(p.popen.pid)})
    for p in procs:
        _signal_group(p.popen, signal.SIGTERM)
    _signal_pids(tree, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        # Children may outlive a leader that exited; the group id stays valid until they go.
        _signal_group(p.popen, signal.SIGKILL)
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("process %s (pid %d) did not stop", p.name, p.popen.pid)
    _signal_pids(tree, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, their children, ...), from ``/proc``.

    Empty where there is no ``/proc`` (then only the process groups are signalled).
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo += children.get(child, [])
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; its parent has not collected it yet


def _signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Stopped(BaseException):
    """SIGTERM or SIGINT reached a fedfm command (see :func:`stop_on_signals`).

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the
    way out swallows it.

    Args:
        signum: The signal.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's code for a command ended by this signal: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Raises :class:`Stopped` in the main thread on SIGTERM or SIGINT.

    Raises :class:`Stopped` in the main thread on SIGTERM or SIGINT (once; a second
    signal while stopping is ignored, so the clean-up is not cut short).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set in the main thread
        return
    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise Stopped(signum)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def wait_port(host: str, port: int, timeout_s: float, proc: Proc | None = None) -> None:
    """Waits until something listens on ``host:port``.

    Raises:
        DeployError: Timeout, or ``proc`` exited first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise DeployError(f"{proc.name} exited (code {proc.popen.returncode}):\n{proc.tail()}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise DeployError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


def run_flwr(
    args: Sequence[str],
    env: Mapping[str, str],
    timeout_s: float | None,
    cwd: Path,
    echo: bool = False,
) -> str:
    """Runs a ``flwr`` CLI command and returns its output (also printed when ``echo``).

    Raises:
        DeployError: It failed or timed out (its process group is killed).
    """
    return FlwrCall(args, env, cwd, echo=echo).wait(timeout_s)


class FlwrCall:
    """A ``flwr`` CLI command running in its own process group.

    Its output is collected (for :meth:`wait` and its errors) and written to ``log_path`` as it
    comes.

    Args:
        args: The arguments after ``flwr``.
        env: Its environment.
        cwd: Its working folder.
        log_path: A file that gets every line of its output (None: none).
        echo: Also print each line (colour codes removed when the output is not a
            terminal), or, given a callable, hand it each line to print what it chooses.
        when_up: ``(host, port, wait_s)``: start the CLI now but run the command once
            ``host:port`` listens (:mod:`fedfm.runtime.flower.flwr_when_up`).
        after: With ``when_up``, also wait until this file exists.
    """

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path | None = None,
        echo: bool | Callable[[str], None] = False,
        when_up: tuple[str, int, float] | None = None,
        after: Path | None = None,
    ) -> None:
        self.args = list(args)
        exe = [bin_path("flwr")]
        if when_up is not None:
            host, port, wait_s = when_up
            exe = [sys.executable, "-m", "fedfm.runtime.flower.flwr_when_up"]
            exe += [host, str(port), str(wait_s)]
            exe += [] if after is None else ["--after", str(after)]
        self.popen = subprocess.Popen(
            [*exe, *args],
            env=dict(env),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=_pump, args=(self.popen, self.lines, echo, log_path), daemon=True
        )
        self._reader.start()

    def kill(self) -> None:
        """Ends the command and everything in its process group."""
        _signal_group(self.popen, signal.SIGKILL)
        self.popen.wait()
        self._reader.join(5)

    def wait(self, timeout_s: float | None) -> str:
        """Waits for the command; its output.

        Raises:
            DeployError: It failed or timed out (its process group is killed).
        """
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            out = "".join(self.lines)[-3000:]
            raise DeployError(
                f"`flwr {self.args[0]}` timed out after {timeout_s:.0f} s:\n{out}"
            ) from None
        finally:
            _signal_group(self.popen, signal.SIGKILL)
        self._reader.join(5)
        out = "".join(self.lines)
        if self.popen.returncode != 0:
            cmd = " ".join(self.args[:2])
            raise DeployError(f"`flwr {cmd}` failed ({self.popen.returncode}):\n{out[-3000:]}")
        return out


def _pump(
    popen: subprocess.Popen,
    lines: list[str],
    echo: bool | Callable[[str], None],
    log_path: Path | None = None,
) -> None:
    assert popen.stdout is not None
    plain = not sys.stdout.isatty()  # a log file or a pipe gets no colour codes
    log_file = log_path.open("a") if log_path is not None else None
    try:
        for line in popen.stdout:
            lines.append(line)
            if log_file is not None:
                log_file.write(strip_ansi(line))
                log_file.flush()
            if callable(echo):
                echo(line)
            elif echo:
                sys.stdout.write(strip_ansi(line) if plain else line)
                sys.stdout.flush()
    finally:
        if log_file is not None:
            log_file.close()


def plugin_pythonpath(imports: Sequence[str]) -> list[str]:
    """Folders that make the plugin modules importable in child processes."""
    dirs: list[str] = []
    for name in imports:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        # A package lives in <root>/<name>/__init__.py, a module in <root>/<name>.py.
        root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
        if str(root) not in dirs:
            dirs.append(str(root))
    return dirs


def with_pythonpath(env: dict[str, str], dirs: Sequence[str]) -> dict[str, str]:
    """Puts ``dirs`` first on ``env``'s ``PYTHONPATH`` (in place; also returned)."""
    if dirs:
        parts = [*dirs, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env
