"""The one owner of the round loop (DESIGN.md principle 4).

The engine builds the task and the algorithm from a validated config, runs the one-off phase
before the rounds, every round with its evaluation, logging and checkpoint, the phase after
the rounds, and writes the run folder. It imports no runtime: a runtime
(:mod:`fedfm.runtime`) gives it a federation factory, and :func:`fedfm.runtime.run` picks
the runtime a config names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import fedfm.algorithms
import fedfm.tasks  # noqa: F401  (registers the tasks)
from fedfm.algorithms.base import ALGORITHMS, Algorithm, ClientHalf, client_half, client_handlers
from fedfm.algorithms.presets import algo_section
from fedfm.config import RunConfig, validate_section
from fedfm.core.artefacts import split_state
from fedfm.core.audit import AuditLedger, communication_bill
from fedfm.core.checkpoint import (
    Checkpoint,
    checkpoints_newest_first,
    load_checkpoint,
    mark_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from fedfm.core.codec import Wire
from fedfm.core.federation import ClientInfo, ClientRunner, Federation, Handler, assign_roles
from fedfm.core.messages import MessageKind
from fedfm.core.runfolder import RunFolder, RunFolderError, RunFolderLease, read_jsonl
from fedfm.core.stages import staged_rounds
from fedfm.core.state import ClientStateStore
from fedfm.data.partition import PartitionConfig
from fedfm.errors import ConfigError, config_fields
from fedfm.eval.compare import paired_change
from fedfm.models.lora import named_adapter_keys
from fedfm.tasks.base import TASKS, Task
from fedfm.tblog import TensorBoardLog

log = logging.getLogger("fedfm")

BYTE_KEYS = tuple(f"bytes_{d}{part}" for d in ("up", "down") for part in ("", "_arrays", "_meta"))


@dataclass
class ClientSide:
    """What a process needs to serve clients: config, task, client half, message kinds.

    Attributes:
        cfg: The run config.
        task: The task.
        client: The algorithm's client half, built from the config alone (:func:`client_half`).
        message_kinds: This run's message kinds by name (DP ones in the form this config
            sends them).
    """

    cfg: RunConfig
    task: Task
    client: ClientHalf
    message_kinds: dict[str, MessageKind]

    def clients(self) -> list[ClientInfo]:
        """Every client with its role (every process of the run computes the same)."""
        return assign_roles(self.task.client_ids(), self.cfg.clients.roles, self.cfg.seed)

    def kinds(self) -> dict[str, MessageKind]:
        """This run's message kinds by name (DP ones in the form this config sends them)."""
        return dict(self.message_kinds)

    def client_runner(self) -> ClientRunner:
        """The algorithm's client half, ready to serve any client of the run."""
        roles = {c.cid: c.role for c in self.clients()}
        return ClientRunner(self.handlers(), self.kinds(), roles, self.task, self.cfg.seed)

    def handlers(self) -> dict[str, Handler]:
        """The client half's handlers (inside SecAgg+'s when the run uses it)."""
        return client_handlers(self.client, self.message_kinds)


@dataclass
class Setup(ClientSide):
    """A resolved experiment: :class:`ClientSide` and the algorithm's server half.

    Attributes:
        algo: The algorithm's server half.
    """

    algo: Algorithm


def resolve(cfg: RunConfig) -> tuple[Any, Any]:
    """Validates the algorithm's and the task's own config sections.

    Returns:
        ``(algo_config, task_config)``.

    Raises:
        ConfigError: Unknown algorithm or task kind, a bad value in their sections, a task
            without a capability the algorithm needs, or a ``comm`` wire the algorithm's
            messages cannot travel in.
    """
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    task_kind = cfg.task.get("kind", "tabular")
    task_cls = TASKS.get(str(task_kind))
    algo_cfg = validate_section(algo_cls.Config, algo_section(cfg.algorithm, cfg.algo), "algo")
    task_cfg = validate_section(task_cls.Config, {"kind": task_kind, **cfg.task}, "task")
    task_cls.check_run(task_cfg, cfg)  # what the task needs of the run (the device)
    validate_section(PartitionConfig, {"seed": cfg.seed, **cfg.partition}, "partition")
    algo_cls.check_task(algo_cfg, task_cls, task_cfg)  # optional task capabilities
    # The fields a codec would code, from the kinds' declarations, before any message.
    Wire.of(cfg.comm.uplink, cfg.comm.downlink, cfg.comm.fields).check(
        algo_cls.kinds_for(algo_cfg, cfg)
    )
    return algo_cfg, task_cfg


