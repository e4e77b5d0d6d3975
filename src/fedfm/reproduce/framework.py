"""The study framework (``docs/studies.md``).

It runs a :class:`Study`'s jobs, records ``study.json``, lists and times the jobs for ``--dry-run``
and writes the report.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import math
import multiprocessing as mp
import os
import pkgutil
import platform
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from queue import Empty
from typing import Any, ClassVar, Generic, TypeVar

import yaml

from fedfm.core.runfolder import read_json, read_jsonl
from fedfm.errors import ConfigError
from fedfm.registry import Registry
from fedfm.reproduce.stats import NONE, Estimate, mde_of, verdict
from fedfm.reproduce.tables import DASH, Text, head, num, row

G = TypeVar("G")  # a study's grid
R = TypeVar("R")  # what a study reads from its runs

RECORD = "study.json"
STAMP = "%Y-%m-%dT%H:%M:%S"  # the record's times
RESULT = "result.json"
TEXT = Text("framework")


class Unmet(Exception):
    """A job's needs do not allow it (e.g. a measured value is missing): it is skipped."""


ConfigFn = Callable[[Mapping[str, "RunView"]], Mapping[str, Any]]


@dataclass(frozen=True)
class Run:
    """A run of the engine in the folder ``name``.

    ``config`` is its config, or a function of the views of ``needs`` (by name) that builds it
    (raising :class:`Unmet`); the framework sets ``name``, ``out_dir`` and ``threads: 1``. Jobs of
    one ``group`` cost about the same (``--dry-run`` estimates from them); ``part``: the command
    that runs it (``fedfm reproduce STUDY --part PART``), :data:`MAIN` by default.
    """

    name: str
    config: Mapping[str, Any] | ConfigFn
    needs: tuple[str, ...] = ()
    group: str = ""
    part: str = ""
    kind: ClassVar[str] = "run"


