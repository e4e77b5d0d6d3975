"""Typed messages between the server half and the client half of an algorithm.

A message carries named *array fields* (each a flat ``dict[str, Tensor]``, e.g. the LoRA
parameters) and named *meta fields* (small JSON-able values, e.g. ``num_examples``). Each
message kind declares the fields it may carry in each direction; anything else is refused
(DESIGN.md principle 6), and every message is recorded in the audit ledger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedfm.errors import MessageError, UpdateRejectedError

Arrays = dict[str, Tensor]
MetaValue = bool | int | float | str | list[int] | list[float] | list[str] | dict[str, float] | None


@dataclass
class Message:
    """One message: array fields plus meta fields.

    Attributes:
        kind: The message kind, e.g. ``"train"`` or ``"select.features"``.
        arrays: Field name -> flat tensor dict. Tensors are detached CPU tensors.
        meta: Field name -> small JSON-able value.
    """

    kind: str
    arrays: dict[str, Arrays] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)


@dataclass(frozen=True)
class MessageKind:
    """Declares which fields a message kind may carry in each direction.

    Attributes:
        name: Kind name. On Flower it maps to ``train.<name>`` style message types.
        down_arrays: Array fields the server may send.
        down_meta: Meta fields the server may send.
        up_arrays: Array fields the client may send back.
        up_meta: Meta fields the client may send back.
        roles: Client roles that handle this kind; empty means every role.
        no_grad: Its handler computes no gradients (a weak client that cannot backpropagate:
            voting, feature extraction, generation). The runtime runs it under
            ``torch.inference_mode()``: a ``backward()`` inside fails, and no autograd graph
            or activation is kept.
    """

    name: str
    down_arrays: tuple[str, ...] = ()
    down_meta: tuple[str, ...] = ()
    up_arrays: tuple[str, ...] = ()
    up_meta: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    no_grad: bool = False

    def check(self, msg: Message, direction: str) -> None:
        """Refuses a message that carries an undeclared field.

        Args:
            msg: The message.
            direction: ``"down"`` (server to client) or ``"up"``.

        Raises:
            MessageError: A field is not declared for this kind and direction.
        """
        if msg.kind != self.name:
            raise MessageError(f"message of kind '{msg.kind}' checked against '{self.name}'")
        arrays = self.down_arrays if direction == "down" else self.up_arrays
        meta = self.down_meta if direction == "down" else self.up_meta
        for name in msg.arrays:
            if name not in arrays:
                raise MessageError(
                    f"message '{self.name}' ({direction}): undeclared array field '{name}'"
                    f" (declared: {', '.join(arrays) or 'none'})"
                )
        for name in msg.meta:
            if name not in meta:
                raise MessageError(
                    f"message '{self.name}' ({direction}): undeclared meta field '{name}'"
                    f" (declared: {', '.join(meta) or 'none'})"
                )


def array_bytes(arrays: Mapping[str, Tensor]) -> int:
    """Bytes of the raw tensor data in a flat tensor dict."""
    return sum(t.numel() * t.element_size() for t in arrays.values())


def meta_bytes(value: Any) -> int:
    """Bytes of a meta value as UTF-8 JSON (how it would travel as a config record)."""
    import json

    return len(json.dumps(value, separators=(",", ":")).encode())


def validate_arrays(
    client: str, field_name: str, got: Mapping[str, Tensor], like: Mapping[str, Tensor]
) -> None:
    """Checks a client's tensors against the expected template.

    Args:
        client: Client id, for the error message.
        field_name: Message field, for the error message.
        got: Tensors the client sent.
        like: Template with the expected names, shapes and dtypes.

    Raises:
        UpdateRejectedError: Unknown or missing key, wrong shape, wrong dtype, NaN or Inf.
    """
    for name in got:
        if name not in like:
            raise UpdateRejectedError(client, f"{field_name}.{name}", "unknown key")
    for name, ref in like.items():
        if name not in got:
            raise UpdateRejectedError(client, f"{field_name}.{name}", "missing key")
        t = got[name]
        if not isinstance(t, Tensor):
            raise UpdateRejectedError(
                client, f"{field_name}.{name}", f"not a tensor ({type(t).__name__})"
            )
        if t.dtype != ref.dtype:
            raise UpdateRejectedError(
                client, f"{field_name}.{name}", f"dtype {t.dtype}, expected {ref.dtype}"
            )
        if t.shape != ref.shape:
            raise UpdateRejectedError(
                client,
                f"{field_name}.{name}",
                f"shape {tuple(t.shape)}, expected {tuple(ref.shape)}",
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise UpdateRejectedError(client, f"{field_name}.{name}", f"contains {bad}")
