"""``test-seed-probe``: an algorithm whose clients report the randomness they were given.

Importable by Flower ClientApps (``imports``). Each round every sampled client answers a
``draw`` message with its batch seed for the purpose ``"batches"``, two numbers from the torch
RNG that the runtime seeds before a handler runs, two from a numpy generator seeded by
``ctx.rng_seed("probe")`` and the targets of its first shuffled batch. The server keeps them
all and returns them from ``finish``, so a run's summary holds every draw of every client.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedfm.algorithms.base import ALGORITHMS, Algorithm, ClientHalf
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.messages import Message, MessageKind
from helpers import toy  # noqa: F401  (registers the toy task)


class SeedProbeClient(ClientHalf):
    """Reports the client's random draws."""

    def handlers(self) -> dict[str, Any]:
        return {"draw": self._draw}

    def _draw(self, ctx: ClientContext, msg: Message) -> Message:
        seed = ctx.rng_seed("batches")
        first = next(iter(self.task.batches(ctx.data, 4, seed)))
        meta: dict[str, Any] = {
            "seed": seed,
            "torch": torch.rand(2).tolist(),
            "numpy": np.random.default_rng(ctx.rng_seed("probe")).random(2).tolist(),
            "batch": first[1].tolist(),
        }
        return Message("draw", meta=meta)


class SeedProbe(Algorithm):
    """Clients report their random draws; the server collects them by round and client."""

    Client = SeedProbeClient
    messages = (MessageKind("draw", up_meta=("seed", "torch", "numpy", "batch")),)

    def __init__(self, cfg: Any, task: Any, run: Any) -> None:
        super().__init__(cfg, task, run)
        self.draws: dict[str, Any] = {}

    def round(self, fed: Federation) -> dict[str, float]:
        cids = self.sample(fed)
        replies = fed.broadcast(Message("draw"), cids)
        self.require(fed, replies, len(cids))
        for cid, r in replies.items():
            self.draws[f"{fed.rnd}/{cid}"] = dict(r.meta)
        return {"clients": len(replies)}

    def evaluate(self, fed: Federation) -> dict[str, float]:
        return {"rmse": 0.0}

    def finish(self, fed: Federation) -> dict[str, Any]:
        return dict(self.draws)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"draws": self.draws}

    def load_state_dict(self, arrays: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.draws = dict(meta["draws"])


if "test-seed-probe" not in ALGORITHMS:
    ALGORITHMS.register("test-seed-probe", "reports each client's random draws")(SeedProbe)