@dataclass(frozen=True)
class Compute:
    """A job that is not a run.

    A job that is not a run: ``fn(inputs, folder, **params)`` (module-level: it may run in
    a worker) gets the folders of ``needs`` by name and its own and returns a JSON mapping,
    kept in ``result.json`` and computed again when ``params`` or the inputs change.
    """

    name: str
    fn: Callable[..., Mapping[str, Any]]
    params: Mapping[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    group: str = ""
    part: str = ""
    kind: ClassVar[str] = "compute"


Job = Run | Compute
MAIN = "main"
"""The part of a job that names none: a study too long for one command splits its main jobs
into parts, each run by its own ``--part`` invocation (each under the 90-minute rule)."""


def part_of(job: Job) -> str:
    """The part a job belongs to (:data:`MAIN` where it names none)."""
    return job.part or MAIN


@cache
def _preset_json(name: str) -> str:
    from fedfm.config import load_config

    return json.dumps(load_config(name).model_dump(mode="json"))


def preset(name: str) -> dict[str, Any]:
    """A preset as a validated, complete config mapping (a fresh copy)."""
    data: dict[str, Any] = json.loads(_preset_json(name))
    return data


def resolved(config: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """A run config validated, and its algorithm's and task's configs (every default filled)."""
    from fedfm.config import load_config
    from fedfm.engine import resolve

    cfg = load_config(dict(config))
    algo, task = resolve(cfg)
    return cfg, algo, task


def task_of(config: Mapping[str, Any]) -> Any:
    """The task of a run config (its data, partition and model), without the algorithm."""
    import fedfm.tasks  # noqa: F401  (every task registered)
    from fedfm.tasks.base import TASKS

    cfg, _, task_cfg = resolved(config)
    return TASKS.get(task_cfg.kind)(task_cfg, cfg)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s fields, recursing where both hold a mapping (a new mapping)."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        old = out.get(key)
        out[key] = (
            merge(old, value)
            if isinstance(value, Mapping) and isinstance(old, Mapping)
            else copy.deepcopy(value)
        )
    return out


def run_status(cfg: Mapping[str, Any]) -> str:
    """The state of a run job.

    ``new`` (no run), ``changed`` (a run of another config), ``partial`` (an unfinished run
    of this config) or ``done``; the output folder is not compared (a moved study keeps its
    runs). The run's saved config is read by today's schema, so a field added since, which
    the saved config lacks, compares at its default rather than as a change.
    """
    from fedfm.config import load_config
    from fedfm.errors import ConfigError

    root = Path(cfg["out_dir"]) / cfg["name"]
    if not (root / "config.yaml").exists():
        return "new"
    try:
        saved = yaml.safe_load((root / "config.yaml").read_text())
        old = load_config(dict(saved)).model_dump(mode="json")
    except (yaml.YAMLError, ConfigError, TypeError, ValueError):
        return "changed"
    new = load_config(dict(cfg)).model_dump(mode="json")
    if {**old, "out_dir": 0} != {**new, "out_dir": 0}:
        return "changed"
    try:
        summary = json.loads((root / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "partial"
    return "done" if summary.get("rounds") == new["rounds"] else "partial"


def _file(name: str, empty: Any = None) -> cached_property[Any]:
    """A view's cached property: one of its files (``empty`` when it is not there)."""

    def read(view: RunView) -> Any:
        path = view.folder / name
        if name.endswith(".jsonl"):
            return read_jsonl(path, need_round=False)
        if not path.exists():
            return empty
        if name.endswith(".yaml"):
            data = yaml.safe_load(path.read_text())
            return data if isinstance(data, dict) else empty
        return read_json(path) if empty is None else read_json(path) or empty

    return cached_property(read)


class RunView:
    """What a study reads of one job's folder; each file is read once, when first asked for."""

    summary = _file("summary.json")  # None before the run has finished
    config = _file("config.yaml", {})  # as the run saved it, every default filled in
    metrics = _file("metrics.jsonl")  # one row per logged round
    client_metrics = _file("client_metrics.jsonl")  # per evaluated round, every client's
    audit = _file("audit.jsonl")  # every field that crossed the wire
    privacy = _file("privacy.json", {})  # the privacy ledger (empty without DP)
    partition = _file("partition.json", {})  # the partition's statistics
    _saved = _file(RESULT)  # a computation's params, its inputs' fingerprint, its result

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.name = folder.name
        self._items: dict[int | None, list[dict[str, Any]]] = {}

    @property
    def finished(self) -> bool:
        """Whether the run has finished (it wrote its summary)."""
        return self.summary is not None

    @property
    def computed(self) -> str | None:
        """The dtype the run computed in (``float32`` without autocast), from its summary.

        None before it finished or where the summary predates that record.
        """
        compute = (self.summary or {}).get("compute")
        return None if compute is None else str(compute["autocast"] or "float32")

    @property
    def final(self) -> dict[str, Any]:
        """The summary's metrics of the last evaluation."""
        return dict((self.summary or {}).get("final", {}))

    @property
    def finish(self) -> dict[str, Any]:
        """The summary's values of the phase after the rounds (``finish``)."""
        return dict((self.summary or {}).get("finish", {}))

    @cached_property
    def rounds(self) -> dict[int, dict[str, Any]]:
        """The metrics rows by round."""
        return {int(r["round"]): r for r in self.metrics}

    @cached_property
    def result(self) -> dict[str, Any] | None:
        """A computation's result (None before it has run)."""
        return None if self._saved is None else dict(self._saved["result"])

    def items(self, rnd: int | None = None) -> list[dict[str, Any]]:
        """The items evaluated in round ``rnd`` (None: the last); none if the run kept none."""
        from fedfm.eval.compare import read_items

        if rnd not in self._items:
            try:
                self._items[rnd] = read_items(self.folder, rnd)
            except ConfigError:
                self._items[rnd] = []
        return self._items[rnd]

    @property
    def wall_s(self) -> float:
        """Wall seconds summed over the run's logged rounds."""
        return sum(float(r.get("time_s", 0.0)) for r in self.metrics)

    def audit_bytes(self, kind: str, direction: str = "up") -> int:
        """Bytes of the audited fields of one message kind in one direction, all rounds."""
        return sum(
            int(r["bytes"]) for r in self.audit if r["kind"] == kind and r["direction"] == direction
        )


@dataclass(frozen=True)
class Readout(Generic[R]):
    """A comparison a study exists for, fixed before its runs.

    What is compared (``name``), how the estimate is paired (``statistic``), the ``paper``'s claim,
    its ``direction`` (+1: above ``null``, −1: below), the estimate (``value`` of what the study
    read, shown with ``digits``), the grid's ``scope`` and whether it can test the claim
    (``testable``: a bool, or a function of what was read for a premise the runs must show);
    ``margin`` is the paper's own effect on the readout's scale, where it reports one (the report
    says when the grid's minimum detectable effect is larger).
    """

    name: str
    statistic: str
    paper: str
    direction: int
    value: Callable[[R], Estimate]
    null: float = 0.0
    digits: int = 3
    scope: str = ""
    testable: bool | Callable[[R], bool] = True
    margin: float | None = None

    def judge(self, data: R) -> tuple[Estimate, str]:
        """The estimate and its verdict."""
        est = self.value(data)
        if not (self.testable(data) if callable(self.testable) else self.testable):
            return est, "cannot be tested by this grid"
        return est, verdict(est, self.direction, self.null)


def untestable(name: str, paper: str, scope: str) -> Readout[Any]:
    """A claim of the paper that the study's setup cannot test: listed with the reason."""
    return Readout(name, DASH, paper, +1, lambda _: NONE, scope=scope, testable=False)


@dataclass(frozen=True)
class Study(Generic[G, R]):
    """A reproduction study (``docs/studies.md``, "Adding a study").

    ``fedfm reproduce name`` runs the ``jobs`` of its ``full`` or ``quick`` grid (asked again after
    each job), ``read`` s their folders, judges its ``readouts`` and writes its ``body``;
    ``reports`` are its report files, full and quick (None: ``<name>-quick.md`` in the study
    folder); ``title`` None is the section ``title`` of ``reports/<name>.md`` filled from the grid;
    ``workers`` the default (full, quick); ``later`` what ``--dry-run`` cannot list yet.
    """

    name: str
    summary: str
    full: Any
    quick: Any
    jobs: Callable[[Context[Any]], Sequence[Job]]
    read: Callable[[Context[Any]], R]
    readouts: Callable[[Any], Sequence[Readout[R]]]
    body: Callable[[Context[Any], R], str | list[str]]
    reports: tuple[str | None, str | None]
    title: Callable[[Context[Any]], str] | None = None
    workers: tuple[int, int] = (1, 1)
    later: str = ""


STUDIES: Registry[Study[Any, Any]] = Registry("reproduction", "study")


def register(
    module: str, summary: str, reports: tuple[str | None, str | None] | None = None, **kw: Any
) -> Study[Any, Any]:
    """Registers the study a module declares, named as the module.

    Its grids ``FULL`` and ``QUICK``, its functions ``jobs``, ``read``, ``readouts`` and ``body``,
    its ``reports`` (None: ``<name>.md``, the quick one in the study folder) and the fields ``kw``.
    """
    mod = sys.modules[module]
    parts = {k: getattr(mod, k) for k in ("jobs", "read", "readouts", "body")}
    name = module.rsplit(".", 1)[-1]
    files = reports or (f"{name}.md", None)
    study: Study[Any, Any] = Study(name, summary, mod.FULL, mod.QUICK, reports=files, **parts, **kw)
    return STUDIES.register(name, summary)(study)


def load_studies() -> None:
    """Imports every module of the package, so that each study registers itself."""
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"fedfm.reproduce.{mod.name}")


@dataclass
class Context(Generic[G]):
    """One invocation of a study: its folder, the report written, the jobs done and failed."""

    study: str
    grid: G
    quick: bool
    out: Path
    command: str
    workers: int = 1
    pilot: bool = False  # only the study's premise pilot (its jobs list nothing else)
    part: str | None = None  # only this part's jobs start (None: every job)
    report: Path | None = None
    done: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    _views: dict[str, RunView] = field(default_factory=dict)

    @cached_property
    def record(self) -> Record:
        """The study folder's ``study.json``."""
        return Record(self.out / RECORD)

    def run(self, name: str) -> RunView:
        """The view of a job's folder (cached until the job runs again)."""
        return self._views.setdefault(name, RunView(self.out / name))

    @property
    def figures(self) -> Path:
        """The folder of the report's figures: beside the report, named as it."""
        report = self.report or self.out / f"{self.study}.md"
        return report.parent / report.stem

    def settled(self, names: Iterable[str]) -> bool:
        """Whether none of these jobs is left to run in this invocation."""
        return all(n in self.done or n in self.failed for n in names)


class Record:
    """``study.json`` at ``path`` (another shape starts a new record).

    Each job's status, time and load, and each invocation; written atomically after every change, so
    a killed invocation leaves it whole, with the time it had used by its last write.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        data: Any = None
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError):
            data = json.loads(path.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("jobs"), dict)):
            data = {"jobs": {}}
        self.jobs: dict[str, dict[str, Any]] = data["jobs"]
        self.invocations: list[dict[str, Any]] = data.get("invocations", [])
        self.study: dict[str, Any] = data.get("study", {})
        # The running invocation's entry, and its start's wall clock and CPU time.
        self.clock: tuple[dict[str, Any], float, float] | None = None

    def save(self) -> None:
        """Writes the file (replacing it in one step)."""
        if self.clock is not None:
            inv, t0, cpu0 = self.clock
            inv.update(wall_s=time.perf_counter() - t0, cpu_s=_cpu(children=True) - cpu0)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        data = {"study": self.study, "jobs": self.jobs, "invocations": self.invocations}
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def job(self, job: Job) -> dict[str, Any]:
        """A job's entry, created on first use."""
        entry = self.jobs.setdefault(job.name, {"wall_s": 0.0, "cpu_s": 0.0, "attempts": 0})
        entry.update(kind=job.kind, needs=list(job.needs), group=job.group or job.kind)
        return entry

    def mark(self, job: Job, status: str, save: bool = True, **values: Any) -> None:
        """Sets a job's status (and any values) and saves."""
        self.job(job).update(status=status, updated=time.strftime(STAMP), **values)
        if save:
            self.save()

    def measured(self, job: Job, m: Mapping[str, Any]) -> None:
        """Adds one execution's measurements to a job's entry and saves."""
        e = self.job(job)
        for key in ("wall_s", "cpu_s"):
            e[key] = float(e.get(key, 0.0)) + m[key]
        e["attempts"] = int(e.get("attempts", 0)) + 1
        e.update(load_start=m["load_start"], load_end=m["load_end"], pid=m["pid"])
        self.mark(job, "failed" if m["error"] else "done", error=m["error"])


def _cpu(children: bool = False) -> float:
    """User + system CPU seconds of this process (and of its reaped children: the workers)."""
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if children else (resource.RUSAGE_SELF,)
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, who))


_STARTED: Any = None  # a worker's queue of (job, pid) start notices to the parent


def _offline() -> None:
    # Offline assets ship inside packages; a worker never reaches for a hub either.
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _init_worker(queue: Any) -> None:
    global _STARTED
    _STARTED = queue
    # Before torch is imported in this fresh interpreter: one thread for every math library.
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[key] = "1"
    _offline()


def _execute(spec: Mapping[str, Any]) -> None:
    if spec["kind"] == "run":
        import fedfm.algorithms
        import fedfm.tasks  # noqa: F401  (every algorithm and task registered)
        from fedfm.config import load_config
        from fedfm.runtime import run

        resume = spec["resume"]
        run(load_config(spec["config"]), resume=resume, overwrite=not resume, progress=False)
        return
    folder = Path(spec["folder"])
    inputs = {k: Path(v) for k, v in spec["inputs"].items()}
    result = spec["fn"](inputs, folder, **spec["params"])
    folder.mkdir(parents=True, exist_ok=True)
    saved = {"params": spec["params"], "inputs": spec["fingerprint"], "result": dict(result)}
    tmp = folder / "result.tmp"
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.replace(folder / RESULT)


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Executes one job; returns its measurements and its error, if any (not fatal)."""
    if _STARTED is not None:
        _STARTED.put((spec["name"], os.getpid()))
    t0, cpu0, load0 = time.perf_counter(), _cpu(), os.getloadavg()[0]
    error = None
    try:
        _execute(spec)
    except Exception as e:  # reported in study.json and the report
        error = f"{type(e).__name__}: {e}"
    out = {"name": spec["name"], "error": error, "wall_s": time.perf_counter() - t0}
    out.update(cpu_s=_cpu() - cpu0, load_start=load0, load_end=os.getloadavg()[0])
    return {**out, "pid": os.getpid()}


def _fingerprint(inputs: Mapping[str, Path]) -> str:
    """A hash of the needed jobs' outcomes (their summary or result files)."""
    h = hashlib.sha256()
    for name, folder in sorted(inputs.items()):
        h.update(name.encode())
        for fname in ("summary.json", RESULT):
            if (folder / fname).exists():
                h.update((folder / fname).read_bytes())
    return h.hexdigest()[:16]


@dataclass
class _Step:
    """What a job needs next: ``wait`` (for a need), ``skip``, ``done`` or ``todo``."""

    what: str
    reason: str = ""
    spec: dict[str, Any] = field(default_factory=dict)


def _prepare(job: Job, ctx: Context[Any]) -> _Step:
    """Whether a job can run now, and how (its resolved config or computation)."""
    for n in job.needs:
        if n in ctx.failed:
            return _Step("skip", f"needs {n}, which did not finish ({ctx.failed[n]})")
        if n not in ctx.done:
            return _Step("wait", n)
    if isinstance(job, Run):
        try:
            views = {n: ctx.run(n) for n in job.needs}
            cfg = dict(job.config(views) if callable(job.config) else job.config)
        except Unmet as e:
            return _Step("skip", str(e))
        cfg.update(name=job.name, out_dir=str(ctx.out), threads=1)
        status = run_status(cfg)
        if status == "done":
            return _Step("done")
        spec = {"kind": "run", "name": job.name, "config": cfg, "resume": status == "partial"}
        return _Step("todo", status, spec)
    folder = ctx.out / job.name
    inputs = {n: ctx.out / n for n in job.needs}
    fp = _fingerprint(inputs)
    saved = None
    with contextlib.suppress(OSError, json.JSONDecodeError):
        saved = json.loads((folder / RESULT).read_text())
    params = json.loads(json.dumps(dict(job.params)))  # as saved: JSON types
    if isinstance(saved, dict) and saved.get("params") == params and saved.get("inputs") == fp:
        return _Step("done")
    spec = {"kind": "compute", "name": job.name, "fn": job.fn, "params": params}
    spec.update(inputs={k: str(v) for k, v in inputs.items()}, folder=str(folder), fingerprint=fp)
    return _Step("todo", "new", spec)


def _plan(study: Study[Any, Any], ctx: Context[Any]) -> list[Job]:
    jobs = list(study.jobs(ctx))
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"study {study.name}: job names repeat: {', '.join(dup)}")
    for j in jobs:
        for n in j.needs:
            if n not in names:
                raise ValueError(f"study {study.name}: job {j.name} needs unknown job {n}")
    return jobs


