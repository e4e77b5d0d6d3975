"""LoRA clients of different strength in the FedAvg family: mixed ranks and frozen ``A``.

Two options of ``task.lora`` (:class:`~fedfm.models.lora.LoraConfigSpec`) change what a
FedAvg-family round sends and how it aggregates; everything else (local training, every
server optimizer on the aggregated update, evaluation) is FedAvg's.

- **Mixed ranks** (``client_ranks``, aggregated by ``rank_mode``,
  :data:`fedfm.core.lora_ranks.RANK_MODES`): the server holds a global adapter of rank
  ``r``. Client ``k`` of rank ``r_k`` receives the first ``r_k`` components of every LoRA
  module and sends back its ``r_k`` trained ones, so the audit ledger shows each client's own
  bytes. The server combines the clients' factors by the mode (SVD re-projection, HetLoRA,
  naive zero-padding) into a rank-``r`` adapter ``θ̂`` and hands ``Δ = θ̂ − θ`` to the server
  optimizer. A client trains its ``r_k`` components inside the model's rank-``r`` adapter
  with the others at zero: a zero row of ``A`` and the zero column of ``B`` beside it get
  zero gradients, so they stay zero and the client's adapter is a rank-``r_k`` LoRA.
- **FFA-LoRA** (``freeze_a``; Sun et al., "Improving LoRA in Privacy-preserving Federated
  Learning", ICLR 2024): ``A`` is the adapter's initial ``A``, drawn from the run seed on the
  server and on every client alike, and never trained; only ``B`` (and any other adapter
  tensor) travels and is averaged. With one ``A`` the mean of the ``B A`` is the mean of the
  ``B`` times ``A``: averaging is exact. DP-SGD then noises ``B``'s gradients only, and
  DP-FedAvg clips and noises ``B`` only.

Choices of ours: a client's rank comes from its position in the task's client order
(``client_ranks`` cycled, one entry per tier); every client scales by the global
``alpha / r`` (peft's scale of the shared adapter), so that one ``B A`` means one update
everywhere; mixed ranks take the example-weighted mean or HetLoRA's weights, not a robust
rule, and not client-level DP (whose clipping assumes one shape). Under DP-SGD the noise
also reaches the zero components a low-rank client carries; they are cut off before the
reply, so what it sends is still rank ``r_k``, but its local training is not exactly that
of a rank-``r_k`` adapter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fedfm.core.aggregate import update_norm
from fedfm.core.federation import ClientContext, Federation
from fedfm.core.lora_ranks import (
    A_SUFFIX,
    RANK_MODES,
    ClientAdapter,
    RankMode,
    pad,
    truncate,
)
from fedfm.core.messages import Message, validate_arrays
from fedfm.core.optim import ServerOptimizer
from fedfm.core.replies import MetricMean, meta_number
from fedfm.errors import ConfigError, UpdateRejectedError
from fedfm.models.lora import LoraConfigSpec
from fedfm.tasks.base import Task

log = logging.getLogger("fedfm")


def lora_spec(task: Task) -> LoraConfigSpec | None:
    """The task's LoRA settings when its model is a LoRA adapter (``task.lora``), else None."""
    spec = getattr(task.cfg, "lora", None)
    return spec if isinstance(spec, LoraConfigSpec) else None


