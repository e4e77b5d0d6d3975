"""The Flower runtime: every fedfm algorithm as a Flower ServerApp + ClientApp.

The server half of an algorithm runs inside Flower's ``ServerApp`` through the fedfm
:class:`~fedfm.engine.Engine` (so rounds, logs, checkpoints, resume and the audit ledger are
the engine's own); :class:`FlowerFederation` carries its messages over Flower's ``Grid``.
The client half runs inside Flower's ``ClientApp`` (:mod:`fedfm.runtime.flower_app`) through
the same :func:`fedfm.runtime.embedded.dispatch` as the embedded runtime, so a run gives the
same metrics on both runtimes with the same seed.

Wire format (one fedfm :class:`~fedfm.core.messages.Message` = one Flower ``Message``):

- Flower message type: always ``query.fedfm`` (``query.fedfm_hello`` for the handshake). The
  fedfm kind travels in the header: fedfm kinds are free strings (``"select.features"``),
  Flower actions must be identifiers, and one generic action lets a client refuse an
  unknown kind with fedfm's own named :class:`~fedfm.errors.MessageError`.
- ``"fedfm"``: a ``ConfigRecord`` holding one JSON header (kind, round, client id, field
  order, run identity for client-state restore, expected reply shapes).
- ``"arrays.<field>"``: one ``ArrayRecord`` per array field; tensors keep dtype, shape and
  values bit for bit (numpy-representable dtypes as Flower's numpy arrays, others such as
  bfloat16 as raw bytes).
- ``"meta"``: a ``ConfigRecord`` of the scalar meta fields (bool, int, float, str);
  ``"meta.json"``: the other meta values (lists, dicts, None) JSON-encoded, since Flower's
  records hold neither dicts nor None.

The header and the handshake are the runtime's own control data, not algorithm fields: the
audit ledger records the fedfm messages exactly as the embedded runtime does, so byte
counts are identical on both runtimes.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from fedfm.core.audit import AuditLedger
from fedfm.core.federation import ClientInfo, Federation
from fedfm.core.messages import Message, MessageKind, MetaValue, validate_reply
from fedfm.errors import ConfigError, FedfmError, MessageError

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, RecordDict
    from flwr.serverapp import Grid

    from fedfm.config import RunConfig
    from fedfm.core.state import ClientStateStore
    from fedfm.engine import Setup

log = logging.getLogger("fedfm")

MESSAGE_TYPE = "query.fedfm"
HELLO_TYPE = "query.fedfm_hello"
PAYLOAD_KEY = "fedfm-payload"
# Flower's own error codes are small integers (0-8 in flwr 1.42); fedfm's sit far above.
CLIENT_ERROR_CODE = 4100
HEADER = "fedfm"
ARRAYS_PREFIX = "arrays."
META = "meta"
META_JSON = "meta.json"
RAW_STYPE = "fedfm.torch_raw"
SESSIONS_FILE = "flower_sessions.json"


# --------------------------------------------------------------------------- options


class FlowerOptions(BaseModel):
    """Settings of the Flower runtime that are not part of the experiment.

    Attributes:
        timeout_s: How long the server waits for the replies of one exchange; a client that
            has not answered by then (e.g. its SuperNode died) is a failed client.
        node_wait_s: How long the server waits at the start for a SuperNode per client.
        poll_s: Longest sleep between two polls for replies (the wait starts at 10 ms and
            doubles up to this).
        imports: Modules every process imports before building the task and the algorithm
            (plugins that register tasks, algorithms or models).
        client_cpus: CPUs per simulated client (Ray actor); the machine's CPUs divided by
            this is the number of clients that run at once.
        sim_cpus: CPUs Ray may use in simulation (default: all).
        state_dir: Where ClientApps keep their clients' state snapshots for resume, when the
            SuperNode's node config does not say (``state-dir``). Simulation defaults to
            ``<run folder>/flower_client_states``; deployment to
            ``~/.cache/fedfm/client-states``.
        verbose: Keep Flower's and Ray's INFO logs.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(600.0, gt=0)
    node_wait_s: float = Field(120.0, ge=0)
    poll_s: float = Field(0.2, gt=0)
    imports: list[str] = Field(default_factory=list)
    client_cpus: float = Field(1.0, gt=0)
    sim_cpus: int | None = Field(None, ge=1)
    state_dir: str | None = None
    verbose: bool = False


