"""SecAgg+: the server learns the sum of the clients' vectors and nothing else.

Papers:
    * Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth. "Practical
      Secure Aggregation for Privacy-Preserving Machine Learning", CCS 2017 (SecAgg).
    * Bell, Bonawitz, Gascón, Lepoint, Raykova. "Secure Single-Server Aggregation with
      (Poly)Logarithmic Overhead", CCS 2020 (SecAgg+: shares over a sparse neighbour graph).

The protocol runs on fedfm's own messages (:class:`~fedfm.core.federation.Federation`), so
every runtime runs it unchanged. One round over the sampled clients ``U0``:

1. ``secagg.keys``: each client draws two X25519 key pairs (``c`` encrypts shares, ``s``
   agrees masks) and advertises the public halves. Repliers: ``U1``.
2. ``secagg.shares``: the server lays ``U1`` on a ring in a seeded order; each client's
   neighbours are the nearest ``⌈(k−1)/2⌉`` on each side (a Harary graph, ``k`` =
   ``num_shares``). A client draws a 32-byte self-mask seed ``b``, splits ``b`` and its
   secret ``s`` key into Shamir shares (pycryptodome, threshold ``t``), and sends each
   neighbour its pair of shares encrypted under AES-GCM with a key from HKDF over their
   ``c`` agreement (the server forwards ciphertexts it cannot read). Repliers: ``U2``.
3. The algorithm's update kind, its message plus the ciphertexts for the client: the client
   decrypts and keeps its shares, computes its update with the algorithm's own handler, and
   sends only ``y = q(x) + PRG(b) + Σ_j ±PRG(s_ij) mod M`` over its neighbours ``j`` in
   ``U2`` (sign by id order), where ``q`` clips each coordinate to ``±clipping_range`` and
   rounds it stochastically to ``[0, Q−1]``. The PRG is AES-256 in counter mode keyed by
   HKDF of the seed. Repliers: ``U3``.
4. ``secagg.unmask``: each client of ``U3`` is told which of its neighbours sent a vector
   (it reveals its share of their ``b``) and which dropped after step 2 (it reveals its
   share of their ``s`` key). A client refuses to reveal both kinds for one peer, in one
   message or across two, and refuses when it sent no vector itself. With ``t`` shares the
   server rebuilds each ``b_i`` of ``U3`` and each dropped client's ``s`` key, removes their
   masks, and dequantises the sum. Fewer than ``t`` shares of any secret fail the round
   with nothing aggregated.

What a vector carries: ``x = r_k·u_k`` and ``r_k`` (``r_k = min(1, n_k/max_weight)``, the
weight inside the masked vector, as Flower's SecAgg+), or, for DP clients whose weights are
public, the noised update itself and its noisy clip bit (``privacy.secagg.dp_noise:
continuous``), or the distributed discrete Gaussian's encoding of the raw update
(:mod:`fedfm.core.ddg`, the default under DP: clipped, rotated, rounded and noised on the
integer grid; the server decodes the unmasked sum). ``u_k`` is the update the
algorithm's reply carries, less the vector the server sent in the same field. Per
coordinate, the unmasked sum of ``n`` vectors within ``±clipping_range`` differs from the
plain sum by less than ``n·2·clipping_range/(Q−1)`` (stochastic rounding moves a value by
less than one step).

Security (as the papers): against an honest-but-curious server and fewer than ``t``
colluding clients, the messages reveal the sum over ``U3`` only. Choices of ours: the
neighbour order is drawn from the run seed and round; the threshold and the share count
a client accepts are checked by the client against its own config.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from fedfm.core import ddg as _ddg
from fedfm.core.aggregate import ReplySum, RunningMean
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.messages import Arrays, Message, MessageKind, MetaSpec
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secret import noise_seed
from fedfm.core.seeding import derive_seed
from fedfm.core.settings import SecAggConfig
from fedfm.core.userdp import BIT, DPSum
from fedfm.errors import ConfigError, FedfmError, TooFewClientsError

log = logging.getLogger("fedfm")

FIELD = "privacy.secagg"
KEYS, SHARES, UNMASK = "secagg.keys", "secagg.shares", "secagg.unmask"
FORWARDED = "secagg_shares"  # down field of an update kind: the ciphertexts for the client
MASKED = "masked"  # the one up field of an update kind under SecAgg+
STATE = "secagg"  # ClientState.meta key of the round's keys, seed and shares
SHARE_BYTES = 36  # 4-byte index + two 16-byte Shamir chunks of a 32-byte secret

#: Labels of what leaves a client under SecAgg+, as the audit ledger marks them.
KEY_MATERIAL, ENCRYPTED, MASKED_VECTOR = "key material", "encrypted shares", "masked vector"

KINDS = (
    MessageKind(
        KEYS, up_arrays=("keys",), secagg_fields={"keys": KEY_MATERIAL}, integer_arrays=("keys",)
    ),
    MessageKind(
        SHARES,
        down_arrays=("keys",),
        down_meta=("threshold",),
        up_arrays=("shares",),
        meta_specs={"threshold": MetaSpec("int", ge=1, required=True)},
        secagg_fields={"shares": ENCRYPTED},
        integer_arrays=("keys", "shares"),
    ),
    MessageKind(
        UNMASK,
        down_meta=("active", "dropped"),
        up_arrays=("b", "sk"),
        meta_specs={
            "active": MetaSpec("any", required=True),
            "dropped": MetaSpec("any", required=True),
        },
        secagg_fields={"b": KEY_MATERIAL, "sk": KEY_MATERIAL},
        integer_arrays=("b", "sk"),
    ),
)


class Refused(FedfmError):
    """A client refuses a SecAgg+ request that would break the protocol's guarantee."""


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class SecAgg:
    """A run's SecAgg+ parameters, checked against its clients at load.

    Attributes:
        cfg: ``privacy.secagg``.
        shares: Shares of each secret when every sampled client answers.
        threshold: ``t``.
        weighted: Example weights travel inside the vector (else public and equal: DP).
        ddg: Client-side DP-FedAvg's distributed discrete Gaussian (:mod:`fedfm.core.ddg`):
            vectors are its encodings, decoded after unmasking; None: :func:`quantise`.
    """

    cfg: SecAggConfig
    shares: int
    threshold: int
    weighted: bool
    ddg: _ddg.DDG | None = None

    @property
    def step(self) -> float:
        """One quantisation level, ``2·clipping_range/(Q−1)``."""
        return 2 * self.cfg.clipping_range / (self.cfg.quantization_range - 1)

    def bound(self, n: int) -> float:
        """The per-coordinate bound on |unmasked − plain| for ``n`` vectors within range."""
        return n * self.step

    def sum(
        self, fed: Federation, messages: Mapping[str, Message], base: Mapping[str, Tensor]
    ) -> SecureSum:
        """One round around the update messages (:func:`secure_sum`), logged.

        This is how the one aggregation step (:func:`fedfm.core.aggregate.aggregate_round`)
        runs SecAgg+ (a :class:`~fedfm.core.aggregate.SecureSummer`).
        """
        got = secure_sum(fed, self, messages, base)
        log.info(
            "round %d: SecAgg+ summed %d clients (%d unmasked from shares)",
            fed.rnd,
            got.count,
            len(got.dropped),
        )
        return got


