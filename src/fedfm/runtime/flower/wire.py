"""The wire format of the Flower runtime: fedfm messages as Flower records.

The run payload itself is :mod:`~fedfm.runtime.flower.payload` (re-exported here).

One fedfm :class:`~fedfm.core.messages.Message` = one Flower ``Message`` of few records,
since every Flower record and array is an object of its own that each hop (ServerApp,
SuperLink, SuperNode, ClientApp) pushes or pulls with one HTTP request:

- Flower message type: always ``query.fedfm`` (``query.fedfm_hello`` for the handshake). The
  fedfm kind travels in the header: fedfm kinds are free strings (``"select.features"``),
  Flower actions must be identifiers, and one generic action lets a client refuse an
  unknown kind with fedfm's own named :class:`~fedfm.errors.MessageError`.
- ``"fedfm"``: one ``ConfigRecord`` holding the JSON header (wire version, kind, round,
  client id, field order, run identity for client-state restore, expected reply shapes)
  and the meta fields as ``"meta.<name>"``: scalars (bool, int, float, str) as themselves,
  the other values (lists, dicts, None) as compact UTF-8 JSON
  (:func:`~fedfm.core.messages.meta_json`, the text the audit ledger counts), since
  Flower's records hold neither dicts nor None.
- Each array field that holds tensors is *packed* (:func:`pack_bytes`): the field's
  tensors' raw bytes one after the other, behind a JSON index of names, dtypes and shapes,
  so tensors keep dtype (bfloat16 included), shape and values bit for bit. A packed field
  of at most :data:`INLINE_MAX_BYTES` travels inside the ``"fedfm"`` record as
  ``"arrays.<field>"`` (bytes); a larger one as one ``Array`` (:func:`pack`) in the
  ``ArrayRecord`` ``"arrays"``, which Flower cuts into 5 MB chunks and which stays one
  object on the SuperLink when several clients are sent the same field (objects are
  named by their content). So a message is 3 Flower objects (message, record dict,
  config record) while its fields are small, and 6 with one large field, whatever its
  tensor count: a field of 120 LoRA tensors was 240 objects as one Flower array per tensor.

A field that the run's codecs cover (``comm``, :class:`~fedfm.core.codec.Wire`) travels
encoded: its packed tensors are the codec's parts (``"<key>|<part>"``: int8 or 4-bit codes
and float32 scales), and the header's ``"coded"`` entry names the codec and each tensor's
dtype and shape, from which the receiver decodes. The server names the codecs in the header
(``"comm"``), so a client encodes its reply in the run's uplink codec.

The header and the handshake are the runtime's own control data, not algorithm fields: the
audit ledger records the fedfm messages exactly as the embedded runtime does, so byte
counts are identical on both runtimes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedfm.core.codec import CODECS, Parts, Wire
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
#: The version of this layout; a message of another version is refused by name.
WIRE_VERSION = 2
HEADER = "fedfm"
ARRAYS = "arrays"
ARRAYS_PREFIX = "arrays."
META_PREFIX = "meta."
#: Largest packed field carried inside the header record (bytes); larger ones are Arrays.
INLINE_MAX_BYTES = 64 * 1024
PACKED_STYPE = "fedfm.packed"
_INDEX_LEN = 4  # bytes of the packed index's length (unsigned, little-endian)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw(t: Tensor) -> memoryview:
    """The bytes of a tensor in C order (no copy for a contiguous CPU tensor)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def pack_bytes(arrays: Mapping[str, Tensor]) -> bytes:
    """A flat tensor dict as bytes (key order kept).

    Layout: the length of a JSON index (4 bytes, little-endian), the index
    (``[[name, dtype, shape], ...]``), then each tensor's bytes in C order, in index order.
    """
    ts = {k: t.detach() for k, t in arrays.items()}
    index = [[k, _dtype_name(t.dtype), list(t.shape)] for k, t in ts.items()]
    head = json.dumps(index, separators=(",", ":")).encode()
    parts = [len(head).to_bytes(_INDEX_LEN, "little"), head, *(_raw(t) for t in ts.values())]
    return b"".join(parts)


