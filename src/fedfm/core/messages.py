"""Typed messages between the server half and the client half of an algorithm.

A message carries named *array fields* (each a flat ``dict[str, Tensor]``, e.g. the LoRA
parameters) and named *meta fields* (small JSON-able values, e.g. ``num_examples``). Each
message kind declares the fields it may carry in each direction; anything else is refused
(DESIGN.md principle 6), and every message is recorded in the audit ledger.

A reply is checked in full before an algorithm sees it: every meta field against its
:class:`MetaSpec` (type, finiteness, range; well-known names such as ``num_examples`` have a
standard spec) and every array field the server expects against its template. A reply that
fails is the sending client's failure only: it is logged and left out of the round.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor

from fedfm.errors import ConfigError, MessageError, UpdateRejectedError

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


# Largest example count a client may claim: far beyond any real client (2^40 ≈ 1.1e12 rows),
# small enough that a weight stays exact in float64 (ours).
MAX_EXAMPLES = 2**40


@dataclass(frozen=True)
class MetaSpec:
    """Type and range of one meta field.

    Attributes:
        type: ``"int"`` (an integer, not a bool), ``"float"`` (a finite real number),
            ``"metrics"`` (a dict of names to finite real numbers), ``"bool"``, ``"str"``, or
            ``"any"`` (any meta value; numbers anywhere in it must be finite).
        ge: Smallest allowed value (numbers only).
        le: Largest allowed value (numbers only).
        required: A reply must carry the field.
    """

    type: Literal["int", "float", "metrics", "bool", "str", "any"] = "any"
    ge: float | None = None
    le: float | None = None
    required: bool = False

    def problem(self, value: Any) -> str | None:
        """Why ``value`` does not fit this spec, or None when it does."""
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                return f"must be an integer, got {_show(value)}"
            return self._range(int(value))
        if self.type == "float":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                return f"must be a number, got {_show(value)}"
            if not math.isfinite(float(value)):
                return f"must be finite, got {value}"
            return self._range(float(value))
        if self.type == "metrics":
            if not isinstance(value, Mapping):
                return f"must be a mapping of names to numbers, got {_show(value)}"
            for k, v in value.items():
                bad = MetaSpec("float").problem(v) if isinstance(k, str) else "key is not a str"
                if bad:
                    return f"entry {k!r} {bad}"
            return None
        if self.type == "bool":
            return None if isinstance(value, bool) else f"must be a bool, got {_show(value)}"
        if self.type == "str":
            return None if isinstance(value, str) else f"must be a string, got {_show(value)}"
        return _non_finite(value)

    def _range(self, x: float) -> str | None:
        if self.ge is not None and x < self.ge:
            return f"{x:g} is below {self.ge:g}"
        if self.le is not None and x > self.le:
            return f"{x:g} is above {self.le:g}"
        return None


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'…' if len(text) > 40 else ''}"


def _non_finite(value: Any) -> str | None:
    """Where a nested meta value holds a NaN or infinite number, if anywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"holds a non-finite number ({value})"
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return next((bad for v in value if (bad := _non_finite(v))), None)
    return None