def _ready(
    study: Study[Any, Any], ctx: Context[Any], running: Iterable[str]
) -> tuple[list[tuple[Job, dict[str, Any]]], bool]:
    """The jobs that can start now, and whether another job settled while listing them."""
    rec, busy = ctx.record, set(running)
    ready: list[tuple[Job, dict[str, Any]]] = []
    moved = False
    for job in _plan(study, ctx):
        if job.name in ctx.done or job.name in ctx.failed or job.name in busy:
            continue
        step = _prepare(job, ctx)
        if ctx.part is not None and part_of(job) != ctx.part and step.what != "done":
            continue  # another part's job: its own command runs it
        if step.what == "done":
            ctx.done.add(job.name)
            if rec.jobs.get(job.name, {}).get("status") != "done":
                rec.mark(job, "done", save=False)
            moved = True
        elif step.what == "skip":
            ctx.failed[job.name] = f"skipped: {step.reason}"
            rec.mark(job, "skipped", error=step.reason)
            moved = True
        elif step.what == "todo":
            ready.append((job, step.spec))
    return ready, moved


Submit = Callable[[Job, dict[str, Any]], "Future[dict[str, Any]]"]


@contextlib.contextmanager
def _executor(ctx: Context[Any]) -> Iterator[tuple[Submit, Any]]:
    """How jobs start, and the queue of the workers' start notices.

    With one worker, at once in this process; with more, each in a fresh spawned process (no forked
    torch thread pools) used once, so that no job inherits another's caches (loaded models,
    features).
    """
    if ctx.workers <= 1:

        def here(job: Job, spec: dict[str, Any]) -> Future[dict[str, Any]]:
            ctx.record.mark(job, "running", pid=os.getpid())
            fut: Future[dict[str, Any]] = Future()
            fut.set_result(execute(spec))
            return fut

        yield here, None
        return
    mpc = mp.get_context("spawn")
    queue = mpc.Queue()
    pool = ProcessPoolExecutor(ctx.workers, mpc, _init_worker, (queue,), max_tasks_per_child=1)
    try:
        yield (lambda _, spec: pool.submit(execute, spec)), queue
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _started(queue: Any, jobs: Mapping[str, Job], ctx: Context[Any]) -> None:
    """Records the jobs that workers have started (with their process ids)."""
    while queue is not None:
        try:
            name, pid = queue.get_nowait()
        except Empty:
            return
        if name not in ctx.done and name not in ctx.failed:  # a late notice of a finished job
            ctx.record.mark(jobs[name], "running", pid=pid)