def unpack_bytes(raw: bytes) -> dict[str, Tensor]:
    """Inverse of :func:`pack_bytes`: every tensor with storage of its own.

    Raises:
        MessageError: The bytes are not packed tensors.
    """
    data = memoryview(raw)
    try:
        n = int.from_bytes(data[:_INDEX_LEN], "little")
        index = json.loads(bytes(data[_INDEX_LEN : _INDEX_LEN + n]))
        pos, out = _INDEX_LEN + n, {}
        for name, dt, shape in index:
            dtype = getattr(torch, dt, None)
            if not isinstance(dtype, torch.dtype):
                raise MessageError(f"unknown tensor dtype '{dt}' in a message")
            size = math.prod(shape) * dtype.itemsize
            if size < 0 or pos + size > len(data):
                raise ValueError(f"tensor '{name}' runs past the end of its array")
            # A copy per tensor: tensors sharing one buffer could not be saved apart
            # (safetensors refuses shared storage) and would keep the whole array alive.
            part = bytearray(data[pos : pos + size])
            t = torch.frombuffer(part, dtype=dtype) if size else torch.empty(0, dtype=dtype)
            out[str(name)] = t.reshape(shape)
            pos += size
    except (TypeError, ValueError) as e:
        raise MessageError(f"malformed packed arrays ({type(e).__name__}: {e})") from None
    if pos != len(data):
        raise MessageError(f"malformed packed arrays ({len(data) - pos} bytes left over)")
    return out


def pack(arrays: Mapping[str, Tensor]) -> Any:
    """A flat tensor dict as one Flower ``Array`` of :func:`pack_bytes`' bytes.

    ``uint8`` of that length with stype :data:`PACKED_STYPE`, carried by any Flower component as it
    carries other arrays.
    """
    return _as_array(pack_bytes(arrays))


def _as_array(data: bytes) -> Any:
    from flwr.app import Array

    return Array(dtype="uint8", shape=(len(data),), stype=PACKED_STYPE, data=data)


def unpack(a: Any) -> dict[str, Tensor]:
    """Inverse of :func:`pack`.

    Raises:
        MessageError: The array is not a packed fedfm array.
    """
    if a.stype != PACKED_STYPE:
        raise MessageError(f"array of stype '{a.stype}' is not a packed fedfm array")
    return unpack_bytes(a.data)


def arrays_to_record(arrays: Mapping[str, Tensor]) -> ArrayRecord:
    """A flat tensor dict as an ``ArrayRecord`` of one packed array (:func:`pack`); no tensors.

    An empty record.
    """
    from flwr.app import ArrayRecord

    return ArrayRecord({"packed": pack(arrays)} if arrays else {})


def record_to_arrays(record: ArrayRecord) -> dict[str, Tensor]:
    """Inverse of :func:`arrays_to_record`."""
    return unpack(record["packed"]) if "packed" in record else {}


# Scalars a ConfigRecord holds exactly; every other meta value travels as JSON.
_NATIVE = (bool, int, float, str)