def resolve(
    cfg: SecAggConfig, sampled: int, most: int, weighted: bool, ddg: bool = False
) -> SecAgg:
    """The run's SecAgg+ parameters.

    Args:
        cfg: ``privacy.secagg``.
        sampled: Clients a round samples (expected, under Poisson sampling).
        most: The most clients a round can sum.
        weighted: Weights travel inside the masked vector.
        ddg: The vectors are the distributed discrete Gaussian's (its plan checks the
            modulus once the update's size is known:
            :meth:`fedfm.core.userdp.UserDP.ddg_plan`).

    Raises:
        ConfigError: A threshold above the shares or below half of them, or a modulus too
            small for ``most`` quantised vectors.
    """
    shares = _count(cfg.num_shares, sampled)
    t = cfg.reconstruction_threshold
    threshold = t if isinstance(t, int) else _count(t, shares)
    if threshold > shares:
        raise ConfigError(
            f"{FIELD}.reconstruction_threshold",
            f"{threshold} is above the {shares} shares of each client's secrets (the round's"
            f" {sampled} sampled clients)",
        )
    if 2 * threshold < shares:
        raise ConfigError(
            f"{FIELD}.reconstruction_threshold",
            f"{threshold} is below half of the {shares} shares: disjoint sets of clients could"
            " rebuild both secrets of one client",
        )
    need = most * (cfg.quantization_range - 1)
    if not ddg and cfg.modulus_range <= need:
        raise ConfigError(
            f"{FIELD}.modulus_range",
            f"{cfg.modulus_range} does not hold the sum of {most} clients' vectors quantised"
            f" to {cfg.quantization_range} levels (needs more than {need})",
        )
    return SecAgg(cfg, shares, threshold, weighted)