def _run(study: Study[Any, Any], ctx: Context[Any], inv: dict[str, Any]) -> None:
    """Keeps ``ctx.workers`` jobs running; a dead worker's jobs are marked interrupted."""
    futures: dict[Future[dict[str, Any]], Job] = {}
    broken = False
    with _executor(ctx) as (submit, queue):
        while True:
            running = [job.name for job in futures.values()]
            ready, moved = ([], False) if broken else _ready(study, ctx, running)
            for job, spec in ready[: ctx.workers - len(futures)]:
                inv["ran"] += 1
                futures[submit(job, spec)] = job
            if not futures:
                if moved and not broken:
                    continue
                return
            finished, _ = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
            _started(queue, {job.name: job for job in futures.values()}, ctx)
            for fut in finished:
                job = futures.pop(fut)
                try:
                    m = fut.result()
                except BrokenProcessPool:
                    broken = True
                    ctx.failed[job.name] = "interrupted: a worker process died"
                    n = int(ctx.record.job(job).get("interrupted", 0)) + 1
                    ctx.record.mark(job, "interrupted", error=ctx.failed[job.name], interrupted=n)
                    continue
                ctx.record.measured(job, m)
                ctx._views.pop(job.name, None)  # the folder changed: read it again
                if m["error"]:
                    ctx.failed[job.name] = m["error"]
                else:
                    ctx.done.add(job.name)


