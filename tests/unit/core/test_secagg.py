"""SecAgg+ (fedfm.core.secagg): the unmasked sum, dropouts at every stage, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedfm.core.aggregate import mean_delta
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientContext, dispatch
from fedfm.core.messages import Message, MessageKind
from fedfm.core.secagg import (
    KEYS,
    MASKED,
    SHARES,
    UNMASK,
    ClientSecAgg,
    SecAgg,
    _combine,
    from_wire,
    prg,
    quantise,
    resolve,
    secure_kinds,
    secure_round,
    secure_sum,
)
from fedfm.core.seeding import derive_seed
from fedfm.core.settings import SecAggConfig
from fedfm.core.state import ClientState
from fedfm.errors import TooFewClientsError

UPDATE = MessageKind(
    "train", down_arrays=("params",), up_arrays=("params",), up_meta=("num_examples", "loss")
)
CIDS = [str(i) for i in range(7)]
SIZES = {c: 50 + 37 * int(c) for c in CIDS}
BASE = {"a": torch.zeros(3, 4), "b": torch.ones(5)}
CFG = SecAggConfig(num_shares=5, reconstruction_threshold=3, max_weight=400.0)


def _vectors(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {c: {k: torch.randn(v.shape, generator=gen) for k, v in BASE.items()} for c in CIDS}


class Clients:
    """Seven clients behind a FakeFederation; ``drop`` maps a client to the kind it dies at."""

    def __init__(self, drop: dict[str, str] | None = None, cfg: SecAggConfig = CFG) -> None:
        self.vectors = _vectors()
        self.kinds = secure_kinds({"train": UPDATE}, {"train": "params"}, dp=False)
        self.sa = resolve(cfg, len(CIDS), len(CIDS), weighted=True)
        inner = {"train": self._train}
        self.handlers = ClientSecAgg(SecAgg(cfg, 0, 0, True)).handlers(inner, self.kinds)
        self.states = {c: ClientState() for c in CIDS}
        self.drop = dict(drop or {})
        self.gone: set[str] = set()
        self.fed = FakeFederation(CIDS, self._reply, kinds=self.kinds.values())

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        sent = msg.arrays["params"]
        trained = {k: sent[k] + self.vectors[ctx.cid][k] for k in sent}
        return Message("train", {"params": trained}, {"num_examples": SIZES[ctx.cid], "loss": 0.0})

    def _reply(self, cid: str, msg: Message) -> Message:
        if cid in self.gone or self.drop.get(cid) == msg.kind:
            self.gone.add(cid)
            raise ConnectionError(f"client {cid} dropped at {msg.kind}")
        ctx = ClientContext(cid, "default", self.fed.rnd, 0, None, self.states[cid])  # type: ignore[arg-type]
        return dispatch(self.handlers, self.kinds, ctx, msg)

    def messages(self) -> dict[str, Message]:
        return {c: Message("train", {"params": BASE}) for c in CIDS}

    def plain(self, cids: list[str]) -> tuple[np.ndarray, float]:
        r = {c: min(1.0, SIZES[c] / CFG.max_weight) for c in cids}
        flat = {
            c: np.concatenate([self.vectors[c][k].double().flatten().numpy() for k in sorted(BASE)])
            for c in cids
        }
        return sum(r[c] * flat[c] for c in cids), sum(r.values())  # type: ignore[return-value]


def _flat(arrays: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([arrays[k].double().flatten().numpy() for k in sorted(arrays)])


# One client dropped at each stage: before sharing (keys, shares), after sharing (its masked
# vector never comes: unmasked from the survivors' shares), and while unmasking.
@pytest.mark.parametrize("stage", ["none", KEYS, SHARES, "train", UNMASK])
def test_the_unmasked_sum_is_the_plain_sum_within_the_quantisation_bound(stage: str) -> None:
    cl = Clients({} if stage == "none" else {"3": stage})
    got = secure_sum(cl.fed, cl.sa, cl.messages(), BASE)
    summed = [c for c in CIDS if stage in ("none", UNMASK) or c != "3"]
    want, weight = cl.plain(summed)
    assert got.count == len(summed)
    assert got.dropped == (["3"] if stage == "train" else [])
    bound = cl.sa.bound(len(summed))
    assert np.abs(_flat(got.total) - want).max() <= bound
    assert abs(got.extra - weight) <= bound
    assert 0 < bound < 1e-4  # 7 clients at 2^22 levels over ±8
    failed = {(f["client"], f["kind"]) for f in cl.fed.failures}
    assert failed == (set() if stage == "none" else {("3", stage)})


def test_fedavg_delta_through_secagg_equals_the_weighted_mean() -> None:
    cl = Clients({"5": "train"})
    acc = mean_delta(BASE)
    summed = secure_round(cl.fed, cl.sa, cl.messages(), "params", BASE, acc)
    assert sorted(summed.clients) == ["0", "1", "2", "3", "4", "6"]
    assert summed.metrics() == {
        "secagg/threshold": 3,
        "secagg/summed": 6,
        "secagg/unmasked_dropped": 1,
    }
    want, weight = cl.plain([c for c in CIDS if c != "5"])
    got = _flat(acc.result())
    # |S'/W' − S/W| ≤ (|ΔS| + |S/W|·|ΔW|)/W' with |ΔS|, |ΔW| ≤ the bound
    bound = cl.sa.bound(6) * (1 + np.abs(want / weight).max()) / (weight - cl.sa.bound(6))
    assert np.abs(got - want / weight).max() <= bound


@pytest.mark.parametrize("stage", [KEYS, SHARES, "train"])
def test_fewer_survivors_than_the_threshold_fail_the_round_with_nothing_summed(
    stage: str,
) -> None:
    cl = Clients({c: stage for c in ("0", "1", "2", "4", "6")})  # 2 left, t = 3
    acc = mean_delta(BASE)
    with pytest.raises(TooFewClientsError, match=r"SecAgg\+ failed, nothing aggregated: .*t=3"):
        secure_round(cl.fed, cl.sa, cl.messages(), "params", BASE, acc)
    assert acc.count == 0


def test_too_few_shares_of_a_dropped_clients_key_fail_the_round() -> None:
    # "3" sends shares then drops; its neighbours die while unmasking: too few sk shares.
    cl = Clients({"3": "train"})
    keys = cl.fed.send({c: Message(KEYS) for c in CIDS})
    from fedfm.core.secagg import neighbours

    graph = neighbours(sorted(keys), cl.sa.shares, derive_seed(0, cl.fed.rnd, "secagg"))
    near = graph["3"]  # four holders of 3's shares: two die, two are left (t = 3)
    cl.drop.update({j: UNMASK for j in near[:2]})
    cl.states = {c: ClientState() for c in CIDS}  # a fresh round
    cl.fed.failures.clear()
    with pytest.raises(
        TooFewClientsError, match=r"fewer than t=3 shares of the secrets of clients [\d, ]*\b3\b"
    ):
        secure_sum(cl.fed, cl.sa, cl.messages(), BASE)


def test_a_client_never_reveals_both_shares_of_one_peer() -> None:
    cl = Clients({"3": "train"})
    secure_sum(cl.fed, cl.sa, cl.messages(), BASE)
    asked = next(m for _, c, m in cl.fed.sent if m.kind == UNMASK and "3" in m.meta["dropped"])
    cid = next(c for _, c, m in cl.fed.sent if m is asked)
    peer = next(j for j in asked.meta["active"] if j != cid)  # type: ignore[union-attr]
    cl.fed.failures.clear()
    # In one message: the same peer as active and dropped.
    both = Message(UNMASK, meta={"active": [peer], "dropped": [peer]})
    assert cl.fed.send({cid: both}) == {}
    # Across messages: the sk share of a peer whose b share it already revealed.
    late = Message(UNMASK, meta={"active": [], "dropped": [peer]})
    assert cl.fed.send({cid: late}) == {}
    errors = [f["error"] for f in cl.fed.failures]
    assert errors == [
        f"client {cid} refuses to unmask: asked for both shares of {peer}",
        f"client {cid} refuses to unmask: already revealed the other share of {peer}",
    ]


def test_the_servers_messages_alone_do_not_give_a_clients_vector() -> None:
    """A masked vector is its quantised update plus masks the server can remove only with t
    shares, and it holds t shares of one kind per client, never of both."""
    cl2 = Clients({"3": "train"})
    ups: dict[str, dict[str, Message]] = {}

    def spy(cid: str, msg: Message) -> Message:  # what the server receives, kept
        reply = cl2._reply(cid, msg)
        ups.setdefault(cid, {})[reply.kind] = reply
        return reply

    cl2.fed.replies = spy
    got = secure_sum(cl2.fed, cl2.sa, cl2.messages(), BASE)
    modulus = cl2.sa.cfg.modulus_range
    for cid in ("0", "6"):
        y = from_wire(ups[cid]["train"].arrays[MASKED]["y"])
        x = np.append(min(1.0, SIZES[cid] / 400.0) * _flat(cl2.vectors[cid]), 0.0)
        q = quantise(x, cl2.sa, np.random.default_rng(0)).astype(np.int64)
        # Off by far more than rounding: the masks look uniform on [0, M).
        assert np.abs(y.astype(np.int64) - q).min() > 1000
        # Their mean within 5 SE of the middle (a uniform's SD is M / sqrt(12)): the earlier
        # bound, 0.2 M, is 2.9 SE for these 18 elements: it failed once, as expected about
        # once in 150 runs (two clients checked).
        assert abs(float(y.mean()) / modulus - 0.5) < 5 / math.sqrt(12 * y.size)
        # With t shares of its seed b the server removes the self mask; the pairwise masks
        # stay, since it holds no share of this survivor's key (only of dropped clients').
        b = [
            _bytes_of(ups[j][UNMASK].arrays["b"][cid])
            for j in ups
            if UNMASK in ups[j] and cid in ups[j][UNMASK].arrays["b"]
        ]
        sk_holders = [j for j in ups if UNMASK in ups[j] and cid in ups[j][UNMASK].arrays["sk"]]
        assert len(b) >= cl2.sa.threshold and sk_holders == []
        d = y.size
        left = (y - prg(_combine(b[: cl2.sa.threshold]), d, modulus)) & np.uint64(modulus - 1)
        assert np.abs(left.astype(np.int64) - q).min() > 1000
        # t − 1 shares rebuild another seed: the self mask does not come off.
        wrong = (y - prg(_combine(b[: cl2.sa.threshold - 1]), d, modulus)) & np.uint64(modulus - 1)
        assert not np.array_equal(wrong, left)
    assert got.count == 6


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def test_bad_secagg_parameters_are_refused_naming_the_field() -> None:
    from fedfm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"reconstruction_threshold.*above the 5 shares"):
        resolve(SecAggConfig(num_shares=5, reconstruction_threshold=6), 7, 7, True)
    with pytest.raises(ConfigError, match=r"reconstruction_threshold.*below half"):
        resolve(SecAggConfig(num_shares=1.0, reconstruction_threshold=3), 10, 10, True)
    with pytest.raises(ConfigError, match=r"modulus_range.*sum of 10 clients"):
        resolve(SecAggConfig(quantization_range=2**20, modulus_range=2**23), 10, 10, True)


def test_a_client_refuses_a_threshold_below_its_own_config() -> None:
    """A server that asks for fewer shares than the config's threshold is refused (logged)."""
    cl = Clients()
    keys = cl.fed.send({c: Message(KEYS) for c in CIDS})
    arrays = {f"{j}/{w}": keys[j].arrays["keys"][w] for j in ("1", "2", "3", "4") for w in "cs"}
    low = Message(SHARES, {"keys": arrays}, {"threshold": 2})  # config: 3 of 5 shares
    assert cl.fed.send({"0": low}) == {}
    assert "threshold 2 for 5 shares is outside [3, 5]" in cl.fed.failures[-1]["error"]
    ok = Message(SHARES, {"keys": arrays}, {"threshold": 3})
    assert set(cl.fed.send({"0": ok})["0"].arrays["shares"]) == {"1", "2", "3", "4"}
