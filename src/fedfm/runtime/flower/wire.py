"""The wire format of the Flower runtime: fedfm messages as Flower records.

The run payload itself is :mod:`~fedfm.runtime.flower.payload` (re-exported here).

One fedfm :class:`~fedfm.core.messages.Message` = one Flower ``Message``:

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
  ``"meta.json"``: the other meta values (lists, dicts, None) as compact UTF-8 JSON
  (:func:`~fedfm.core.messages.meta_json`, the text the audit ledger counts), since Flower's
  records hold neither dicts nor None.

The header and the handshake are the runtime's own control data, not algorithm fields: the
audit ledger records the fedfm messages exactly as the embedded runtime does, so byte
counts are identical on both runtimes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from fedfm.core.messages import Message, MetaValue, meta_json
from fedfm.errors import MessageError
from fedfm.runtime.flower.payload import (  # noqa: F401  (re-exported)
    HELLO_TYPE,
    MESSAGE_TYPE,
    PAYLOAD_KEY,
    Payload,
)

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, RecordDict
    from flwr.app.typing import ConfigRecordValues


# Flower's own error codes are small integers (0-8 in flwr 1.42); fedfm's sit far above.
CLIENT_ERROR_CODE = 4100
HEADER = "fedfm"
ARRAYS_PREFIX = "arrays."
META = "meta"
META_JSON = "meta.json"
RAW_STYPE = "fedfm.torch_raw"


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


# Scalars a ConfigRecord holds exactly; every other meta value travels as JSON.
_NATIVE = (bool, int, float, str)


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
    native: dict[str, ConfigRecordValues] = {
        k: v for k, v in msg.meta.items() if isinstance(v, _NATIVE)
    }
    other: dict[str, ConfigRecordValues] = {
        k: meta_json(v) for k, v in msg.meta.items() if not isinstance(v, _NATIVE)
    }
    rd[META] = ConfigRecord(native)
    rd[META_JSON] = ConfigRecord(other)
    return rd


def records_to_message(rd: RecordDict) -> tuple[Message, dict[str, Any]]:
    """Inverse of :func:`message_to_records`: the message and its header.

    Raises:
        MessageError: The records are not a fedfm message.
    """
    try:
        configs = rd.config_records
        head = json.loads(str(configs[HEADER]["header"]))
        native, other = configs[META], configs[META_JSON]
        meta: dict[str, MetaValue] = {}
        for name in head["meta"]:
            if name not in native:
                meta[name] = json.loads(str(other[name]))
                continue
            value = native[name]
            if not isinstance(value, _NATIVE):  # only scalars travel natively
                raise TypeError(f"meta field '{name}' is a {type(value).__name__}")
            meta[name] = value
        records = rd.array_records
        arrays = {name: record_to_arrays(records[ARRAYS_PREFIX + name]) for name in head["arrays"]}
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
