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
- **FLoRA** (``rank_mode: flora``; Wang et al., NeurIPS 2024): ``r`` is the capacity of the
  global adapter, which holds the stacks of every round so far in its first ``h`` components
  (the rest has ``B = 0``). Each round the server sends those ``h`` components (the downlink
  grows by ``Σ r_k`` every round); a client trains ``r_k`` fresh components beside them, the
  received ones frozen, and sends back only its fresh ones; the server stacks them,
  ``[p_1 B_1 … p_K B_K]`` and ``[A_1; …; A_K]``, after the ``h`` filled ones: the global
  update is exactly ``Σ p_k B_k A_k`` (FLoRA's clients merge the stack into their base weights
  and start a new adapter each round; here the stack stays an adapter, which the frozen base
  shared by every simulated client needs). ``r`` must hold ``rounds · Σ r_k`` components.
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
rule, and not client-level DP (whose clipping assumes one shape). FLoRA's fresh components
start from the run's initial ``A`` rows in their slots (``B = 0``); its frozen components
keep their gradients at zero and are restored after local training (a weight decay would
otherwise have shrunk them meanwhile). Under DP-SGD the noise
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
    flora_aggregate,
    lora_modules,
    pad,
    rank_of,
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
        self.flora = spec.mixed and spec.rank_mode == "flora"
        self.init = {k: v.clone() for k, v in init.items()}  # FLoRA's fresh components
        self.filled = 0  # FLoRA: components of the global adapter holding stacks
        self._slots = (0, 0)  # FLoRA, client side: the components being trained

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

    def check(self, opt: ServerOptimizer, rounds: int, client_level_dp: bool) -> None:
        """Refuses what mixed ranks cannot run with.

        A robust rule or client-level DP (``client_level_dp``: each wants one shape), and
        FLoRA without room for ``rounds`` stacks.

        Raises:
            ConfigError: Naming ``task.lora.client_ranks`` or ``task.lora.r``.
        """
        if self.mode is not None and (client_level_dp or not opt.aggregator.plain):
            raise ConfigError(
                "task.lora.client_ranks",
                "mixed ranks aggregate by their rank_mode: leave algo.aggregator at the mean"
                " and privacy.user_level off",
            )
        need = rounds * sum(self.ranks.values())
        if self.flora and need > self.rank:
            raise ConfigError(
                "task.lora.r",
                f"FLoRA stacks every client's components each round: {rounds} rounds of"
                f" {len(self.ranks)} clients need r >= {need}, got {self.rank}",
            )

    # ----- what travels -----
    def sent(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors of the global adapter that travel (FFA-LoRA: all but ``A``)."""
        return {k: v for k, v in params.items() if not (self.freeze_a and k in self.frozen)}

    def full(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The whole adapter from what travelled: FFA-LoRA adds the frozen ``A``."""
        return {**self.frozen, **params} if self.freeze_a else dict(params)

    def down(self, params: Mapping[str, Tensor], cid: str) -> dict[str, Tensor]:
        """What client ``cid`` receives.

        Its first ``r_k`` components under mixed ranks, the filled components under FLoRA.
        """
        if self.flora:
            return truncate(params, self.filled)
        return truncate(params, self.ranks[cid]) if self.mode is not None else dict(params)

    # ----- client half -----
    def load(self, ctx: ClientContext, model: nn.Module, glob: Mapping[str, Tensor]) -> dict:
        """Puts a received adapter into ``model``: padded to the global rank, ``A`` added.

        Returns:
            The whole adapter loaded.
        """
        if self.flora:
            full = self._flora_full(glob, self.ranks[ctx.cid])
        else:
            full = self.full(pad(glob, self.rank) if self.mode is not None else glob)
        ctx.task.set_params(model, full)
        return full

    def _flora_full(self, glob: Mapping[str, Tensor], r: int) -> dict[str, Tensor]:
        """The received stacks, then ``r`` fresh components (initial ``A`` rows, ``B = 0``)."""
        h = rank_of(glob)
        full = {k: v.clone() for k, v in self.init.items()}
        full.update({k: v for k, v in glob.items() if k not in full or v.shape == full[k].shape})
        for a_key, b_key in lora_modules(full).values():
            full[a_key][:h] = glob[a_key]
            full[b_key].zero_()
            full[b_key][:, :h] = glob[b_key]
        self._slots = (h, h + r)
        return full

    def reply(self, ctx: ClientContext, model: nn.Module, keys: list[str]) -> dict[str, Tensor]:
        """The trained tensors the client sends: ``keys`` at the client's own rank."""
        trained = ctx.task.get_params(model, keys)
        if self.flora:
            lo, hi = self._slots
            for a_key, b_key in lora_modules(trained).values():
                trained[a_key] = trained[a_key][lo:hi].clone()
                trained[b_key] = trained[b_key][:, lo:hi].clone()
            return trained
        return truncate(trained, self.ranks[ctx.cid]) if self.mode is not None else trained

    @contextlib.contextmanager
    def training(self, ctx: ClientContext, model: nn.Module) -> Iterator[None]:
        """Local training with the components that must not move frozen.

        FFA-LoRA's ``A`` (``requires_grad`` off meanwhile), or FLoRA's received components.
        """
        if self.flora:
            with self._flora_training(ctx, model):
                yield
            return
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

    @contextlib.contextmanager
    def _flora_training(self, ctx: ClientContext, model: nn.Module) -> Iterator[None]:
        """Gradients outside the fresh components masked; those components restored after."""
        lo, hi = self._slots
        names = ctx.task.param_names(model)
        live = dict(model.named_parameters())
        hooks, keep = [], {}
        for a_key, b_key in lora_modules(names).values():
            a, b = live[names[a_key]], live[names[b_key]]
            rows = torch.zeros(a.shape[0], 1, dtype=a.dtype, device=a.device)
            rows[lo:hi] = 1
            hooks.append(a.register_hook(lambda g, m=rows: g * m))
            hooks.append(b.register_hook(lambda g, m=rows.T: g * m))
            keep[a_key], keep[b_key] = a.detach().clone(), b.detach().clone()
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            with torch.no_grad():
                for a_key, b_key in lora_modules(names).values():
                    a, b = live[names[a_key]], live[names[b_key]]
                    a[:lo], a[hi:] = keep[a_key][:lo], keep[a_key][hi:]
                    b[:, :lo], b[:, hi:] = keep[b_key][:, :lo], keep[b_key][:, hi:]

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
        # The shapes each client must send back: its own r_k components.
        expect = {c: truncate(params, self.ranks[c]) for c in cids}
        clients, loss = [], MetricMean("loss")
        for cid, r in fed.stream(msgs):
            got = r.arrays["params"]
            try:
                validate_arrays(cid, "params", got, expect[cid])
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
        agg = (
            self._stacked(params, clients)
            if self.flora
            else self.mode.aggregate(clients, self.rank)
        )
        delta = {k: (agg[k].double() - params[k].double()).to(torch.float32) for k in params}
        new = opt.apply_delta(params, delta)
        metrics: dict[str, float] = {"train_loss": loss.mean("loss"), "clients": len(clients)}
        if origin is not None:
            metrics["update_norm"] = update_norm(new, origin)
        return new, metrics

    def _stacked(self, params: Mapping[str, Tensor], clients: list[ClientAdapter]) -> dict:
        """FLoRA: this round's stack written after the filled components."""
        stack = flora_aggregate(clients, 0)
        out = {k: v.clone() for k, v in params.items()}
        lo = self.filled
        for key, t in stack.items():
            if key.endswith(A_SUFFIX):
                out[key][lo : lo + t.shape[0]] = t
            elif key in lora_keys(params):
                out[key][:, lo : lo + t.shape[1]] = t
            else:
                out[key] = t
        self.filled = lo + rank_of(stack)
        return out


def lora_keys(params: Mapping[str, Tensor]) -> set[str]:
    """The keys of the LoRA factors among an adapter's tensors."""
    return {k for pair in lora_modules(params).values() for k in pair}