def _count(v: int | float, of: int) -> int:
    return min(of, v) if isinstance(v, int) else max(1, math.ceil(v * of))


# ----------------------------------------------------------------------------- primitives


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def _agree(private: bytes, public: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(public)
    )


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def word(modulus: int) -> type[np.unsignedinteger[Any]]:
    """The unsigned dtype masked sums run in: uint32 up to a modulus of 2**32, else uint64.

    Its wrap-around (2**32 or 2**64) is a multiple of the power-of-two modulus, so sums
    and differences in it are right modulo the modulus.
    """
    return np.uint32 if modulus <= 2**32 else np.uint64


def prg(seed: bytes, d: int, modulus: int) -> np.ndarray:
    """``d`` values in ``[0, modulus)`` from AES-256-CTR keyed by HKDF(seed), as :func:`word`.

    Four keystream bytes per value up to a modulus of 2**32, eight above. At a modulus of
    2**32 (2**64) the keystream is used as it is, read-only.
    """
    key = _hkdf(seed, b"fedfm secagg+ mask")
    w = word(modulus)
    size = np.dtype(w).itemsize
    encrypt = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = np.frombuffer(encrypt.update(bytes(size * d)), dtype=w)
    return stream if modulus == 2 ** (8 * size) else stream & w(modulus - 1)


def _split(secret: bytes, t: int, n: int) -> list[bytes]:
    """``n`` Shamir shares (threshold ``t``) of a 32-byte secret, each :data:`SHARE_BYTES`."""
    parts = [Shamir.split(t, n, secret[i : i + 16], ssss=False) for i in (0, 16)]
    return [
        idx.to_bytes(4, "little") + a + b
        for (idx, a), (_, b) in zip(parts[0], parts[1], strict=True)
    ]


def _combine(shares: Sequence[bytes]) -> bytes:
    """The 32-byte secret from at least its threshold of :func:`_split`'s shares."""
    out = b""
    for lo in (4, 20):
        out += Shamir.combine(
            [(int.from_bytes(s[:4], "little"), s[lo : lo + 16]) for s in shares], ssss=False
        )
    return out