def run_jobs(study: Study[Any, Any], ctx: Context[Any]) -> None:
    """Runs every job not done into ``ctx.out``, recording status and cost in ``study.json``."""
    rec = ctx.record
    rec.study = {"name": study.name, "grid": "quick" if ctx.quick else "full"}
    for entry in rec.jobs.values():  # a killed invocation left these behind
        if entry.get("status") == "running":
            entry["status"] = "interrupted"
    inv: dict[str, Any] = {"started": time.strftime(STAMP), "command": ctx.command}
    inv.update(workers=ctx.workers, cpus=os.cpu_count(), load_start=list(os.getloadavg()), ran=0)
    rec.invocations.append(inv)
    rec.clock = (inv, time.perf_counter(), _cpu(children=True))
    try:
        _run(study, ctx, inv)
    except BaseException:
        for name, entry in rec.jobs.items():
            if entry.get("status") == "running":
                entry["status"] = "interrupted"
                ctx.failed.setdefault(name, "interrupted")
        raise
    finally:
        inv.update(load_end=list(os.getloadavg()), failed=len(ctx.failed))
        rec.save()
        rec.clock = None


def _wall_of(name: str, ctx: Context[Any]) -> float | None:
    """A finished job's measured wall seconds: recorded, or logged by the run itself."""
    entry = ctx.record.jobs.get(name, {})
    if entry.get("status") == "done" and entry.get("attempts"):
        return float(entry["wall_s"])
    view = ctx.run(name)
    return view.wall_s if view.finished and view.metrics else None


