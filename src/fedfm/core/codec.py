"""Codecs for array fields on the wire: what a compressed update costs and what it becomes.

A codec turns one floating-point tensor into *parts* (plain tensors that travel) and back.
The server aggregates the decoded value, and the audit ledger counts the parts' bytes
(:func:`encoded_bytes`), so a run's communication bill is the size of what was sent.

Codecs (registry :data:`CODECS`), each with its error bound per element (:meth:`Codec.bound`):

- ``float32``, ``bfloat16``, ``float16``: a cast; the bound is the format's rounding, half a
  unit in the last place (relative ``2⁻²⁴``, ``2⁻⁸``, ``2⁻¹¹``, plus half the smallest
  subnormal: ``2⁻¹⁵⁰``, ``2⁻¹³⁴``, ``2⁻²⁵``); float16 holds values up to 65504 only.
- ``int8``: blockwise absmax quantisation (Dettmers et al., "8-bit Optimizers via Block-wise
  Quantization", ICLR 2022): each block of :data:`BLOCK` values is scaled by its largest
  magnitude ``m`` and rounded to an integer in [−127, 127]; the error is at most ``m / 254``.
- ``nf4``: 4-bit NormalFloat (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized
  LLMs", NeurIPS 2023): each block scaled by ``m`` into [−1, 1] and rounded to the nearest of
  the paper's 16 NF4 values (:data:`NF4_CODE`), two codes a byte; the error is at most ``m``
  times half the widest gap between neighbouring code values (:data:`NF4_HALF_GAP`).

These are NVIDIA NVFlare's quantisation filters' formats (fp16/bf16, 8-bit and 4-bit
blockwise); written here in torch because the library behind those (bitsandbytes) is a
GPU-kernel package that a CPU client would have to install for a dozen lines of arithmetic.
Choices of ours: blocks of 64 values for both (QLoRA's NF4 block size); scales travel as
float32 (QLoRA's double quantisation of the scales is left out); a tensor is blocked in its
flattened C order, and the last block may be short. None of these formats' sources uses
error feedback, so none is offered.

Under DP the codec runs on what a client's DP mechanism released: quantising a DP output is
post-processing and spends no privacy, whereas quantising before the noise would change the
sensitivity the noise was calibrated to.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fedfm.core.messages import Message, MessageKind
from fedfm.core.settings import CODEC_NAMES
from fedfm.errors import ConfigError
from fedfm.registry import Registry

#: Values per quantisation block (int8 and nf4).
BLOCK = 64

#: The 16 NF4 values of QLoRA (Dettmers et al. 2023, Appendix E), ascending.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
#: Half the widest gap between neighbouring NF4 values (between -1 and -0.6962).
NF4_HALF_GAP = max(b - a for a, b in itertools.pairwise(NF4_CODE)) / 2

Parts = dict[str, Tensor]


@dataclass(frozen=True)
class Codec:
    """One wire format for floating-point tensors.

    Attributes:
        name: Registry name.
        encode: Tensor -> parts (the tensors that travel).
        decode: Parts, shape and dtype -> the tensor the receiver uses.
        bound: Tensor -> the largest error per element its round trip may make.
    """

    name: str
    encode: Callable[[Tensor], Parts]
    decode: Callable[[Parts, tuple[int, ...], torch.dtype], Tensor]
    bound: Callable[[Tensor], Tensor]

    def round_trip(self, t: Tensor) -> tuple[Tensor, int]:
        """What the receiver gets for ``t``, and the bytes that travelled."""
        parts = self.encode(t)
        return self.decode(parts, tuple(t.shape), t.dtype), parts_bytes(parts)


def parts_bytes(parts: Parts) -> int:
    """Bytes of an encoded tensor's parts."""
    return sum(p.numel() * p.element_size() for p in parts.values())


def _cast(dtype: torch.dtype, rel: float, tiny: float = 0.0) -> Codec:
    def encode(t: Tensor) -> Parts:
        return {"values": t.detach().to(dtype)}

    def decode(parts: Parts, shape: tuple[int, ...], out: torch.dtype) -> Tensor:
        return parts["values"].to(out).reshape(shape)

    def bound(t: Tensor) -> Tensor:
        return t.detach().double().abs() * rel + tiny

    return Codec(str(dtype).removeprefix("torch."), encode, decode, bound)


