"""The embedded runtime: every simulated client in the server's process.

Shared frozen models are loaded once (they live in the task), and the algorithm's one
client half (built from the config, apart from the server half) serves every client; only
per-client trainable state is kept per client, in a
:class:`~fedfm.core.state.ClientStateStore`. A handler runs on a copy of its client's state
(:meth:`fedfm.core.federation.ClientRunner.call`), committed only when it returns a valid
reply, so a client that crashes mid-round leaves its state as it was. Clients run one after
the other, each when the algorithm asks for its reply, so an algorithm that folds replies
into a running sum holds one reply at a time.

With ``clients.parallel`` above 1 the clients of one exchange (any message kind) run side by
side in worker processes forked from this one (:mod:`fedfm.runtime.workers`), sharing the
frozen base; their replies are handed to the algorithm in the same order, and each state is
committed here as it is handed on, so a run's metrics, audit log and checkpoints are those of
the sequential run. A worker that dies is a failed client.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

from fedfm.config import RunConfig
from fedfm.core.audit import AuditLedger
from fedfm.core.federation import (
    ClientInfo,
    ClientRunner,
    Federation,
    Handler,
    Templates,
)
from fedfm.core.messages import Message, MessageKind
from fedfm.core.state import ClientStateStore
from fedfm.engine import Engine, Setup
from fedfm.errors import ConfigError
from fedfm.runtime.workers import side_by_side, worker_threads


class EmbeddedFederation(Federation):
    """Runs client handlers in-process.

    Args:
        clients: Client ids and roles.
        seed: Run seed.
        handlers: Message kind -> client handler.
        kinds: Message kind -> declaration.
        task: The task (data and shared models).
        store: Client-state store.
        ledger: Audit ledger.
        workers: Clients trained at once, each in a worker process (1: in this process).
        threads: Torch threads the workers share.
    """

    def __init__(
        self,
        clients: list[ClientInfo],
        seed: int,
        handlers: Mapping[str, Handler],
        kinds: Mapping[str, MessageKind],
        task: Any,
        store: ClientStateStore,
        ledger: AuditLedger,
        workers: int = 1,
        threads: int = 1,
    ) -> None:
        super().__init__(clients, seed, kinds, ledger)
        self.runner = ClientRunner(handlers, kinds, self._roles, task, seed)
        self.store = store
        self.workers = workers
        self.threads = threads

    @property
    def handlers(self) -> Mapping[str, Handler]:
        """The client handlers (replaceable, e.g. to simulate an attacking client)."""
        return self.runner.handlers

    @handlers.setter
    def handlers(self, value: Mapping[str, Handler]) -> None:
        self.runner.handlers = value

    def _exchange(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message | Exception]]:
        if self.workers > 1 and len(messages) > 1:
            yield from self._side_by_side(messages, like)
            return
        for cid, msg in messages.items():
            try:
                reply, state = self.runner.call(cid, self.rnd, self.store.get(cid), msg, like)
            except Exception as e:  # a crashed client is logged and left out of the round
                yield cid, e
                continue
            self.store.put(cid, state)
            yield cid, reply

    def _side_by_side(
        self, messages: dict[str, Message], like: Templates | None
    ) -> Iterator[tuple[str, Message | Exception]]:
        """The clients in forked workers; each outcome as :meth:`ClientRunner.call`'s."""
        call, rnd = self.runner.call, self.rnd
        jobs = [
            partial(call, cid, rnd, self.store.get(cid), msg, like) for cid, msg in messages.items()
        ]
        workers = min(self.workers, len(jobs))
        outcomes = side_by_side(jobs, workers, worker_threads(self.threads, workers))
        for cid, outcome in zip(messages, outcomes, strict=True):
            if isinstance(outcome, Exception):
                yield cid, outcome
                continue
            reply, state = outcome
            self.store.put(cid, state)
            yield cid, reply


def embedded_federation(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
    """The engine's federation factory for the embedded runtime.

    Every client in this process (``clients.parallel`` of them at once in forked workers; ``auto``
    from the memory plan).
    """
    import torch

    from fedfm.plan import parallel_workers

    return EmbeddedFederation(
        setup.clients(),
        setup.cfg.seed,
        setup.handlers(),
        setup.kinds(),
        setup.task,
        store,
        ledger,
        workers=parallel_workers(setup.cfg, setup.task),
        threads=setup.cfg.threads or torch.get_num_threads(),
    )


def run_embedded(
    cfg: RunConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs an experiment on the embedded runtime; returns the run summary.

    Raises:
        ConfigError: ``options`` are given (the embedded runtime has none).
    """
    if options:
        raise ConfigError("runtime", "the embedded runtime takes no runtime options")
    return Engine(cfg, embedded_federation, resume, overwrite, progress).run()
