"""What every process of a Flower run shares, importable without torch or Flower.

The run payload (config, options, start mode) that ``fedfm serve`` hands to the ServerApp and
the ClientApps, and the names of the Flower runtime's files in a run folder. Kept apart from
:mod:`~fedfm.runtime.flower.wire` (tensors as Flower records) so that the ``fedfm`` commands
that only write or read a payload start without importing torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedfm.config import RunConfig, load_config
from fedfm.errors import ConfigError
from fedfm.runtime.flower.options import FlowerOptions, import_plugins, load_options

PAYLOAD_KEY = "fedfm-payload"
#: The Flower message types of fedfm messages and of the handshake (see :mod:`.wire`).
MESSAGE_TYPE = "query.fedfm"
HELLO_TYPE = "query.fedfm_hello"

#: The run folder's history of server sessions (written by the ServerApp, read by ``fedfm serve``).
SESSIONS_FILE = "flower_sessions.json"


@dataclass
class Payload:
    """What the server tells every process of a run: config, options and start mode.

    It travels in Flower's run config as one base64 string (JSON inside), because Flower's
    run config holds flat scalars and its command-line parser mangles nested quotes.

    Attributes:
        config: The run config (JSON).
        options: The Flower options.
        resume: Continue from the run folder's last checkpoint.
        overwrite: Replace an existing run folder.
        progress: Show the engine's progress display in the ServerApp.
        started_at: When the server session began (``time.time()`` of ``fedfm serve``, on
            the machine the ServerApp runs on), for the summary's ``wall_s_this_session``;
            None: the engine's first round.
    """

    config: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    overwrite: bool = False
    progress: bool = False
    started_at: float | None = None

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

    def run_config(self, device: str | None = None) -> RunConfig:
        """The validated fedfm run config (plugins imported first).

        Args:
            device: This machine's ``device`` in place of the run's (a deployment client's
                ``fedfm client --device``); checked against this machine.
        """
        import_plugins(self.flower().imports)
        return load_config({**self.config, "device": device} if device else self.config)

    def flower(self) -> FlowerOptions:
        """The validated Flower options."""
        return load_options(self.options)

    def key(self) -> str:
        """A stable id of the config and options (client-side caches are keyed by it)."""
        raw = json.dumps([self.config, self.options], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]