def _blocks(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` flattened into rows of :data:`BLOCK` (zero-padded) and each row's absmax."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    rows = max(1, math.ceil(n / BLOCK))
    padded = torch.cat([flat, flat.new_zeros(rows * BLOCK - n)]).reshape(rows, BLOCK)
    return padded, padded.abs().amax(dim=1)


def _safe(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays 0


def _unblock(values: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    n = math.prod(shape)
    return values.reshape(-1)[:n].to(dtype).reshape(shape)


def _int8_encode(t: Tensor) -> Parts:
    rows, scale = _blocks(t)
    codes = torch.round(rows / _safe(scale)[:, None] * 127).clamp(-127, 127).to(torch.int8)
    return {"codes": codes.reshape(-1)[: t.numel()].clone(), "scales": scale}


def _int8_decode(parts: Parts, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    scale = parts["scales"]
    codes = parts["codes"].float()
    codes = torch.cat([codes, codes.new_zeros(scale.numel() * BLOCK - codes.numel())])
    return _unblock(codes.reshape(-1, BLOCK) * (scale[:, None] / 127), shape, dtype)


def _block_bound(t: Tensor, per_unit: float) -> Tensor:
    _, scale = _blocks(t)
    per = (scale.double() * per_unit)[:, None].expand(-1, BLOCK)
    return _unblock(per, tuple(t.shape), torch.float64)


def _nf4_encode(t: Tensor) -> Parts:
    rows, scale = _blocks(t)
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    idx = (rows / _safe(scale)[:, None]).unsqueeze(-1).sub(code).abs().argmin(dim=-1)
    flat = idx.reshape(-1)[: t.numel()].to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    packed = (flat[0::2] << 4) | flat[1::2]  # two 4-bit codes a byte
    return {"codes": packed, "scales": scale}


def _nf4_decode(parts: Parts, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    packed, scale = parts["codes"], parts["scales"]
    idx = torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1).long()
    idx = torch.cat([idx, idx.new_full((scale.numel() * BLOCK - idx.numel(),), 7)])  # 7: 0.0
    values = torch.tensor(NF4_CODE, dtype=torch.float32)[idx].reshape(-1, BLOCK)
    return _unblock(values * scale[:, None], shape, dtype)


CODECS: Registry[Codec] = Registry("codec", "comm.uplink")
CODECS.register("float32", "32-bit floats (a cast)")(_cast(torch.float32, 2.0**-24, 2.0**-150))
CODECS.register("bfloat16", "bfloat16 (a cast)")(_cast(torch.bfloat16, 2.0**-8, 2.0**-134))
CODECS.register("float16", "float16 (a cast; values up to 65504)")(
    _cast(torch.float16, 2.0**-11, 2.0**-25)
)
CODECS.register("int8", "blockwise absmax int8 (Dettmers et al. 2022)")(
    Codec("int8", _int8_encode, _int8_decode, lambda t: _block_bound(t, 1 / 254))
)
CODECS.register("nf4", "blockwise 4-bit NormalFloat (QLoRA, Dettmers et al. 2023)")(
    Codec("nf4", _nf4_encode, _nf4_decode, lambda t: _block_bound(t, NF4_HALF_GAP))
)
# The config validates codec names without importing torch (settings.CODEC_NAMES).
assert set(CODECS) == set(CODEC_NAMES), "core.settings.CODEC_NAMES is out of date"


@dataclass(frozen=True)
class Wire:
    """The codecs a run's messages travel in (``comm`` in the run config).

    Attributes:
        up: Codec of client-to-server array fields, or None (tensors as they are).
        down: Codec of server-to-client array fields, or None.
        fields: The ``"<kind>.<field>"`` array fields the codecs apply to; None: all of them.
    """

    up: Codec | None = None
    down: Codec | None = None
    fields: frozenset[str] | None = None

    @classmethod
    def of(cls, uplink: str | None, downlink: str | None, fields: list[str] | None) -> Wire:
        """The wire of a ``comm`` config section (names from :data:`CODECS`)."""
        return cls(
            CODECS.get(uplink) if uplink else None,
            CODECS.get(downlink) if downlink else None,
            frozenset(fields) if fields is not None else None,
        )

    def spec(self) -> dict[str, str | list[str] | None]:
        """Inverse of :meth:`of`: the keyword arguments that rebuild this wire."""
        return {
            "uplink": self.up.name if self.up else None,
            "downlink": self.down.name if self.down else None,
            "fields": sorted(self.fields) if self.fields is not None else None,
        }

    @property
    def active(self) -> bool:
        """Some field travels through a codec."""
        return self.up is not None or self.down is not None

    def codec(self, kind: str, field: str, direction: str) -> Codec | None:
        """The codec of one array field in one direction (``"up"``/``"down"``), or None."""
        if self.fields is not None and f"{kind}.{field}" not in self.fields:
            return None
        return self.up if direction == "up" else self.down

    def check(self, kinds: Mapping[str, MessageKind]) -> None:
        """Refuses, at config load, a wire that a run's messages could not travel in.

        Which fields a codec will code is known from the message kinds' declarations before
        any message is sent: each declared array field of a coded direction, or those of
        them that ``comm.fields`` names.

        Args:
            kinds: The run's message kinds by name (the algorithm's ``kinds_for``).

        Raises:
            ConfigError: A ``comm.fields`` entry that no kind declares as an array field
                (``comm.fields``), or a coded field that a kind declares as holding integer
                tensors (``comm.uplink`` / ``comm.downlink``).
        """
        declared = {f"{k.name}.{f}" for k in kinds.values() for f in k.down_arrays + k.up_arrays}
        unknown = sorted((self.fields or frozenset()) - declared)
        if unknown:
            raise ConfigError(
                "comm.fields",
                f"'{unknown[0]}' is no array field of this run's messages"
                f" (declared: {', '.join(sorted(declared)) or 'none'})",
            )
        for kind in kinds.values():
            for direction, names in (("up", kind.up_arrays), ("down", kind.down_arrays)):
                for name in names:
                    if name in kind.integer_arrays and self.codec(kind.name, name, direction):
                        what = kind.secagg_fields.get(name)
                        raise ConfigError(
                            "comm.uplink" if direction == "up" else "comm.downlink",
                            f"field '{kind.name}.{name}' holds integer tensors"
                            f"{f' ({what})' if what else ''}: a"
                            " codec compresses floating-point fields only; name the floating"
                            " ones in comm.fields",
                        )

    def encode(self, msg: Message, direction: str) -> dict[str, dict[str, Parts]]:
        """The parts that travel for each coded array field: field -> key -> parts.

        Raises:
            ConfigError: A coded field holds a tensor that is not floating point (field
                ``comm.uplink`` or ``comm.downlink``).
        """
        out: dict[str, dict[str, Parts]] = {}
        for name, arrays in msg.arrays.items():
            codec = self.codec(msg.kind, name, direction)
            if codec is None:
                continue
            for key, t in arrays.items():
                if not t.is_floating_point():
                    raise ConfigError(
                        "comm.uplink" if direction == "up" else "comm.downlink",
                        f"field '{msg.kind}.{name}' holds a {str(t.dtype).removeprefix('torch.')}"
                        f" tensor ('{key}'): a codec compresses floating-point fields only;"
                        " name the floating ones in comm.fields",
                    )
            out[name] = {key: codec.encode(t) for key, t in arrays.items()}
        return out

    def decode(self, msg: Message, parts: dict[str, dict[str, Parts]], direction: str) -> Message:
        """``msg`` with each coded field replaced by its decoded tensors."""
        arrays = dict(msg.arrays)
        for name, by_key in parts.items():
            codec = self.codec(msg.kind, name, direction)
            assert codec is not None
            arrays[name] = {
                key: codec.decode(
                    p, tuple(msg.arrays[name][key].shape), msg.arrays[name][key].dtype
                )
                for key, p in by_key.items()
            }
        return Message(msg.kind, arrays, dict(msg.meta))

    def round_trip(
        self, msg: Message, direction: str
    ) -> tuple[Message, dict[str, tuple[str, int]]]:
        """What the receiver of ``msg`` gets, and per coded field (codec name, bytes sent).

        Raises:
            ConfigError: See :meth:`encode`.
        """
        parts = self.encode(msg, direction)
        if not parts:
            return msg, {}
        sizes = {}
        for name, by_key in parts.items():
            codec = self.codec(msg.kind, name, direction)
            assert codec is not None
            sizes[name] = (codec.name, sum(parts_bytes(p) for p in by_key.values()))
        return self.decode(msg, parts, direction), sizes