class LoraClients:
    """What mixed ranks or a frozen ``A`` change in a FedAvg-family run (see the module).

    Args:
        spec: The task's LoRA settings.
        client_ids: Every client, in the task's order (ranks follow it).
        init: The adapter the run starts from (its ``A`` is FFA-LoRA's frozen one).
    """

    def __init__(self, spec: LoraConfigSpec, client_ids: list[str], init: Mapping[str, Tensor]):
        self.spec = spec
        self.rank = spec.r
        ranks = spec.client_ranks or [spec.r]
        self.ranks = {cid: ranks[i % len(ranks)] for i, cid in enumerate(client_ids)}
        self.mode: RankMode | None = RANK_MODES.get(spec.rank_mode) if spec.mixed else None
        self.frozen = {k: v.clone() for k, v in init.items() if k.endswith(A_SUFFIX)}

    @classmethod
    def of(cls, task: Task, init: Mapping[str, Tensor]) -> LoraClients | None:
        """The run's :class:`LoraClients`, or None when neither option is on."""
        spec = lora_spec(task)
        if spec is None or not (spec.mixed or spec.freeze_a):
            return None
        return cls(spec, task.client_ids(), init)

    @property
    def freeze_a(self) -> bool:
        """FFA-LoRA: ``A`` is frozen and never sent."""
        return self.spec.freeze_a

    def check(self, opt: ServerOptimizer) -> None:
        """Refuses mixed ranks with a robust rule or client-level DP (one shape each).

        Raises:
            ConfigError: Naming ``task.lora.client_ranks``.
        """
        if self.mode is not None and (opt.user_dp is not None or not opt.aggregator.plain):
            raise ConfigError(
                "task.lora.client_ranks",
                "mixed ranks aggregate by their rank_mode: leave algo.aggregator at the mean"
                " and privacy.user_level off",
            )

    # ----- what travels -----
    def sent(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors of the global adapter that travel (FFA-LoRA: all but ``A``)."""
        return {k: v for k, v in params.items() if not (self.freeze_a and k in self.frozen)}

    def full(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The whole adapter from what travelled: FFA-LoRA adds the frozen ``A``."""
        return {**self.frozen, **params} if self.freeze_a else dict(params)

    def down(self, params: Mapping[str, Tensor], cid: str) -> dict[str, Tensor]:
        """What client ``cid`` receives: its first ``r_k`` components under mixed ranks."""
        return truncate(params, self.ranks[cid]) if self.mode is not None else dict(params)

    # ----- client half -----
    def load(self, ctx: ClientContext, model: nn.Module, glob: Mapping[str, Tensor]) -> dict:
        """Puts a received adapter into ``model``: padded to the global rank, ``A`` added.

        Returns:
            The whole adapter loaded.
        """
        full = self.full(pad(glob, self.rank) if self.mode is not None else glob)
        ctx.task.set_params(model, full)
        return full

    def reply(self, ctx: ClientContext, model: nn.Module, keys: list[str]) -> dict[str, Tensor]:
        """The trained tensors the client sends: ``keys`` at the client's own rank."""
        trained = ctx.task.get_params(model, keys)
        return truncate(trained, self.ranks[ctx.cid]) if self.mode is not None else trained

    @contextlib.contextmanager
    def training(self, ctx: ClientContext, model: nn.Module) -> Iterator[None]:
        """Local training with FFA-LoRA's ``A`` frozen (``requires_grad`` off meanwhile)."""
        if not self.freeze_a:
            yield
            return
        names = ctx.task.param_names(model)
        live = dict(model.named_parameters())
        frozen = [live[names[k]] for k in self.frozen if live[names[k]].requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in frozen:
                p.requires_grad_(True)

    # ----- server half -----
    def round(
        self,
        algo: Any,
        fed: Federation,
        params: dict[str, Tensor],
        opt: ServerOptimizer,
        origin: Mapping[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """A mixed-rank round: each client its own rank; the mode's aggregate, then ``opt``.

        Replies are checked against the shapes of the client's own rank (a reply that does
        not fit is that client's failure) and kept until the round ends: the modes combine
        factors, not a running sum.
        """
        assert self.mode is not None
        cids = algo.sample(fed)
        msgs = {c: Message("train", {"params": self.down(params, c)}) for c in cids}
        clients, loss = [], MetricMean("loss")
        for cid, r in fed.stream(msgs):
            got = r.arrays["params"]
            try:
                validate_arrays(cid, "params", got, msgs[cid].arrays["params"])
            except UpdateRejectedError as e:
                fed.failures.append(
                    {"round": fed.rnd, "client": cid, "kind": "train", "error": str(e)}
                )
                log.warning("round %d: client %s failed on 'train': %s", fed.rnd, cid, e)
                continue
            clients.append(ClientAdapter(got, meta_number(r, "num_examples")))
            loss.add(r)
        algo.require(fed, len(clients), len(cids))
        total = sum(c.weight for c in clients)
        clients = [ClientAdapter(c.params, c.weight / total) for c in clients]
        agg = self.mode.aggregate(clients, self.rank)
        delta = {k: (agg[k].double() - params[k].double()).to(torch.float32) for k in params}
        new = opt.apply_delta(params, delta)
        metrics: dict[str, float] = {"train_loss": loss.mean("loss"), "clients": len(clients)}
        if origin is not None:
            metrics["update_norm"] = update_norm(new, origin)
        return new, metrics