def with_stages(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the run's rounds under its algorithm's stages (:mod:`fedfm.core.stages`).

    A config that gives ``rounds`` keeps it (more than the stages hold is refused); one that
    does not runs every stage. An algorithm without stages leaves ``cfg`` as it is.

    Raises:
        ConfigError: ``rounds`` beyond the stages' total, or a bad ``algo`` section.
    """
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    algo_cfg = validate_section(algo_cls.Config, algo_section(cfg.algorithm, cfg.algo), "algo")
    stages = algo_cls.stages(algo_cfg)
    if not stages:
        return cfg
    given = "rounds" in cfg.model_fields_set
    origin = algo_cls.stages_origin()
    rounds = staged_rounds(stages, cfg.rounds, given, cfg.algorithm, origin)
    return cfg if rounds == cfg.rounds else cfg.model_copy(update={"rounds": rounds})


# Model builders name their own arguments; in a run, those come from the task's section.
BUILD_FIELDS = {"model": "task.model_args", "model.name": "task.model"}


def build(cfg: RunConfig) -> Setup:
    """Builds the task and both halves of the algorithm of a config (deterministic in the seed).

    The client half is built right after the server half, before any checkpoint is restored
    (the embedded runtime and the Flower ServerApp); a process that only serves clients
    builds it alone (:func:`build_clients`).

    Raises:
        ConfigError: Anything the task or the algorithm refuses while being built, named by
            its config path (``task.model_args.hidden``), or more ``clients.min_clients``
            than there are clients.
    """
    cfg = with_stages(cfg)
    algo_cfg, task_cfg = resolve(cfg)
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    with config_fields(BUILD_FIELDS):
        task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
        algo = algo_cls(algo_cfg, task, cfg)
        client = client_half(algo_cls, algo_cfg, task, cfg)
    kinds = algo.message_kinds()
    for kind in kinds.values():
        kind.check_declaration()  # nothing unnoised may leave a DP client
    algo.bind_secure()  # the distributed discrete Gaussian needs the update's size
    n = len(task.client_ids())
    if cfg.clients.min_clients > n:
        raise ConfigError(
            "clients.min_clients", f"{cfg.clients.min_clients} is more than the {n} clients"
        )
    return Setup(cfg, task, client, kinds, algo)


def build_clients(cfg: RunConfig) -> ClientSide:
    """Builds the task and the client half only: what a Flower ClientApp's process needs.

    No server half is built (none of its state, models or copies of the global parameters):
    the process holds the task, its shared models and the client half.

    Raises:
        ConfigError: What the task or the client half refuses while being built.
    """
    cfg = with_stages(cfg)
    algo_cfg, task_cfg = resolve(cfg)
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    with config_fields(BUILD_FIELDS):
        task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
        client = client_half(algo_cls, algo_cfg, task, cfg)
    return ClientSide(cfg, task, client, algo_cls.kinds_for(algo_cfg, cfg))


FederationFactory = Callable[[Setup, ClientStateStore, AuditLedger], Federation]
"""Builds a runtime's federation for a resolved experiment, its client-state store and ledger."""


def _write_static(folder: RunFolder, setup: Setup) -> None:
    cfg_path = folder.root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(setup.cfg.model_dump(mode="json"), sort_keys=False))
    (folder.root / "partition.json").write_text(json.dumps(setup.task.stats(), indent=1))


def _checkpoint(folder: RunFolder, rnd: int, algo: Algorithm, store: ClientStateStore) -> None:
    arrays, meta = algo.state_dict()
    arrays = {**arrays, **algo.artefacts.state()}
    snap = store.snapshot()
    server = {"algo": meta, "rng": rng_state(), "privacy": algo.privacy.state()}
    if algo.user_dp is not None:
        server["user_dp"] = algo.user_dp.state_dict()
    save_checkpoint(
        folder.checkpoints, Checkpoint(rnd, arrays, server, snap["arrays"], snap["meta"])
    )


