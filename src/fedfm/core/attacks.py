"""Simulated poisoning clients, for measuring how aggregation rules hold up.

An attacker runs its honest handler, then replaces its update u = θ_k − θ by ``factor·u``
before replying:

* scaling (``factor`` ≫ 1): the boosted update of a model-replacement attack (Bagdasaryan
  et al. 2020, "How To Backdoor Federated Learning", AISTATS); with ``factor = 1e30`` every
  value is still finite, so no NaN/Inf check catches it.
* sign flipping (``factor`` < 0): the sign-flipping attack of the Byzantine-robust learning
  literature (e.g. Li et al. 2019, "RSA: Byzantine-Robust Stochastic Aggregation Methods for
  Distributed Learning from Heterogeneous Datasets", AAAI), scaled by ``|factor|``.

A reply array field that the server also sent (FedAvg's ``params``, FedeKD's ``proxy``) holds
parameters, so the update is taken against what was sent; any other array field (SCAFFOLD's
``delta_y``) is already an update and is scaled as it is. Meta fields are left honest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from fedfm.core.federation import ClientContext, Handler
from fedfm.core.messages import Arrays, Message


def scale_update(sent: Arrays | None, reply: Arrays, factor: float) -> Arrays:
    """``θ + factor·(θ_k − θ)`` per tensor, or ``factor·u`` when nothing was sent.

    Computed in float64 and cast back to each tensor's dtype, so a huge ``factor`` gives huge
    finite values rather than overflowing earlier than the dtype must.
    """
    out: Arrays = {}
    for name, t in reply.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        base = (
            sent[name].to(torch.float64)
            if sent is not None
            else torch.zeros((), dtype=torch.float64)
        )
        out[name] = (base + factor * (t.to(torch.float64) - base)).to(t.dtype)
    return out


def poisoned(handler: Handler, factor: float) -> Handler:
    """A handler that replies like ``handler`` with every array update scaled by ``factor``."""

    def attack(ctx: ClientContext, msg: Message) -> Message:
        reply = handler(ctx, msg)
        arrays = {f: scale_update(msg.arrays.get(f), a, factor) for f, a in reply.arrays.items()}
        return Message(reply.kind, arrays, dict(reply.meta))

    return attack


def poison_handlers(
    handlers: Mapping[str, Handler], attackers: Collection[str], factor: float
) -> dict[str, Handler]:
    """Handlers where the clients in ``attackers`` poison their updates (see :func:`poisoned`).

    Args:
        handlers: Message kind -> honest handler.
        attackers: Ids of the poisoning clients; the others stay honest.
        factor: Scale of the attackers' updates (1e30: scaling; −k: sign flipping).

    Returns:
        Message kind -> handler that dispatches on the client id.
    """

    def for_kind(honest: Handler) -> Handler:
        bad = poisoned(honest, factor)
        return lambda ctx, msg: (bad if ctx.cid in attackers else honest)(ctx, msg)

    return {kind: for_kind(h) for kind, h in handlers.items()}