MEASURED = " (configured from its measured values)"


def dry_run(study: Study[Any, Any], ctx: Context[Any]) -> list[str]:
    """The jobs with status and estimated seconds, and the total estimate.

    The jobs with status and estimated seconds (own, group's or all finished jobs' mean),
    and the total estimate.
    """
    steps: dict[str, _Step] = {}
    jobs: list[Job] = []
    while len(jobs) != len(jobs := _plan(study, ctx)):  # a study may list more once some are done
        for job in (j for j in jobs if j.name not in steps):
            steps[job.name] = _prepare(job, ctx)
            if steps[job.name].what == "done":
                ctx.done.add(job.name)
    groups: dict[str, list[float]] = {}  # the finished jobs' wall times by group
    for j in jobs:
        if j.name in ctx.done and (wall := _wall_of(j.name, ctx)):
            groups.setdefault(j.group or j.kind, []).append(wall)
    every = [w for ws in groups.values() for w in ws]
    parted = len({part_of(j) for j in jobs}) > 1
    lines = head(["job", "kind", "needs", *(["part"] if parted else []), "status", "estimate s"])
    left: list[float | None] = []
    for job in jobs:
        step = steps[job.name]
        status = {
            "done": "done (skipped)",
            "skip": f"skipped: {step.reason}",
            "todo": f"{step.reason}: {'resumes' if step.reason == 'partial' else 'runs'}",
            "wait": f"after {step.reason}"
            + (MEASURED if isinstance(job, Run) and callable(job.config) else ""),
        }[step.what]
        est: float | None = None
        if step.what in ("todo", "wait"):
            mine = ctx.record.jobs.get(job.name, {})
            same = groups.get(job.group or job.kind) or every
            if mine.get("attempts"):  # its own time, when an earlier invocation ran it
                est = float(mine["wall_s"]) / int(mine["attempts"])
            elif same:
                est = sum(same) / len(same)
            if ctx.part is None or part_of(job) == ctx.part:  # what this command runs
                left.append(est)
        needs = ", ".join(job.needs) or DASH
        part = [part_of(job)] if parted else []
        lines.append(row([job.name, job.kind, needs, *part, status, num(est, 0)]))
    known = [x for x in left if x is not None]
    total = sum(known) / max(1, min(ctx.workers, len(left)))
    unknown = len(left) - len(known)
    summary = f"{len(jobs)} jobs, {len(jobs) - len(left)} done or skipped, {len(left)} to run"
    if ctx.part is not None:
        summary = f"{len(jobs)} jobs, {len(left)} to run in part {ctx.part}"
    if known:
        summary += (
            f" with {ctx.workers} worker(s): about {total / 60:.1f} min from the times of the"
            f" {len(every)} finished jobs in {ctx.out} (a lower bound where jobs wait for others"
            + (f"; {unknown} job(s) without a measurement to go by" if unknown else "")
            + ")."
        )
    elif left:
        summary += f": no estimate, no job in {ctx.out} has finished and measured its time."
    return [*lines, "", summary, *([f"Later: {study.later}"] if study.later else [])]