def load_options(options: FlowerOptions | Mapping[str, Any] | None) -> FlowerOptions:
    """Validates Flower options given as a model, a mapping or None (defaults).

    Raises:
        ConfigError: A bad value, naming the ``flower.<field>``.
    """
    if isinstance(options, FlowerOptions):
        return options
    from fedfm.config import validate_section

    return validate_section(FlowerOptions, dict(options or {}), "flower")  # type: ignore[return-value]


def run_options(cfg: RunConfig, options: FlowerOptions | Mapping[str, Any] | None) -> FlowerOptions:
    """Flower options of a run: a ``flower`` section of the run config (if the config has
    one) overridden by ``options``."""
    if isinstance(options, FlowerOptions):
        return options
    section = getattr(cfg, "flower", None) or {}
    return load_options({**dict(section), **dict(options or {})})


def import_plugins(names: list[str]) -> None:
    """Imports plugin modules (they register tasks, algorithms or models on import).

    Raises:
        ConfigError: A module cannot be imported.
    """
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError("flower.imports", f"cannot import '{name}' ({e})") from None


# --------------------------------------------------------------------------- payload


@dataclass
class Payload:
    """What the server tells every process of a run: config, options and start mode.

    It travels in Flower's run config as one base64 string (JSON inside), because Flower's
    run config holds flat scalars and its command-line parser mangles nested quotes.
    """

    config: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    overwrite: bool = False
    progress: bool = False

    def encode(self) -> str:
        """The payload as a base64 string."""
        raw = json.dumps(self.__dict__, sort_keys=True, separators=(",", ":"))
        return base64.b64encode(raw.encode()).decode()

    @classmethod
    def decode(cls, text: str) -> Payload:
        """Reads a payload written by :meth:`encode`.

        Raises:
            ConfigError: The text is not a fedfm payload.
        """
        try:
            return cls(**json.loads(base64.b64decode(text.encode())))
        except (ValueError, TypeError) as e:
            raise ConfigError(PAYLOAD_KEY, f"not a fedfm payload ({e})") from None

    @classmethod
    def from_context(cls, run_config: Mapping[str, Any]) -> Payload:
        """Reads the payload from a Flower run config.

        Raises:
            ConfigError: The run config carries no payload.
        """
        text = run_config.get(PAYLOAD_KEY, "")
        if not text:
            raise ConfigError(
                PAYLOAD_KEY, "missing from the Flower run config (submit runs with `fedfm serve`)"
            )
        return cls.decode(str(text))

    def run_config(self) -> RunConfig:
        """The validated fedfm run config (plugins imported first)."""
        from fedfm.config import load_config

        import_plugins(self.flower().imports)
        return load_config(self.config)

    def flower(self) -> FlowerOptions:
        """The validated Flower options."""
        return load_options(self.options)

    def key(self) -> str:
        """A stable id of the config and options (client-side caches are keyed by it)."""
        import hashlib

        raw = json.dumps([self.config, self.options], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- records


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_array(t: Tensor) -> Any:
    """A torch tensor as a Flower ``Array``, exact in dtype, shape and values."""
    from flwr.app import Array

    t = t.detach().cpu()
    try:
        return Array.from_numpy_ndarray(t.contiguous().numpy())
    except TypeError:
        # bfloat16, float8 and friends have no numpy dtype: send the raw bytes instead.
        # Flower's Array takes any (dtype, shape, stype, data) quadruple, so this stays a
        # plain Array that any Flower component can carry.
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return Array(dtype=_dtype_name(t.dtype), shape=tuple(t.shape), stype=RAW_STYPE, data=data)


def array_to_tensor(a: Any) -> Tensor:
    """Inverse of :func:`tensor_to_array`."""
    if a.stype == RAW_STYPE:
        dtype = getattr(torch, a.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise MessageError(f"unknown tensor dtype '{a.dtype}' in a reply")
        if not a.data:
            return torch.empty(tuple(a.shape), dtype=dtype)
        flat = torch.frombuffer(bytearray(a.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(tuple(a.shape)).clone()
    arr = a.numpy()
    if arr.dtype.hasobject:
        raise MessageError("object arrays are not tensors")
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    return torch.from_numpy(np.require(arr, requirements=["C", "W"]))


def arrays_to_record(arrays: Mapping[str, Tensor]) -> ArrayRecord:
    """A flat tensor dict as an ``ArrayRecord`` (key order kept)."""
    from flwr.app import ArrayRecord

    return ArrayRecord({k: tensor_to_array(v) for k, v in arrays.items()})


def record_to_arrays(record: ArrayRecord) -> dict[str, Tensor]:
    """Inverse of :func:`arrays_to_record`."""
    return {k: array_to_tensor(v) for k, v in record.items()}


def _native(value: Any) -> bool:
    # Scalars a ConfigRecord holds exactly; everything else travels as JSON.
    return isinstance(value, bool | int | float | str)


def message_to_records(msg: Message, header: Mapping[str, Any]) -> RecordDict:
    """A fedfm message (plus the runtime header) as a Flower ``RecordDict``."""
    from flwr.app import ConfigRecord, RecordDict

    head = {
        **header,
        "kind": msg.kind,
        "arrays": list(msg.arrays),
        "meta": list(msg.meta),
    }
    rd = RecordDict({HEADER: ConfigRecord({"header": json.dumps(head)})})
    for name, arrays in msg.arrays.items():
        rd[ARRAYS_PREFIX + name] = arrays_to_record(arrays)
    native = {k: v for k, v in msg.meta.items() if _native(v)}
    other = {k: json.dumps(v) for k, v in msg.meta.items() if not _native(v)}
    rd[META] = ConfigRecord(native)
    rd[META_JSON] = ConfigRecord(other)
    return rd


def records_to_message(rd: RecordDict) -> tuple[Message, dict[str, Any]]:
    """Inverse of :func:`message_to_records`: the message and its header.

    Raises:
        MessageError: The records are not a fedfm message.
    """
    try:
        head = json.loads(str(rd[HEADER]["header"]))
        native, other = rd[META], rd[META_JSON]
        meta: dict[str, MetaValue] = {}
        for name in head["meta"]:
            meta[name] = native[name] if name in native else json.loads(str(other[name]))
        arrays = {name: record_to_arrays(rd[ARRAYS_PREFIX + name]) for name in head["arrays"]}
        return Message(str(head["kind"]), arrays, meta), head
    except (KeyError, TypeError, ValueError) as e:
        raise MessageError(f"malformed fedfm message ({type(e).__name__}: {e})") from None


def like_spec(like: Mapping[str, Mapping[str, Tensor]] | None) -> dict[str, Any]:
    """Names, dtypes and shapes of reply templates (sent so clients can check themselves)."""
    return {
        f: {k: [_dtype_name(t.dtype), list(t.shape)] for k, t in tmpl.items()}
        for f, tmpl in (like or {}).items()
    }


def like_templates(spec: Mapping[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Shape-only templates (meta tensors, no memory) from :func:`like_spec`."""
    return {
        f: {
            k: torch.empty(shape, dtype=getattr(torch, dt), device="meta")
            for k, (dt, shape) in d.items()
        }
        for f, d in spec.items()
    }


def error_reason(err: BaseException) -> str:
    """A client failure as one line, worded exactly as the embedded runtime words it."""
    return str(err) if isinstance(err, FedfmError) else f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- sessions


def run_sessions(run_dir: Path, resumed_from: int) -> dict[str, Any]:
    """Records a new server session of a run and returns the run's session history.

    Client states live on the clients, one snapshot per (session, round). When a run
    resumes from the checkpoint of round ``k``, snapshots written after round ``k`` by the
    interrupted session are stale; the history tells clients which snapshots are valid: a
    snapshot of session ``s`` and round ``r`` is valid when ``r`` is at most the round from
    which the next session resumed.

    Args:
        run_dir: The run folder.
        resumed_from: Round of the checkpoint this session resumed from, or -1 for a fresh
            start (a new run identity).

    Returns:
        ``{"run_uid", "session", "lineage": [[session, last valid round], ...]}``.
    """
    path = run_dir / SESSIONS_FILE
    data = json.loads(path.read_text()) if resumed_from >= 0 and path.exists() else None
    if data is None:
        if resumed_from >= 0:
            log.warning(
                "%s has no Flower session history: clients start from empty states", run_dir
            )
        data = {"run_uid": uuid.uuid4().hex, "sessions": []}
    data["sessions"].append({"session": len(data["sessions"]), "resumed_from": resumed_from})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    sessions = data["sessions"]
    lineage = [[s["session"], nxt["resumed_from"]] for s, nxt in itertools.pairwise(sessions)]
    return {"run_uid": data["run_uid"], "session": sessions[-1]["session"], "lineage": lineage}


# --------------------------------------------------------------------------- federation


class FlowerFederation(Federation):
    """The federation interface over a Flower ``Grid`` (server side).

    Each exchange pushes one Flower message per client and polls for the replies until all
    have arrived or ``timeout_s`` has passed. Replies are checked as on the embedded runtime
    (declared fields, ``like`` templates); an error reply, a missing reply or an invalid one
    is logged in :attr:`failures` and left out. Messages are recorded in the audit ledger in
    the embedded runtime's order (per client: down, then up).

    Args:
        clients: Client ids and roles.
        seed: Run seed.
        grid: The ServerApp's grid.
        kinds: Message kind -> declaration.
        ledger: Audit ledger.
        session: Run identity and session history (:func:`run_sessions`).
        options: Flower options.
    """

    def __init__(
        self,
        clients: list[ClientInfo],
        seed: int,
        grid: Grid,
        kinds: Mapping[str, MessageKind],
        ledger: AuditLedger,
        session: Mapping[str, Any],
        options: FlowerOptions,
    ) -> None:
        super().__init__(clients, seed)
        self.grid = grid
        self.kinds = kinds
        self.ledger = ledger
        self.session = dict(session)
        self.options = options
        self._roles = {c.cid: c.role for c in clients}
        self.node_of: dict[str, int] = {}
        self._said_hello: set[int] = set()
        self._hello_pending: dict[str, int] = {}  # handshake message id -> node
        self.wait_for_nodes()

    # ----- nodes -----
    def wait_for_nodes(self) -> None:
        """Maps SuperNodes to client ids, waiting up to ``node_wait_s`` for all of them."""
        deadline = time.monotonic() + self.options.node_wait_s
        sleep = 0.01
        while True:
            self.discover()
            if len(self.node_of) == len(self._roles) or time.monotonic() >= deadline:
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.5)
        missing = [c for c in self._roles if c not in self.node_of]
        if missing:
            log.warning(
                "no SuperNode serves client(s) %s after %.0f s: they count as failed",
                ", ".join(missing),
                self.options.node_wait_s,
            )

    def discover(self) -> None:
        """Keeps the SuperNode -> client map current, without blocking.

        Nodes the SuperLink no longer lists as online are forgotten (their clients fail
        at once instead of waiting for a timeout); a node seen for the first time, or back
        online, gets a handshake asking which client it serves; replies to earlier
        handshakes are collected. Called before every exchange, so a SuperNode that
        restarts mid-run serves its client again from the next exchange on.
        """
        from flwr.app import ConfigRecord, RecordDict
        from flwr.app import Message as FlowerMessage

        alive = {int(n) for n in self.grid.get_node_ids()}
        self.node_of = {c: n for c, n in self.node_of.items() if n in alive}
        self._said_hello &= alive
        self._hello_pending = {m: n for m, n in self._hello_pending.items() if n in alive}
        asking = set(self._hello_pending.values())
        new = sorted(n for n in alive if n not in self._said_hello and n not in asking)
        if new:
            head = json.dumps(self.session)
            msgs = [
                FlowerMessage(
                    RecordDict({HEADER: ConfigRecord({"header": head})}),
                    n,
                    HELLO_TYPE,
                    group_id="hello",
                )
                for n in new
            ]
            pushed = {str(i) for i in self.grid.push_messages(msgs) if i}
            for m, n in zip(msgs, new, strict=True):
                if str(m.metadata.message_id) in pushed:
                    self._hello_pending[str(m.metadata.message_id)] = n
        if not self._hello_pending:
            return
        for reply in self.grid.pull_messages(list(self._hello_pending)):
            n = self._hello_pending.pop(reply.metadata.reply_to_message_id, None)
            if n is not None:
                self._said_hello.add(n)
                self._map(n, reply)

    def _map(self, node: int, reply: Any) -> None:
        if reply.has_error():
            log.warning("SuperNode %d refused the handshake: %s", node, reply.error.reason)
            return
        cid = str(json.loads(str(reply.content[HEADER]["header"]))["cid"])
        if cid not in self._roles:
            log.warning("SuperNode %d serves unknown client '%s': ignored", node, cid)
        elif cid in self.node_of and self.node_of[cid] != node:
            log.warning(
                "SuperNodes %d and %d both serve client %s: keeping %d",
                self.node_of[cid],
                node,
                cid,
                self.node_of[cid],
            )
        else:
            self.node_of[cid] = node

    # ----- exchanges -----
    def _exchange(self, msgs: list[Any], timeout: float) -> tuple[list[Any], float]:
        """Pushes messages and polls for their replies; None where none came in time.

        Flower's own ``send_and_receive`` polls every 3 s; polling from 10 ms up to
        ``poll_s`` keeps short exchanges short.
        """
        pushed = {str(i) for i in self.grid.push_messages(msgs) if i}
        ids = [str(m.metadata.message_id) for m in msgs]
        pending = {i for i in ids if i in pushed}
        got: dict[str, Any] = {}
        start = time.monotonic()
        sleep = 0.01
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                rid = reply.metadata.reply_to_message_id
                if rid in pending:
                    got[rid] = reply
                    pending.discard(rid)
            if not pending or time.monotonic() - start >= timeout:
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, self.options.poll_s)
        return [got.get(i) for i in ids], time.monotonic() - start

    def _header(self, cid: str, like: Mapping[str, Mapping[str, Tensor]] | None) -> dict:
        return {
            **self.session,
            "cid": cid,
            "round": self.rnd,
            # The engine checkpoints after every round: rounds before this one are final.
            "committed": self.rnd - 1,
            "like": like_spec(like),
        }

    def send(
        self,
        messages: Mapping[str, Message],
        like: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> dict[str, Message]:
        for cid, msg in messages.items():
            if cid not in self._roles:
                raise MessageError(f"no client with id '{cid}'")
            kind = self.kinds.get(msg.kind)
            if kind is None:
                raise MessageError(f"message kind '{msg.kind}' is not declared by the algorithm")
            kind.check(msg, "down")
        self.discover()
        from flwr.app import Message as FlowerMessage

        targets = [c for c in messages if c in self.node_of]
        flower_msgs = [
            FlowerMessage(
                message_to_records(messages[c], self._header(c, like)),
                self.node_of[c],
                MESSAGE_TYPE,
                group_id=str(self.rnd),
            )
            for c in targets
        ]
        got, waited = self._exchange(flower_msgs, self.options.timeout_s) if targets else ([], 0.0)
        raw = dict(zip(targets, got, strict=True))
        replies: dict[str, Message] = {}
        for cid, msg in messages.items():
            self.ledger.record(self.rnd, cid, "down", msg)
            try:
                reply = self._check(cid, msg, raw, like, waited)
            except Exception as e:  # a failed client is logged and left out of the round
                self._fail(cid, msg.kind, e)
                continue
            self.ledger.record(self.rnd, cid, "up", reply)
            replies[cid] = reply
        return replies

    def _check(
        self,
        cid: str,
        sent: Message,
        raw: Mapping[str, Any],
        like: Mapping[str, Mapping[str, Tensor]] | None,
        waited: float,
    ) -> Message:
        if cid not in self.node_of:
            raise ClientLost(f"client {cid}: no SuperNode serves this client")
        reply = raw.get(cid)
        if reply is None:
            raise ClientLost(f"client {cid}: no reply within {waited:.0f} s (SuperNode lost?)")
        if reply.has_error():
            err = reply.error
            if err.code == CLIENT_ERROR_CODE:
                raise ClientFailed(err.reason or "")
            raise ClientFailed(f"client {cid}: Flower error {err.code}: {err.reason}")
        msg, _ = records_to_message(reply.content)
        if msg.kind != sent.kind:
            raise MessageError(f"client {cid}: reply of kind '{msg.kind}' to '{sent.kind}'")
        # Never trust the client: the declared fields are checked again on this side.
        self.kinds[msg.kind].check(msg, "up")
        validate_reply(cid, msg, like)
        return msg

    def _fail(self, cid: str, kind: str, err: Exception) -> None:
        reason = error_reason(err)
        self.failures.append({"round": self.rnd, "client": cid, "kind": kind, "error": reason})
        log.warning("round %d: client %s failed on '%s': %s", self.rnd, cid, kind, reason)


class ClientFailed(FedfmError):
    """A client's handler failed (the reason is the client's own one-line error)."""


class ClientLost(FedfmError):
    """A client did not answer: no SuperNode serves it, or it died mid-exchange."""


# --------------------------------------------------------------------------- server app


def flower_federation_factory(
    grid: Grid, payload: Payload
) -> Callable[[Setup, ClientStateStore, AuditLedger], Federation]:
    """An engine federation factory that talks to the clients over ``grid``."""
    from fedfm.algorithms.base import kinds_of
    from fedfm.core.checkpoint import latest_checkpoint
    from fedfm.engine import assign_roles

    def make(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
        cfg = setup.cfg
        run_dir = Path(cfg.out_dir) / cfg.name
        resumed_from = -1
        ck = latest_checkpoint(run_dir / "checkpoints") if payload.resume else None
        if ck is not None:
            resumed_from = int(json.loads((ck / "meta.json").read_text())["round"])
        session = run_sessions(run_dir, resumed_from)
        clients = assign_roles(setup.task.client_ids(), cfg.clients.roles, cfg.seed)
        return FlowerFederation(
            clients, cfg.seed, grid, kinds_of(type(setup.algo)), ledger, session, payload.flower()
        )

    return make


def server_main(grid: Grid, payload: Payload) -> dict[str, Any]:
    """The ServerApp's body: runs the fedfm engine with clients behind ``grid``.

    Returns:
        The run summary.
    """
    from fedfm.engine import Engine

    cfg = payload.run_config()
    engine = Engine(
        cfg,
        resume=payload.resume,
        overwrite=payload.overwrite,
        federation=flower_federation_factory(grid, payload),
        progress=payload.progress,
    )
    return engine.run()


# --------------------------------------------------------------------------- simulation


@contextmanager
def flower_env(home: Path | None = None) -> Iterator[Path]:
    """Environment for Flower commands: no telemetry, no update check, a private home.

    Args:
        home: ``FLWR_HOME`` to use; a fresh temporary folder when None.
    """
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    with tempfile.TemporaryDirectory(prefix="fedfm-flwr-") as tmp:
        root = home or Path(tmp)
        os.environ.update(flower_env_vars(root))
        try:
            yield root
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_ENV_KEYS = (
    "FLWR_TELEMETRY_ENABLED",
    "FLWR_DISABLE_UPDATE_CHECK",
    "FLWR_HOME",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION",
    "PYTHONPATH",
    "RAY_DEDUP_LOGS",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL",
)


def flower_env_vars(home: Path) -> dict[str, str]:
    """Environment variables every Flower process of fedfm gets."""
    return {
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_HOME": str(home),
        # Flower would otherwise install the app's dependencies into a fresh environment.
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        # Flower's executors poll for new ServerApp/ClientApp tasks every second by default.
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
    }


def _quiet_flower(verbose: bool) -> None:
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)


def run_flower_sim(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: FlowerOptions | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs an experiment on Flower's simulation engine (one virtual SuperNode per client).

    The ServerApp runs in a thread of this process and the ClientApps in Ray actors; the
    run folder is the same as on the embedded runtime.

    Args:
        cfg: Validated run config.
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show the progress display.
        options: Flower options (:class:`FlowerOptions`).

    Returns:
        The run summary.
    """
    import warnings

    from fedfm.engine import resolve
    from fedfm.runtime.flower_app import make_client_app, make_server_app
    from fedfm.tasks.base import TASKS

    opts = run_options(cfg, options)
    import_plugins(opts.imports)
    _, task_cfg = resolve(cfg)
    num_clients = len(TASKS.get(task_cfg.kind)(task_cfg, cfg).client_ids())
    # Absolute: Ray actors need not share this process's working directory.
    run_dir = (Path(cfg.out_dir) / cfg.name).resolve()
    state_dir = opts.state_dir or str(run_dir / "flower_client_states")
    payload = Payload(
        config=cfg.model_dump(mode="json"),
        options={**opts.model_dump(), "state_dir": state_dir},
        resume=resume,
        overwrite=overwrite,
        progress=progress,
    )
    sink: dict[str, Any] = {}
    cpus = opts.sim_cpus or os.cpu_count() or 1
    backend = {
        "client_resources": {"num_cpus": opts.client_cpus, "num_gpus": 0.0},
        "init_args": {"num_cpus": cpus, "include_dashboard": False, "log_to_driver": opts.verbose},
    }
    from flwr.simulation import run_simulation

    with flower_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _quiet_flower(opts.verbose)
        run_simulation(
            server_app=make_server_app(payload, sink),
            client_app=make_client_app(payload),
            num_supernodes=num_clients,
            backend_config=backend,  # type: ignore[arg-type]
            verbose_logging=opts.verbose,
        )
    if "error" in sink:
        raise sink["error"]
    if "summary" not in sink:
        raise FedfmError("the Flower simulation ended without running the ServerApp")
    return sink["summary"]


def run(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: FlowerOptions | Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs ``cfg`` on the Flower runtime its ``runtime`` field names.

    ``flower-sim`` runs Flower's simulation engine in this process. ``flower`` (the
    deployment engine) needs machines and certificates, so it is not started implicitly:
    it runs with ``fedfm serve`` on the server and ``fedfm client`` on each client.

    Raises:
        ConfigError: ``runtime`` is ``flower`` or not a Flower runtime.
    """
    if cfg.runtime == "flower-sim":
        return run_flower_sim(cfg, resume, overwrite, progress, options)
    if cfg.runtime == "flower":
        raise ConfigError(
            "runtime",
            "'flower' runs across machines: start `fedfm serve` here and `fedfm client` on"
            " each client (docs/running-across-machines.md), or use runtime=flower-sim",
        )
    raise ConfigError("runtime", f"'{cfg.runtime}' is not a Flower runtime")


def serve_main(*args: Any, **kw: Any) -> dict[str, Any]:
    """``fedfm serve`` (see :func:`fedfm.runtime.flower_app.deploy.serve_main`)."""
    from fedfm.runtime.flower_app.deploy import serve_main as main

    return main(*args, **kw)


def client_main(*args: Any, **kw: Any) -> int:
    """``fedfm client`` (see :func:`fedfm.runtime.flower_app.deploy.client_main`)."""
    from fedfm.runtime.flower_app.deploy import client_main as main

    return main(*args, **kw)


def add_commands(app: Any) -> None:
    """Adds ``fedfm serve``, ``fedfm client`` and ``fedfm flower-certs`` to a typer app."""
    from fedfm.runtime.flower_app.deploy import add_commands as add

    add(app)