def _publish(folder: RunFolder, algo: Algorithm) -> None:
    """Writes what the algorithm leaves in the run folder.

    Its artefacts, and ``privacy.json`` when it used DP (see :mod:`fedfm.core.artefacts`).
    """
    algo.artefacts.publish(folder.root)
    if len(algo.privacy):
        algo.privacy.write(folder.privacy)


ADAPTER = "adapter"
"""The run folder's copy of the global LoRA adapter, in peft's format (``fedfm eval`` reads it)."""


def _export_adapter(folder: RunFolder, algo: Algorithm) -> None:
    """Writes the finished run's global adapter into ``adapter/``, atomically.

    The folder is replaced whole (written beside it, then renamed), when the algorithm has an
    adapter.
    """
    tmp, final = folder.root / f".{ADAPTER}.tmp", folder.root / ADAPTER
    shutil.rmtree(tmp, ignore_errors=True)
    if not algo.export_adapter(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if final.exists():
        old = folder.root / f".{ADAPTER}.old"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def _refuse_named_adapter_keys(path: Path, ck: Checkpoint) -> None:
    """Stops a resume from a checkpoint whose LoRA tensors still name their adapter.

    fedfm wrote FedIT's adapters (and the text task's MiniLM LoRA) under the model's parameter
    names before every adapter travelled under peft's saved keys
    (:mod:`fedfm.models.lora`); such a run cannot continue with this version.

    Raises:
        RunFolderError: Naming the file and one of its keys.
    """
    for name, arrays in (("server", ck.server_arrays), ("clients", ck.client_arrays)):
        named = named_adapter_keys(arrays)
        if named:
            raise RunFolderError(
                path / f"{name}.safetensors",
                f"LoRA tensors keyed with their adapter name ('{named[0]}'), as fedfm wrote them"
                " before adapters travelled under peft's saved keys: this version cannot resume"
                " the run; start it again with --overwrite, or resume it with the fedfm version"
                " that wrote it",
            )


def _restore(
    folder: RunFolder, algo: Algorithm, store: ClientStateStore, ledger: AuditLedger
) -> int:
    """Loads the newest checkpoint that loads, then cuts the logs back to its round.

    Nothing on disk changes until a checkpoint has loaded: damaged logs or no loadable
    checkpoint stop the resume with one line.

    Returns:
        The round of the checkpoint.

    Raises:
        RunFolderError: A log is damaged, or no checkpoint loads.
    """
    for path in folder.logs:
        read_jsonl(path)
    damaged: list[str] = []
    for path in checkpoints_newest_first(folder.checkpoints):
        try:
            ck = load_checkpoint(path)
            _refuse_named_adapter_keys(path, ck)
            own, artefacts = split_state(ck.server_arrays)
            algo.load_state_dict(own, ck.server_meta["algo"])
            algo.privacy.load_state(ck.server_meta.get("privacy", []))
            if algo.user_dp is not None:
                algo.user_dp.load_state_dict(ck.server_meta["user_dp"])
            store.restore(ck.client_arrays, ck.client_meta)
            set_rng_state(ck.server_meta["rng"])
        except RunFolderError:  # not damage: every earlier checkpoint is of the same kind
            raise
        except Exception as e:  # a damaged checkpoint: try the one before
            first = (str(e).splitlines() or [""])[0][:80]
            damaged.append(f"{path.name}: {type(e).__name__}: {first}")
            continue
        if damaged:
            log.warning("%s does not load; resuming from %s", "; ".join(damaged), path.name)
        algo.artefacts.restore(folder.root, artefacts)
        mark_latest(folder.checkpoints, path)  # what a runtime reads as the resume point
        for p in (folder.metrics, folder.failures, folder.client_metrics, folder.items):
            folder.truncate(p, ck.rnd)
        ledger.load(ck.rnd)
        return ck.rnd
    why = f" ({'; '.join(damaged)})" if damaged else ""
    raise RunFolderError(
        folder.checkpoints,
        f"no checkpoint loads{why}: nothing was changed; pass --overwrite to start again",
    )


class Engine:
    """Runs one experiment end to end.

    Args:
        cfg: Validated run config.
        federation: The runtime's federation factory (e.g.
            :func:`fedfm.runtime.embedded.embedded_federation`).
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show a progress bar and a per-round table on the terminal.
        started_at: When the session began (``time.time()``) if that was before the engine,
            e.g. ``fedfm serve`` starting the SuperLink and waiting for SuperNodes in another
            process. Default: when :meth:`run` is called. The summary's
            ``start_s_this_session`` counts from it to the session's first round, and
            ``wall_s_this_session`` from that round to the end, on every runtime.
    """

    def __init__(
        self,
        cfg: RunConfig,
        federation: FederationFactory,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        started_at: float | None = None,
    ) -> None:
        resolve(cfg)  # config errors surface at once; build() finds the rest
        self.cfg = with_stages(cfg)  # rounds derived from the algorithm's stages
        self.resume = resume
        self.overwrite = overwrite
        self.make_federation = federation
        self.progress = progress
        self.started_at = started_at
        self.tb = TensorBoardLog(Path(), enabled=False)

    def run(self) -> dict[str, Any]:
        """Runs all rounds and returns the summary (also written to ``summary.json``)."""
        import torch

        session = self.started_at if self.started_at is not None else time.time()
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        lease = RunFolderLease(Path(cfg.out_dir) / cfg.name, self.resume, self.overwrite)
        setup = build(cfg)  # everything is validated before the disk is touched
        from fedfm.progress import RoundDisplay

        with lease as folder:
            store = ClientStateStore(folder.root / "client_states")
            ledger = AuditLedger(folder.audit)
            last = _restore(folder, setup.algo, store, ledger) if lease.resume else -1
            _write_static(folder, setup)
            # Every run folder has failures.jsonl, empty when no client failed (README).
            folder.failures.touch()
            fed = self.make_federation(setup, store, ledger)
            fed.wire = Wire.of(
                cfg.comm.uplink, cfg.comm.downlink, cfg.comm.fields
            )  # the codecs of array fields (fedfm.core.codec)
            self.tb = TensorBoardLog(folder.root, cfg.log.tensorboard)
            display = RoundDisplay(
                cfg, enabled=self.progress, start=max(last, 0), primary=setup.task.primary
            )
            t0 = time.perf_counter()
            start = time.time() - session
            with display:
                if last < 0:
                    self._step(0, fed, setup, folder, store, ledger, display)
                lease.started()  # --overwrite: the old run goes only now
                for rnd in range(max(last, 0) + 1, cfg.rounds + 1):
                    self._step(rnd, fed, setup, folder, store, ledger, display)
                fed.rnd = cfg.rounds + 1
                final = setup.algo.finish(fed)
            _publish(folder, setup.algo)
            _export_adapter(folder, setup.algo)
            self.tb.close()
        wall = time.perf_counter() - t0
        summary = self._summary(folder, setup, final, wall, start)
        display.final_table(folder.read_metrics(), summary.get("privacy"))
        if cfg.plots:  # figures at the end of the run: the PNGs and report.html
            from fedfm.html_report import write_run_report
            from fedfm.report import plot_run

            plot_run(folder.root)
            if cfg.log.html:
                write_run_report(folder.root, summary)
        return summary

    def _step(
        self,
        rnd: int,
        fed: Federation,
        setup: Setup,
        folder: RunFolder,
        store: ClientStateStore,
        ledger: AuditLedger,
        display: Any,
    ) -> None:
        t = time.perf_counter()
        fed.rnd = rnd
        nfail = len(fed.failures)
        row: dict[str, Any] = {"round": rnd}
        per_client = items = None
        try:
            row.update(setup.algo.setup(fed) if rnd == 0 else setup.algo.round(fed))
        except BaseException:
            # The failures that stopped the run (e.g. too few survivors) are kept.
            folder.append(folder.failures, fed.failures[nfail:])
            raise
        if rnd > 0 and setup.algo.user_dp is not None:
            row.update(setup.algo.user_dp.metrics())
        due = rnd % self.cfg.eval_every == 0 or rnd == self.cfg.rounds
        if (rnd == 0 and self.cfg.eval_before) or (rnd > 0 and due):
            evals = setup.algo.evaluate(fed)
            per_client = evals.pop("per_client", None)
            items = evals.pop("items", None)
            row.update(evals)
        row.update(ledger.round_bytes(rnd))
        # A client that missed several messages of the round is one failed client.
        row["failed"] = len({f["client"] for f in fed.failures[nfail:]})
        row["failed_messages"] = len(fed.failures) - nfail
        row["time_s"] = round(time.perf_counter() - t, 4)
        # Logs first, checkpoint last: on resume, rows after the checkpoint are dropped.
        folder.append(folder.metrics, [row])
        folder.append(folder.failures, fed.failures[nfail:])
        if per_client:
            folder.append(folder.client_metrics, [{"round": rnd, "clients": per_client}])
        if items:
            # JSON round trip: item fields may be numpy scalars or other non-JSON types.
            row_items = json.loads(json.dumps(list(items), default=str))
            folder.append(folder.items, [{"round": rnd, "items": row_items}])
        ledger.flush()
        self.tb.log(row)
        _publish(folder, setup.algo)
        _checkpoint(folder, rnd, setup.algo, store)
        display.update(row)

    def _summary(
        self,
        folder: RunFolder,
        setup: Setup,
        final: dict[str, float],
        wall: float,
        start: float = 0.0,
    ) -> dict[str, Any]:
        rows = folder.read_metrics()
        task = setup.task
        evals = [r for r in rows if task.primary in r]
        last = evals[-1] if evals else {}
        pick = max if task.higher_is_better else min
        best = pick(evals, key=lambda r: r[task.primary]) if evals else {}
        summary = {
            "name": self.cfg.name,
            "algorithm": self.cfg.algorithm,
            "task": self.cfg.task,
            "rounds": self.cfg.rounds,
            "primary": task.primary,
            "final": {k: v for k, v in last.items() if k not in ("time_s",)},
            "best": {"round": best.get("round"), task.primary: best.get(task.primary)},
            **_change(folder, task.primary),
            **{key: sum(r.get(key, 0) for r in rows) for key in BYTE_KEYS},
            "comm": communication_bill(read_jsonl(folder.audit)),  # GB, from the ledger
            # Distinct clients that failed in any round, and the messages they missed.
            "failed_clients": len({f["client"] for f in read_jsonl(folder.failures)}),
            "failed_messages": sum(r.get("failed_messages", r.get("failed", 0)) for r in rows),
            **({"privacy": setup.algo.privacy.summary()} if len(setup.algo.privacy) else {}),
            "artefacts": _artefact_list(folder, setup.algo),
            # This session: from its start to its first round, and from there to the end.
            "start_s_this_session": round(start, 2),
            "wall_s_this_session": round(wall, 2),
            "compute": _compute(self.cfg, task),
            **({"finish": final} if final else {}),
        }
        tmp = folder.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(folder.summary)
        return summary


def _compute(cfg: RunConfig, task: Task) -> dict[str, Any]:
    """The device and the autocast dtype the run computed in (None: the model's own dtype).

    A config's ``autocast_bf16: true`` is in effect only where the device has bfloat16 (or,
    on an older GPU, float16) instructions, so a run folder read elsewhere needs this line to
    tell what its numbers were computed in. (DP-SGD keeps no float16 autocast: see
    :func:`fedfm.devices.autocast`.)
    """
    from fedfm.allocator import preloaded
    from fedfm.devices import autocast_in_effect

    device = cfg.torch_device()
    wanted = bool(getattr(getattr(task, "cfg", None), "autocast_bf16", False))
    dtype = autocast_in_effect(device, wanted)
    autocast = str(dtype).removeprefix("torch.") if dtype else None
    allocator = "jemalloc" if preloaded(os.environ) else "system"  # memory, not numbers
    return {"device": str(device), "autocast": autocast, "allocator": allocator}


def _change(folder: RunFolder, primary: str) -> dict[str, Any]:
    """``{"change": ...}``: the headline's change from the first evaluation to the last.

    Paired by item (:func:`fedfm.eval.compare.paired_change`), where the run kept its items
    and the headline is a mean over them; else nothing.
    """
    if not folder.items.exists():
        return {}
    change = paired_change(read_jsonl(folder.items), primary)
    return {"change": change} if change else {}


def _artefact_list(folder: RunFolder, algo: Algorithm) -> dict[str, dict[str, Any]]:
    """Files the algorithm left in the run folder, with sizes and SHA-256."""
    files = algo.artefacts.manifest()
    if folder.privacy.exists() and len(algo.privacy):
        data = folder.privacy.read_bytes()
        files[folder.privacy.name] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return files