#: Specs of meta fields with a common meaning; a kind may override them (``meta_specs``).
STANDARD_META: dict[str, MetaSpec] = {
    "num_examples": MetaSpec("int", ge=1, le=MAX_EXAMPLES, required=True),
    "loss": MetaSpec("float", required=True),
    "metrics": MetaSpec("metrics", required=True),
}
#: ``num_examples`` of an evaluation reply: a client's local test split may be empty.
EVAL_EXAMPLES = MetaSpec("int", ge=0, le=MAX_EXAMPLES, required=True)


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
        meta_specs: Specs of meta fields (either direction) that differ from
            :data:`STANDARD_META`; a field with neither is any meta value with finite numbers.
        dp_fields: Up fields that are a DP mechanism's output (noised on the client), when
            the run privatises this kind.
        public_fields: Up fields whose values were fixed before the client saw its data.
        dp: In this run, ``dp_fields`` are DP outputs (the audit ledger marks them).
        private: In this run, only DP clients send this kind and nothing unnoised may
            leave them: every up field must be in ``dp_fields`` or ``public_fields``
            (checked when the algorithm is built, and on every reply).
        secagg_fields: Up fields of the SecAgg+ protocol -> what they are (key material,
            encrypted shares, a masked vector), as the audit ledger marks them.
        secure_field: Under SecAgg+, the field whose update this kind's masked vector sums.
        integer_arrays: Array fields (either direction) whose tensors are not floating point
            (key material, ciphertexts, masked integer vectors): no wire codec may code them
            (:meth:`fedfm.core.codec.Wire.check`, at config load).
    """

    name: str
    down_arrays: tuple[str, ...] = ()
    down_meta: tuple[str, ...] = ()
    up_arrays: tuple[str, ...] = ()
    up_meta: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    no_grad: bool = False
    meta_specs: Mapping[str, MetaSpec] = field(default_factory=dict, hash=False)
    dp_fields: tuple[str, ...] = ()
    public_fields: tuple[str, ...] = ()
    dp: bool = False
    private: bool = False
    secagg_fields: Mapping[str, str] = field(default_factory=dict, hash=False)
    secure_field: str = ""
    integer_arrays: tuple[str, ...] = ()

    def as_private(self) -> MessageKind:
        """This kind as DP clients send it: only its DP outputs and public fields travel up."""
        allowed = set(self.dp_fields) | set(self.public_fields)
        return replace(
            self,
            up_arrays=tuple(f for f in self.up_arrays if f in allowed),
            up_meta=tuple(f for f in self.up_meta if f in allowed),
            dp=True,
            private=True,
        )

    def noised(self) -> MessageKind:
        """This kind with its ``dp_fields`` marked as DP outputs, other fields allowed."""
        return replace(self, dp=True)

    def privacy_of(self, name: str) -> str | None:
        """``"dp"`` or ``"public"`` for an up field of a DP kind, else None."""
        if not self.dp:
            return None
        if name in self.dp_fields:
            return "dp"
        return "public" if name in self.public_fields else None

    def check_declaration(self) -> None:
        """Refuses a private kind with an up field that is neither a DP output nor public.

        Raises:
            ConfigError: Naming the field (``messages.<kind>.<field>``).
        """
        if not self.private:
            return
        for name in (*self.up_arrays, *self.up_meta):
            if name not in self.dp_fields and name not in self.public_fields:
                raise ConfigError(
                    f"messages.{self.name}.{name}",
                    "a DP client's message may carry only DP mechanism outputs (dp_fields)"
                    " and values fixed before it saw its data (public_fields)",
                )

    def spec(self, name: str) -> MetaSpec:
        """The spec of meta field ``name``."""
        return self.meta_specs.get(name) or STANDARD_META.get(name) or MetaSpec()

    def check(self, msg: Message, direction: str) -> None:
        """Refuses a message with an undeclared field, or a meta field that fails its spec.

        Args:
            msg: The message.
            direction: ``"down"`` (server to client) or ``"up"``.

        Raises:
            MessageError: A field is not declared for this kind and direction, a required meta
                field is missing, or a meta value has the wrong type or is out of range.
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
        if direction == "up" and self.private:
            for name in (*msg.arrays, *msg.meta):
                if self.privacy_of(name) is None:
                    raise MessageError(
                        f"message '{self.name}' (up): field '{name}' is neither a DP"
                        " mechanism's output nor public"
                    )
        for name in meta:
            spec = self.spec(name)
            if name not in msg.meta:
                if spec.required:
                    raise MessageError(
                        f"message '{self.name}' ({direction}): meta field '{name}' is missing"
                    )
                continue
            bad = spec.problem(msg.meta[name])
            if bad:
                raise MessageError(
                    f"message '{self.name}' ({direction}): meta field '{name}' {bad}"
                )


def array_bytes(arrays: Mapping[str, Tensor]) -> int:
    """Bytes of the raw tensor data in a flat tensor dict."""
    return sum(t.numel() * t.element_size() for t in arrays.values())


def meta_json(value: Any) -> str:
    """A meta value as compact JSON text, non-ASCII characters kept as they are.

    The form in which a non-scalar meta value travels on the Flower runtime (a string entry
    of a config record), and the text whose UTF-8 bytes the audit ledger counts.
    """
    import json

    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def meta_bytes(value: Any) -> int:
    """Bytes of a meta value as UTF-8 JSON (:func:`meta_json`): "é" counts 2 bytes, not 6."""
    return len(meta_json(value).encode("utf-8"))


def validate_reply(
    client: str, reply: Message, like: Mapping[str, Mapping[str, Tensor]] | None
) -> None:
    """Checks a reply's array fields against the templates the server expects.

    Args:
        client: Client id, for the error message.
        reply: The reply (its declared fields already checked by :meth:`MessageKind.check`).
        like: Array field -> template; each named field must be present and match.

    Raises:
        UpdateRejectedError: A templated field is missing or fails :func:`validate_arrays`.
    """
    for name, template in (like or {}).items():
        if name not in reply.arrays:
            raise UpdateRejectedError(client, name, "missing array field")
        validate_arrays(client, name, reply.arrays[name], template)


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