def time_lines(ctx: Context[Any], jobs: Sequence[Job]) -> list[str]:
    """The section on the jobs' status, wall and CPU time and the machine's load."""
    rec = ctx.record
    ran = [i for i in rec.invocations if i.get("ran")]
    machine = f"{os.cpu_count()} CPU cores ({platform.machine()}, Python"
    values = {"record": RECORD, "machine": f"{machine} {platform.python_version()})", "n": len(ran)}
    each = []
    for i in ran:
        v = {k: f"{float(i.get(f'{k}_s', 0.0)) / 60:.1f}" for k in ("wall", "cpu")}
        v.update({k: num((i.get(k) or [math.nan])[0], 1) for k in ("load_start", "load_end")})
        v.update(started=i.get("started", "?"), ran=i["ran"], workers=i.get("workers", 1))
        v.update(command=i.get("command", "?"))
        each.append(TEXT("invocation", v))
    wall, cpu = (f"{sum(float(i.get(k, 0.0)) for i in ran) / 60:.1f}" for k in ("wall_s", "cpu_s"))
    invocations = TEXT("invocations", values, wall=wall, cpu=cpu, each=each)
    # A large grid is summed by group (the study's cost classes), a small one job by job.
    entries = [(j, rec.jobs.get(j.name, {})) for j in jobs]
    by: dict[str, list[dict[str, Any]]] = {}
    for j, e in entries:
        by.setdefault(j.name if len(jobs) <= 40 else (j.group or "jobs"), []).append(e)
    rows = []
    for key, es in by.items():
        status = ", ".join(sorted({str(e.get("status", "not run")) for e in es}))
        timed = [e for e in es if e.get("attempts")]
        secs = [sum(float(e[k]) for e in timed) if timed else None for k in ("wall_s", "cpu_s")]
        ends = [timed[0].get("load_start"), timed[-1].get("load_end")] if timed else []
        load = " → ".join(num(x, 1) for x in ends) or DASH
        rows.append(row([key, len(es), status, *(num(x, 0) for x in secs), load]))
    errors = [f"- `{j.name}`: {e['error']}" for j, e in entries if e.get("error")]
    times = TEXT(
        "times",
        invocations=invocations if ran else TEXT("no-invocation", values),
        jobs=rows,
        unfinished=TEXT("unfinished", jobs=errors) if errors else None,
    )
    return [times, ""]


def report_path(study: Study[Any, Any], ctx: Context[Any], folder: Path | None = None) -> Path:
    """Where the report of this grid goes: ``folder`` (``docs/`` by default) / its file."""
    file = study.reports[1 if ctx.quick else 0]
    if file is None:
        return (folder or ctx.out) / f"{study.name}-quick.md"
    return (folder or Path("docs")) / file