def message_to_records(
    msg: Message, header: Mapping[str, Any], wire: Wire | None = None, direction: str = "down"
) -> RecordDict:
    """A fedfm message (plus the runtime header) as a Flower ``RecordDict``.

    With ``wire``, the fields its codec for ``direction`` covers travel encoded.
    """
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    as_json = [k for k, v in msg.meta.items() if not isinstance(v, _NATIVE)]
    coded = wire.encode(msg, direction) if wire is not None and wire.active else {}
    fields = {n: _flat_parts(coded[n]) if n in coded else a for n, a in msg.arrays.items()}
    head = {
        **header,
        "wire": WIRE_VERSION,
        "kind": msg.kind,
        "arrays": list(msg.arrays),
        "meta": list(msg.meta),
        "meta_json": as_json,
    }
    if coded:
        head["coded"] = {
            name: [
                _codec_name(wire, msg.kind, name, direction),
                like_spec({"f": msg.arrays[name]})["f"],
            ]
            for name in coded
        }
    entries: dict[str, ConfigRecordValues] = {"header": json.dumps(head)}
    for k, v in msg.meta.items():
        entries[META_PREFIX + k] = v if isinstance(v, _NATIVE) else meta_json(v)
    large = {}
    for name, arrays in fields.items():
        data = pack_bytes(arrays) if arrays else b""
        if len(data) > INLINE_MAX_BYTES:
            large[name] = _as_array(data)
        elif data:
            entries[ARRAYS_PREFIX + name] = data
    rd = RecordDict({HEADER: ConfigRecord(entries)})
    if large:
        rd[ARRAYS] = ArrayRecord(large)
    return rd


def records_to_message(rd: RecordDict) -> tuple[Message, dict[str, Any]]:
    """Inverse of :func:`message_to_records`: the message and its header.

    Raises:
        MessageError: The records are not a fedfm message of this wire version.
    """
    try:
        record = rd.config_records[HEADER]
        head = json.loads(str(record["header"]))
        if head.get("wire") != WIRE_VERSION:
            raise MessageError(
                f"fedfm wire format {head.get('wire', 1)} where this fedfm reads"
                f" {WIRE_VERSION}: install the same fedfm version on the server and the clients"
            )
        as_json = set(head["meta_json"])
        meta: dict[str, MetaValue] = {}
        for name in head["meta"]:
            value = record[META_PREFIX + name]
            if name in as_json:
                meta[name] = json.loads(str(value))
            elif isinstance(value, _NATIVE):  # only scalars travel natively
                meta[name] = value
            else:
                raise TypeError(f"meta field '{name}' is a {type(value).__name__}")
        large: Mapping[str, Any] = rd.array_records.get(ARRAYS, {})
        arrays = {name: _field(record, large, name) for name in head["arrays"]}
        for name, (codec, spec) in head.get("coded", {}).items():
            arrays[name] = _decoded(str(codec), arrays[name], spec)
        return Message(str(head["kind"]), arrays, meta), head
    except (KeyError, TypeError, ValueError) as e:
        raise MessageError(f"malformed fedfm message ({type(e).__name__}: {e})") from None


def _field(record: Mapping[str, Any], large: Mapping[str, Any], name: str) -> dict[str, Tensor]:
    """An array field of a message: inside the header record, a packed Array, or empty."""
    inline = record.get(ARRAYS_PREFIX + name)
    if isinstance(inline, bytes):
        return unpack_bytes(inline)
    return unpack(large[name]) if name in large else {}


def _codec_name(wire: Wire | None, kind: str, field: str, direction: str) -> str:
    codec = wire.codec(kind, field, direction) if wire is not None else None
    assert codec is not None
    return codec.name


def _flat_parts(by_key: Mapping[str, Parts]) -> dict[str, Tensor]:
    """One field's encoded tensors as one flat dict, ``"<key>|<part>"`` (packed as usual)."""
    return {f"{key}|{part}": t for key, parts in by_key.items() for part, t in parts.items()}


def _decoded(codec: str, flat: Mapping[str, Tensor], spec: Mapping[str, Any]) -> dict[str, Tensor]:
    """Inverse of :func:`_flat_parts` followed by the codec's decoding."""
    parts: dict[str, Parts] = {}
    for name, t in flat.items():
        key, _, part = name.rpartition("|")
        parts.setdefault(key, {})[part] = t
    c = CODECS.get(codec)
    shapes = like_templates({"f": spec})["f"]
    return {key: c.decode(parts[key], tuple(ref.shape), ref.dtype) for key, ref in shapes.items()}


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