def _u8(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _bytes(t: Tensor) -> bytes:
    return t.to(torch.uint8).numpy().tobytes()


def _aad(sender: str, receiver: str, rnd: int) -> bytes:
    return f"{sender}|{receiver}|{rnd}".encode()


# ----------------------------------------------------------------------------- vectors


def flat_update(reply: Arrays, sent: Arrays, extra: int = 0) -> np.ndarray:
    """``reply − sent`` in sorted name order, as float64, with ``extra`` zeros after it.

    Subtracted in each tensor's compute dtype (float32, float64 for float64), as the plain
    mean subtracts, so both sum the same differences.
    """
    out = np.zeros(sum(sent[k].numel() for k in sent) + extra)
    start = 0
    for k in sorted(sent):
        cd = torch.promote_types(sent[k].dtype, torch.float32)
        n = sent[k].numel()
        diff = reply[k].detach().to(cd) - sent[k].detach().to(cd)
        out[start : start + n] = diff.flatten().numpy()
        start += n
    return out


def quantise(x: np.ndarray, sa: SecAgg, rng: np.random.Generator) -> np.ndarray:
    """Clip to ``±clipping_range``, stochastic rounding to ``[0, Q−1]`` (as :func:`word`)."""
    c = sa.cfg.clipping_range
    w = word(sa.cfg.modulus_range)
    y = np.clip(x, -c, c)
    y += c
    y /= sa.step
    low = np.floor(y)
    y -= low  # the fraction: rounded up with that probability
    q = low.astype(w)
    q += rng.random(y.shape) < y
    return np.minimum(q, w(sa.cfg.quantization_range - 1), out=q)


def wire_dtype(modulus: int) -> torch.dtype:
    """The tensor dtype of a masked vector: 4 bytes a value up to a modulus of 2**32."""
    return torch.int32 if modulus <= 2**32 else torch.int64


def to_wire(y: np.ndarray, modulus: int) -> Tensor:
    """Values in ``[0, modulus)`` as a signed tensor of the same bits (no signed overflow)."""
    if modulus <= 2**32:
        return torch.from_numpy(y.astype(np.uint32, copy=False).view(np.int32))
    return torch.from_numpy(y.view(np.int64))


def from_wire(t: Tensor) -> np.ndarray:
    """:func:`to_wire`'s tensor back to uint64 values."""
    a = t.numpy()
    return (a.view(np.uint32) if a.dtype == np.int32 else a.view(np.uint64)).astype(np.uint64)


def unflatten(v: np.ndarray, like: Mapping[str, Tensor]) -> Arrays:
    """A flat float64 vector back into ``like``'s tensors (sorted name order)."""
    out: Arrays = {}
    start = 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = torch.from_numpy(v[start : start + n].copy()).reshape(like[k].shape)
        start += n
    return out


# ----------------------------------------------------------------------------- client half


def _state(ctx: ClientContext) -> dict[str, Any]:
    st = ctx.state.meta.get(STATE)
    if not isinstance(st, dict) or st.get("round") != ctx.rnd:
        raise Refused(f"client {ctx.cid}: no SecAgg+ round {ctx.rnd} in progress")
    return st


def _keys(ctx: ClientContext, msg: Message) -> Message:
    c, s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    ctx.state.meta[STATE] = {
        "round": ctx.rnd,
        "c": _raw_private(c).hex(),
        "s": _raw_private(s).hex(),
    }
    return Message(KEYS, {"keys": {"c": _u8(_raw_public(c)), "s": _u8(_raw_public(s))}})


class NoisePlan(Protocol):
    """What a client needs to encode with the distributed discrete Gaussian.

    :class:`~fedfm.core.userdp.UserDP` is one.
    """

    noise: Any  # where the noise comes from: "secret" or "seeded"

    def ddg_plan(self, dim: int) -> _ddg.DDG:
        """The plan for updates of ``dim`` coordinates."""
        ...


class ClientSecAgg:
    """The client half of SecAgg+ around an algorithm's handlers.

    Args:
        sa: The run's parameters (the client's own config: it checks the server's threshold).
        dp: Client-side DP-FedAvg whose noise is the distributed discrete Gaussian: the
            client then encodes its raw update with its ``ddg_plan`` (clip, rotate,
            round, noise) instead of :func:`quantise`; None: no DP, or ``continuous`` noise
            already added by :class:`~fedfm.core.userdp.ClientDP`.
    """

    def __init__(self, sa: SecAgg, dp: NoisePlan | None = None) -> None:
        self.sa = sa
        self.dp = dp
        self._plans: dict[int, _ddg.DDG] = {}

    def handlers(
        self, inner: Mapping[str, Handler], kinds: Mapping[str, MessageKind]
    ) -> dict[str, Handler]:
        """``inner`` with each update kind wrapped, plus the protocol's own kinds."""
        out = dict(inner)
        for name, kind in kinds.items():
            if kind.secure_field and name in inner:
                out[name] = self._masked(inner[name], kind.secure_field)
        return {**out, KEYS: _keys, SHARES: self._shares, UNMASK: self._unmask}

    def _shares(self, ctx: ClientContext, msg: Message) -> Message:
        st = _state(ctx)
        keys = msg.arrays["keys"]
        peers = sorted({k.rpartition("/")[0] for k in keys} - {ctx.cid})
        members = sorted([ctx.cid, *peers])
        t = int(msg.meta["threshold"])  # type: ignore[arg-type]
        least = _count(self.sa.cfg.reconstruction_threshold, len(members))
        if t < least or 2 * t < len(members) or t > len(members):
            raise Refused(
                f"client {ctx.cid}: threshold {t} for {len(members)} shares is outside"
                f" [{max(least, math.ceil(len(members) / 2))}, {len(members)}]"
            )
        b = os.urandom(32)
        pairs = [
            x + y
            for x, y in zip(
                _split(b, t, len(members)),
                _split(bytes.fromhex(st["s"]), t, len(members)),
                strict=True,
            )
        ]
        out: Arrays = {}
        for j, pair in zip(members, pairs, strict=True):
            if j == ctx.cid:
                st["held"] = {j: pair.hex()}
                continue
            key = _hkdf(_agree(bytes.fromhex(st["c"]), _bytes(keys[f"{j}/c"])), b"fedfm share")
            nonce = os.urandom(12)
            ct = AESGCM(key).encrypt(nonce, pair, _aad(ctx.cid, j, ctx.rnd))
            out[j] = _u8(nonce + ct)
        st.update(
            b=b.hex(),
            t=t,
            peers_c={j: _bytes(keys[f"{j}/c"]).hex() for j in peers},
            peers_s={j: _bytes(keys[f"{j}/s"]).hex() for j in peers},
        )
        return Message(SHARES, {"shares": out})

    def _masked(self, inner: Handler, field: str) -> Handler:
        def handle(ctx: ClientContext, msg: Message) -> Message:
            st = _state(ctx)
            forwarded = msg.arrays.get(FORWARDED, {})
            for i, ct in forwarded.items():
                if i not in st.get("peers_c", {}):
                    raise Refused(f"client {ctx.cid}: a share from {i!r}, not a neighbour")
                raw = _bytes(ct)
                key = _hkdf(
                    _agree(bytes.fromhex(st["c"]), bytes.fromhex(st["peers_c"][i])), b"fedfm share"
                )
                pair = AESGCM(key).decrypt(raw[:12], raw[12:], _aad(i, ctx.cid, ctx.rnd))
                st["held"][i] = pair.hex()
            plain = Message(
                msg.kind, {k: v for k, v in msg.arrays.items() if k != FORWARDED}, dict(msg.meta)
            )
            reply = inner(ctx, plain)
            rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
            modulus = self.sa.cfg.modulus_range
            if self.dp is not None:
                u = flat_update(reply.arrays[field], plain.arrays[field])
                y = self._ddg(ctx, u, rng).astype(word(modulus))
            else:
                vec = self._vector(reply, plain.arrays[field], field)
                y = quantise(vec, self.sa, rng)
            y += prg(bytes.fromhex(st["b"]), y.size, modulus)
            own = bytes.fromhex(st["s"])
            for j in sorted(forwarded):  # the word wraps at a multiple of the modulus
                m = prg(_agree(own, bytes.fromhex(st["peers_s"][j])), y.size, modulus)
                (np.add if ctx.cid < j else np.subtract)(y, m, out=y)
            y &= word(modulus)(modulus - 1)
            st["sent"] = True
            st["masked_with"] = sorted(forwarded)
            return Message(msg.kind, {MASKED: {"y": to_wire(y, modulus)}})

        return handle

    def _ddg(self, ctx: ClientContext, u: np.ndarray, rounding: np.random.Generator) -> np.ndarray:
        """The distributed discrete Gaussian's encoding of the raw update ``u``."""
        assert self.dp is not None
        if u.size not in self._plans:
            self._plans[u.size] = self.dp.ddg_plan(u.size)
        noise = np.random.default_rng(noise_seed(ctx, "user-dp", self.dp.noise))
        return self._plans[u.size].encode(u, rotation_seed(ctx.seed, ctx.rnd), noise, rounding)

    def _vector(self, reply: Message, sent: Arrays, field: str) -> np.ndarray:
        u = flat_update(reply.arrays[field], sent, extra=1)  # the last: weight or clip bit
        if self.sa.weighted:
            n = float(reply.meta["num_examples"])  # type: ignore[arg-type]
            r = min(1.0, n / self.sa.cfg.max_weight)
            u *= r
            u[-1] = r
            return u
        u[-1] = float(reply.meta.get(BIT, 0.0))  # type: ignore[arg-type]
        return u

    def _unmask(self, ctx: ClientContext, msg: Message) -> Message:
        st = _state(ctx)
        active = {str(x) for x in msg.meta["active"]}  # type: ignore[union-attr]
        dropped = {str(x) for x in msg.meta["dropped"]}  # type: ignore[union-attr]
        why = _refusal(ctx.cid, st, active, dropped)
        if why:
            log.warning("client %s refuses to unmask: %s", ctx.cid, why)
            raise Refused(f"client {ctx.cid} refuses to unmask: {why}")
        revealed = st.setdefault("revealed", {})
        held = st["held"]
        b = {j: _u8(bytes.fromhex(held[j])[:SHARE_BYTES]) for j in sorted(active)}
        sk = {j: _u8(bytes.fromhex(held[j])[SHARE_BYTES:]) for j in sorted(dropped)}
        revealed.update({j: "b" for j in active} | {j: "sk" for j in dropped})
        return Message(UNMASK, {"b": b, "sk": sk})


def _refusal(cid: str, st: Mapping[str, Any], active: set[str], dropped: set[str]) -> str:
    """Why a client must not answer an unmask request ('' when it may)."""
    if not st.get("sent"):
        return "it sent no masked vector this round"
    both = active & dropped
    if both:
        return f"asked for both shares of {sorted(both)[0]}"
    revealed = st.get("revealed", {})
    again = [j for j in active if revealed.get(j) == "sk"] + [
        j for j in dropped if revealed.get(j) == "b"
    ]
    if again:
        return f"already revealed the other share of {sorted(again)[0]}"
    if cid in dropped:
        return "asked for its own secret key"
    unknown = (active | dropped) - set(st["held"])
    if unknown:
        return f"holds no share of {sorted(unknown)[0]}"
    return ""


# ----------------------------------------------------------------------------- kinds


def as_secure(kind: MessageKind, field: str) -> MessageKind:
    """An update kind under SecAgg+: the ciphertexts go down with it, one masked vector up."""
    return replace(
        kind,
        down_arrays=(*kind.down_arrays, FORWARDED),
        up_arrays=(MASKED,),
        up_meta=(),
        dp_fields=(MASKED,) if kind.dp else (),
        public_fields=(),
        secagg_fields={MASKED: MASKED_VECTOR},
        secure_field=field,
        integer_arrays=(*kind.integer_arrays, FORWARDED, MASKED),
    )


def secure_kinds(
    kinds: Mapping[str, MessageKind], fields: Mapping[str, str], dp: bool
) -> dict[str, MessageKind]:
    """``kinds`` with the update kinds in their SecAgg+ form and the protocol's kinds added.

    Under DP the protocol's own up fields are public: keys and shares are drawn before, and
    apart from, the client's data.
    """
    out = dict(kinds)
    for name, field in fields.items():
        out[name] = as_secure(out[name], field)
    for k in KINDS:
        out[k.name] = replace(k, dp=True, public_fields=k.up_arrays) if dp else k
    return out


# ----------------------------------------------------------------------------- server half


@dataclass
class SecureSum:
    """What the server learns of a round: the sum over the clients whose vectors it got.

    Attributes:
        total: Σ of the vectors' update part per tensor (float64): Σ r_k·u_k, or Σ u_k.
        extra: Σ of the last coordinate: Σ r_k (weighted), or Σ of the clip bits.
        count: ``|U3|``.
        clients: ``U3``, the clients whose vectors the sum holds.
        dropped: Clients that shared their keys but sent no vector (unmasked from shares).
    """

    total: Arrays
    extra: float
    count: int
    clients: list[str]
    dropped: list[str]
    threshold: int = 0

    def metrics(self) -> dict[str, float]:
        """The round's SecAgg+ figures: its threshold, the clients summed, those unmasked."""
        return {
            "secagg/threshold": self.threshold,
            "secagg/summed": self.count,
            "secagg/unmasked_dropped": len(self.dropped),
        }


def neighbours(cids: Sequence[str], shares: int, seed: int) -> dict[str, list[str]]:
    """A Harary-like ring: each client's ``⌈(shares−1)/2⌉`` nearest on each side.

    The ring's order is a permutation drawn from ``seed``.
    """
    order = [cids[i] for i in np.random.default_rng(seed).permutation(len(cids))]
    n, h = len(order), math.ceil((shares - 1) / 2)
    out: dict[str, list[str]] = {}
    for p, c in enumerate(order):
        near = {order[(p + d) % n] for d in range(-h, h + 1)} - {c}
        out[c] = sorted(near)
    return out


def _fail(fed: Federation, why: str) -> TooFewClientsError:
    return TooFewClientsError(f"round {fed.rnd}: SecAgg+ failed, nothing aggregated: {why}")


def secure_sum(
    fed: Federation, sa: SecAgg, messages: Mapping[str, Message], base: Mapping[str, Tensor]
) -> SecureSum:
    """Runs one SecAgg+ round around the update messages; the server learns only the sum.

    Args:
        fed: The federation.
        sa: The run's parameters.
        messages: Client id -> the algorithm's update message (its kind in SecAgg+ form).
        base: The tensors whose shapes the summed update has (the field the clients send).

    Returns:
        The unmasked, dequantised sum.

    Raises:
        TooFewClientsError: Fewer than ``t`` clients in a stage, or fewer than ``t`` shares
            of a secret the sum needs (one line; nothing is aggregated).
    """
    t = sa.threshold
    keys = _stage(fed, t, "advertised keys", fed.send({c: Message(KEYS) for c in messages}))
    graph = neighbours(sorted(keys), sa.shares, derive_seed(fed.seed, fed.rnd, "secagg"))
    short = [c for c, near in graph.items() if len(near) + 1 < t]
    if short:
        raise _fail(
            fed, f"client {short[0]} has {len(graph[short[0]]) + 1} shares, fewer than t={t}"
        )
    share_msgs = {c: _share_message(c, graph[c], keys, t) for c in graph}
    shared = _stage(fed, t, "shared their keys", fed.send(share_msgs))
    for c, r in shared.items():
        if set(r.arrays["shares"]) != set(graph[c]):
            raise _fail(fed, f"client {c} sent shares for other clients than its neighbours")
    d = sa.ddg.rotated if sa.ddg is not None else sum(v.numel() for v in base.values()) + 1
    total = np.zeros(d, dtype=word(sa.cfg.modulus_range))
    sent: list[str] = []
    masked = {c: _with_shares(messages[c], c, graph[c], shared) for c in shared}
    for c, r in fed.stream(masked):
        y = r.arrays[MASKED]["y"]
        if y.dtype != wire_dtype(sa.cfg.modulus_range) or y.shape != (d,):
            fed.failures.append(
                {
                    "round": fed.rnd,
                    "client": c,
                    "kind": r.kind,
                    "error": "masked vector of another shape or dtype",
                }
            )
            continue
        total += y.numpy().view(total.dtype)  # the same bits, unsigned
        sent.append(c)
    if len(sent) < t:
        raise _fail(fed, f"{len(sent)} clients sent masked vectors, fewer than t={t}")
    dropped = sorted(set(shared) - set(sent))
    total = _unmask(fed, sa, graph, keys, sent, dropped, total)
    if sa.ddg is not None:  # no last coordinate: DP weights are public, the bound fixed
        got = sa.ddg.decode(total, rotation_seed(fed.seed, fed.rnd))
        return SecureSum(unflatten(got, base), 0.0, len(sent), sent, dropped, t)
    vec = total.astype(np.float64) * sa.step - len(sent) * sa.cfg.clipping_range
    total_arrays = unflatten(vec[:-1], base)
    return SecureSum(total_arrays, float(vec[-1]), len(sent), sent, dropped, t)


def rotation_seed(seed: int, rnd: int) -> int:
    """The discrete Gaussian's rotation in round ``rnd``: public randomness of the run."""
    return derive_seed(seed, rnd, "ddg-rotation")


def _stage(fed: Federation, t: int, what: str, got: dict[str, Message]) -> dict[str, Message]:
    if len(got) < t:
        raise _fail(fed, f"{len(got)} clients {what}, fewer than the threshold t={t}")
    return got


def _share_message(c: str, near: list[str], keys: Mapping[str, Message], t: int) -> Message:
    arrays = {f"{j}/{w}": keys[j].arrays["keys"][w] for j in near for w in ("c", "s")}
    return Message(SHARES, {"keys": arrays}, {"threshold": t})


def _with_shares(msg: Message, c: str, near: list[str], shared: Mapping[str, Message]) -> Message:
    fwd = {j: shared[j].arrays["shares"][c] for j in near if j in shared}
    return Message(msg.kind, {**msg.arrays, FORWARDED: fwd}, dict(msg.meta))


def _unmask(
    fed: Federation,
    sa: SecAgg,
    graph: Mapping[str, list[str]],
    keys: Mapping[str, Message],
    sent: list[str],
    dropped: list[str],
    total: np.ndarray,
) -> np.ndarray:
    t, d, alive, gone = sa.threshold, total.size, set(sent), set(dropped)
    asks = {
        c: Message(
            UNMASK,
            meta={
                "active": sorted((set(graph[c]) | {c}) & alive),
                "dropped": sorted(set(graph[c]) & gone),
            },
        )
        for c in sent
    }
    replies = fed.send(asks)
    b_shares: dict[str, list[bytes]] = {c: [] for c in sent}
    sk_shares: dict[str, list[bytes]] = {c: [] for c in dropped}
    for r in replies.values():
        for j, s in r.arrays["b"].items():
            if j in b_shares:
                b_shares[j].append(_bytes(s))
        for j, s in r.arrays["sk"].items():
            if j in sk_shares:
                sk_shares[j].append(_bytes(s))
    short = sorted(w for w, got in (*b_shares.items(), *sk_shares.items()) if len(got) < t)
    if short:
        raise _fail(fed, f"fewer than t={t} shares of the secrets of clients {', '.join(short)}")
    modulus = sa.cfg.modulus_range
    for c in sent:
        total -= prg(_combine(b_shares[c][:t]), d, modulus)
    for x in dropped:
        sk = _combine(sk_shares[x][:t])
        for j in sorted(set(graph[x]) & alive):
            m = prg(_agree(sk, _bytes(keys[j].arrays["keys"]["s"])), d, modulus)
            (np.subtract if j < x else np.add)(total, m, out=total)  # j added +m when j < x
    return total & word(modulus)(modulus - 1)


# ----------------------------------------------------------------------------- folding


def fold_sum(acc: Any, got: SecureSum) -> None:
    """Folds a secure sum into a round's accumulator (a mean of deltas, or DP-FedAvg's sum)."""
    if isinstance(acc, DPSum | RunningMean | ReplySum):
        acc.add_sum(got.total, got.extra, got.count)
    else:
        raise TypeError(f"SecAgg+ cannot fold into {type(acc).__name__}: not a sum")


def secure_round(
    fed: Federation,
    sa: SecAgg,
    messages: Mapping[str, Message],
    field: str,
    base: Mapping[str, Tensor],
    acc: Any,
) -> SecureSum:
    """One update exchange under SecAgg+, its sum folded into ``acc`` (and returned)."""
    got = sa.sum(fed, messages, base)
    fold_sum(acc, got)
    return got


def refuse_non_sum(aggregator: AggregatorConfig, cosines: bool = False) -> None:
    """Refuses SecAgg+ with a server step that needs each client's update.

    Raises:
        ConfigError: A robust aggregator (``algo.aggregator``) or update cosines
            (``algo.update_cosines``).
    """
    if not aggregator.plain:
        raise ConfigError(
            "algo.aggregator",
            f"'{aggregator.name}' needs each client's update; under"
            " privacy.secure_aggregation=secagg+ the server learns only their sum",
        )
    if cosines:
        raise ConfigError(
            "algo.update_cosines",
            "needs each client's update; under secagg+ the server learns only their sum",
        )