def write_report(study: Study[Any, R], ctx: Context[Any], path: Path) -> Path:
    """Writes the report: title, readouts with their verdicts, the study's body, the times."""
    ctx.report = path
    data = study.read(ctx)
    title = study.title(ctx) if study.title else Text(study.name)("title", vars(ctx.grid))
    values = {"title": title, "command": ctx.command, "out": ctx.out}
    rows: list[str] = []
    notes: dict[str, list[str]] = {}  # one note for the readouts that share it
    for i, r in enumerate(study.readouts(ctx.grid), start=1):
        est, word = r.judge(data)
        shown = est.fmt(r.digits, signed=r.null == 0.0) if est.n else DASH
        mde = mde_of(est)
        if r.margin is not None and math.isfinite(mde) and mde > abs(r.margin):
            word += f"; the paper's margin {abs(r.margin):.{r.digits}f} is below this MDE"
        cells = [f"R{i}", r.name, shown, r.statistic, r.paper, num(mde, r.digits)]
        rows.append(row([*cells, f"**{word}**"]))
        if r.scope:
            notes.setdefault(r.scope, []).append(f"R{i}")
    notes_ = [f"- {', '.join(ids)}: {text}" for text, ids in notes.items()]
    lines = [TEXT("head", values, study=study.name), "", TEXT("readouts", rows=rows, notes=notes_)]
    body = study.body(ctx, data)
    lines += ["", *([body, ""] if isinstance(body, str) else body)]
    lines += time_lines(ctx, _plan(study, ctx))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def open_study(
    study: Study[Any, Any],
    out: Path,
    quick: bool = False,
    grid: Any = None,
    workers: int | None = None,
    command: str | None = None,
    pilot: bool = False,
    part: str | None = None,
) -> Context[Any]:
    """The context of one invocation: ``out`` is the study folder itself.

    ``pilot``: only the study's premise pilot runs (its main jobs are listed but not started);
    ``part``: only the jobs of this part start.
    """
    flags = (" --quick" if quick else "") + (" --pilot" if pilot else "")
    flags += f" --part {part}" if part is not None else ""
    return Context(
        study=study.name,
        grid=grid if grid is not None else (study.quick if quick else study.full),
        quick=quick,
        out=Path(out),
        command=command or f"fedfm reproduce {study.name}{flags}",
        workers=workers or min(study.workers[1 if quick else 0], os.cpu_count() or 1),
        pilot=pilot,
        part=part,
    )


def _done_in(jobs: Sequence[Job], ctx: Context[Any]) -> set[str]:
    """The jobs whose folders hold their finished work (a job is judged once its needs are)."""
    before, done = set(ctx.done), set(ctx.done)
    try:
        while True:
            ctx.done = set(done)
            new = {j.name for j in jobs if j.name not in done and _prepare(j, ctx).what == "done"}
            if not new:
                return done
            done |= new
    finally:
        ctx.done = before


def check_part(study: Study[Any, Any], ctx: Context[Any]) -> None:
    """Refuses a part the study does not have, or whose jobs need another part not yet run.

    Raises:
        ConfigError: naming the study's parts, or the command to run first.
    """
    if ctx.part is None:
        return
    jobs = _plan(study, ctx)
    parts = list(dict.fromkeys(part_of(j) for j in jobs))
    if ctx.pilot:
        raise ConfigError("part", "--pilot and --part together: name one of them")
    if ctx.part not in parts:
        raise ConfigError(
            "part", f"study {study.name} has no part {ctx.part!r} (its parts: {', '.join(parts)})"
        )
    done = _done_in(jobs, ctx)
    by_name = {j.name: j for j in jobs}
    for job in (j for j in jobs if part_of(j) == ctx.part):
        for n in job.needs:
            other = by_name[n]
            if part_of(other) != ctx.part and n not in done:
                raise ConfigError(
                    "part",
                    f"{job.name} needs {n}, not finished: run `fedfm reproduce {study.name}"
                    f" --part {part_of(other)}` first",
                )


def run_study(study: Study[Any, Any], ctx: Context[Any], report: Path | None = None) -> Path:
    """Runs what is missing of the study and writes its report; returns the report's path."""
    run_jobs(study, ctx)
    return write_report(study, ctx, report or report_path(study, ctx))


def reproduce(
    name: str,
    out: Path,
    quick: bool = False,
    workers: int | None = None,
    dry_run_only: bool = False,
    report_dir: Path | None = None,
    pilot: bool = False,
    part: str | None = None,
) -> Path | list[str]:
    """``fedfm reproduce``: the study ``name`` in ``out/<name>[-quick]``.

    The report written or, with ``dry_run_only``, the job list; ``pilot``: only the study's premise
    pilot; ``part``: only the jobs of this part. ConfigError: an unknown study or part, a part
    whose needs have not run, no worker.
    """
    load_studies()
    study = STUDIES.get(name)
    if workers is not None and workers < 1:
        raise ConfigError("jobs", f"must be at least 1, got {workers}")
    _offline()
    folder = Path(out) / (f"{name}-quick" if quick else name)
    ctx = open_study(study, folder, quick, None, workers, pilot=pilot, part=part)
    if dry_run_only:
        return dry_run(study, ctx)
    check_part(study, ctx)
    return run_study(study, ctx, report_path(study, ctx, report_dir))
