"""The embedded runtime: every simulated client in the server's process.

Shared frozen models are loaded once (they live in the task), and the algorithm's one
client half (built from the config, apart from the server half) serves every client; only
per-client trainable state is kept per client, in a
:class:`~fedfm.core.state.ClientStateStore`. A handler runs on a copy of its client's state
(:meth:`fedfm.core.federation.ClientRunner.call`), committed only when it returns a valid
reply, so a client that crashes mid-round leaves its state as it was. Clients run one after
the other, each when the algorithm asks for its reply, so an algorithm that folds replies
into a running sum holds one reply at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
    ) -> None:
        super().__init__(clients, seed, kinds, ledger)
        self.runner = ClientRunner(handlers, kinds, self._roles, task, seed)
        self.store = store

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
        for cid, msg in messages.items():
            try:
                reply, state = self.runner.call(cid, self.rnd, self.store.get(cid), msg, like)
            except Exception as e:  # a crashed client is logged and left out of the round
                yield cid, e
                continue
            self.store.put(cid, state)
            yield cid, reply


def embedded_federation(setup: Setup, store: ClientStateStore, ledger: AuditLedger) -> Federation:
    """The engine's federation factory for the embedded runtime: every client in this process."""
    return EmbeddedFederation(
        setup.clients(),
        setup.cfg.seed,
        setup.handlers(),
        setup.kinds(),
        setup.task,
        store,
        ledger,
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
