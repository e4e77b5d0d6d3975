"""The distributed discrete Gaussian (fedfm.core.ddg): sampler, rotation, encoding, bounds."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from fedfm.core import ddg as G
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientContext, dispatch
from fedfm.core.messages import Message, MessageKind
from fedfm.core.secagg import (
    KEYS,
    SHARES,
    UNMASK,
    ClientSecAgg,
    SecAgg,
    resolve,
    secure_kinds,
    secure_sum,
)
from fedfm.core.settings import SecAggConfig
from fedfm.core.state import ClientState
from fedfm.errors import ConfigError


def _chi2(draws: np.ndarray, sigma: float) -> float:
    """The p-value of draws against N_Z(0, σ²), cells with at least 20 expected, tails merged."""
    lim = math.ceil(6 * sigma) + 1
    ys = np.arange(-lim, lim + 1)
    p = G.discrete_gaussian_pmf(sigma, ys)
    keep = p * draws.size >= 20
    ys, p = ys[keep], p[keep]
    counts = np.array([(draws == y).sum() for y in ys] + [(~np.isin(draws, ys)).sum()])
    expected = np.append(p, 1 - p.sum()) * draws.size
    return float(stats.chisquare(counts, expected).pvalue)


@pytest.mark.parametrize("sigma", [0.7, 3.0, 25.0])
def test_the_sampler_follows_the_discrete_gaussian_pmf(sigma: float) -> None:
    draws = G.discrete_gaussian(sigma, 200_000, np.random.default_rng(1))
    assert draws.dtype == np.int64
    assert _chi2(draws, sigma) > 1e-4
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(draws.size)


def test_the_pmf_test_rejects_a_rounded_continuous_gaussian() -> None:
    """The test above can fail: at σ = 0.7 rounding N(0, σ²) is not N_Z(0, σ²)."""
    rounded = np.rint(np.random.default_rng(1).normal(0, 0.7, 200_000)).astype(np.int64)
    assert _chi2(rounded, 0.7) < 1e-6


def test_the_discrete_laplace_proposal_follows_its_pmf() -> None:
    t = 3.0
    draws = G.discrete_laplace(t, 200_000, np.random.default_rng(2))
    for y in (0, 1, -2, 5):
        want = math.tanh(1 / (2 * t)) * math.exp(-abs(y) / t)  # (1−e^{−1/t})/(1+e^{−1/t})
        got = float((draws == y).mean())
        assert abs(got - want) < 5 * math.sqrt(want / draws.size), y


def test_the_rotation_is_orthonormal_and_the_server_inverts_it() -> None:
    x = np.random.default_rng(3).normal(size=1000)
    r = G.rotate(x, 11)
    assert r.size == 1024
    assert np.linalg.norm(r) == pytest.approx(np.linalg.norm(x), rel=1e-12)
    assert np.abs(G.unrotate(r, 11, 1000) - x).max() < 1e-12
    h = G.hadamard(np.eye(8)[2])  # a column of H/√8: ±1/√8
    assert np.allclose(np.abs(h), 1 / math.sqrt(8))
    assert not np.allclose(G.rotate(x, 12), r)  # the round's seed draws the signs


def _updates(n: int, d: int, seed: int = 4) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [gen.normal(size=d) * s for s in np.linspace(0.01, 0.2, n)]  # some above the clip


def _clipped(u: np.ndarray, c: float) -> np.ndarray:
    return u * min(1.0, c / float(np.linalg.norm(u)))


def _sum(ddg: G.DDG, us: list[np.ndarray], rotation: int) -> np.ndarray:
    total = np.zeros(ddg.rotated, dtype=np.uint64)
    for i, u in enumerate(us):
        total += ddg.encode(u, rotation, np.random.default_rng(100 + i), np.random.default_rng(i))
    return ddg.decode(total & np.uint64(ddg.modulus - 1), rotation)


def test_without_noise_the_decoded_sum_is_the_clipped_sum_within_the_rounding_bound() -> None:
    """Each client's rounding moves each rotated coordinate by less than γ, so ‖error‖₂ of
    n clients is below n·γ·√D (rotations keep norms), whatever the wrap-around of the mod."""
    n, d, c = 6, 1000, 1.0
    ddg = G.plan(c, 0.0, 2**12, d, n, n)
    us = _updates(n, d)
    got = _sum(ddg, us, 7)
    want = sum(_clipped(u, c) for u in us)
    err = float(np.linalg.norm(got - want))
    assert 0 < err < n * ddg.gamma * math.sqrt(ddg.rotated)
    assert ddg.gamma > 1e-4  # a 12-bit modulus: a coarse grid, so the bound is not vacuous


def test_the_decoded_noise_has_the_sum_of_the_clients_variances() -> None:
    n, d, c, sigma = 6, 4096, 1.0, 0.05
    ddg = G.plan(c, sigma, 2**32, d, n, n)
    us = _updates(n, d)
    noise = _sum(ddg, us, 8) - sum(_clipped(u, c) for u in us)
    want = math.sqrt(n * (sigma**2 + ddg.gamma**2 / 4))
    assert float(noise.std()) == pytest.approx(want, rel=4 / math.sqrt(2 * d))
    assert abs(float(noise.mean())) < 4 * want / math.sqrt(d)


def test_the_rounded_norm_stays_within_the_papers_bound() -> None:
    ddg = G.plan(1.0, 0.0, 2**12, 500, 3, 3)
    u = _clipped(np.random.default_rng(5).normal(size=500), 1.0)
    y = ddg.encode(u, 1, np.random.default_rng(0), np.random.default_rng(0)).astype(np.int64)
    y[y >= ddg.modulus // 2] -= ddg.modulus
    assert float(np.linalg.norm(y)) <= ddg.norm_bound
    c, big_d = 1.0 / ddg.gamma, 512
    tight = math.sqrt(c**2 + big_d / 4 + math.sqrt(2 * 0.5) * (c + math.sqrt(big_d) / 2))
    assert ddg.norm_bound == pytest.approx(min(c + math.sqrt(big_d), tight))


def test_the_modular_clipping_condition_and_the_grid_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"privacy\.secagg\.gamma.*wrap around"):
        G.plan(1.0, 0.1, 2**32, 10_000, 20, 300, gamma=1e-12)
    with pytest.raises(ConfigError, match=r"privacy\.secagg\.modulus_range.*too coarse"):
        G.plan(1.0, 0.1, 2**8, 1_000_000, 20, 300)
    with pytest.raises(ConfigError, match=r"modulus_range.*any grid step"):
        G.plan(1.0, 0.1, 2**4, 100, 20, 300)
    ddg = G.plan(1.0, 0.1, 2**32, 10_000, 20, 300)
    assert ddg.span() == pytest.approx(ddg.modulus, rel=1e-9)  # the smallest γ that fits


def test_theorem_1_by_hand() -> None:
    """ρ = ½(Δ₂/(√n·σ) + τ√D)² with Δ₂ and τ written out, at a grid coarse enough for τ."""
    ddg = G.DDG(clip=1.0, sigma=0.3, gamma=0.25, beta=math.exp(-0.5), modulus=2**32, dim=60,
                least=5, most=9)  # fmt: skip
    big_d, g, c = 64, 0.25, 1.0
    d2 = min((c + g * 8) ** 2, c**2 + g**2 * big_d / 4 + 1.0 * g * (c + g * 8 / 2))
    tau = 10 * sum(math.exp(-2 * math.pi**2 * (0.3 / 0.25) ** 2 * k / (k + 1)) for k in range(1, 9))
    assert ddg.sensitivity == pytest.approx(math.sqrt(d2), rel=1e-12)
    assert ddg.tau() == pytest.approx(tau, rel=1e-12) and tau > 1e-12
    rho = 0.5 * (math.sqrt(d2) / (math.sqrt(5) * 0.3) + tau * 8) ** 2
    assert ddg.zcdp() == pytest.approx(rho, rel=1e-12)
    assert ddg.multiplier() == pytest.approx(1 / math.sqrt(2 * rho), rel=1e-12)


# ----------------------------------------------------------------------------- in SecAgg+

UPDATE = MessageKind("train", down_arrays=("params",), up_arrays=("params",), up_meta=("loss",))
CIDS = [str(i) for i in range(7)]
BASE = {"a": torch.zeros(30, 4), "b": torch.ones(50)}
CFG = SecAggConfig(num_shares=5, reconstruction_threshold=3, modulus_range=2**20)


class Plan:
    """A client's noise plan with a fixed DDG (as UserDP.ddg_plan gives)."""

    noise = "seeded"

    def __init__(self, ddg: G.DDG) -> None:
        self.ddg = ddg

    def ddg_plan(self, dim: int) -> G.DDG:
        assert dim == self.ddg.dim
        return self.ddg


class DDGClients:
    """Seven DP clients under SecAgg+ with DDG encoding; ``drop``: client -> kind it dies at."""

    def __init__(self, drop: dict[str, str], sigma: float) -> None:
        gen = torch.Generator().manual_seed(0)
        self.vectors = {
            c: {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in BASE.items()} for c in CIDS
        }
        self.kinds = secure_kinds({"train": UPDATE.as_private()}, {"train": "params"}, dp=True)
        self.ddg = G.plan(1.0, sigma, CFG.modulus_range, 170, 3, 7)
        self.sa = replace(resolve(CFG, 7, 7, weighted=False, ddg=True), ddg=self.ddg)
        client = ClientSecAgg(SecAgg(CFG, 0, 0, False), Plan(self.ddg))
        self.handlers = client.handlers({"train": self._train}, self.kinds)
        self.states = {c: ClientState() for c in CIDS}
        self.drop, self.gone = drop, set[str]()
        self.fed = FakeFederation(CIDS, self._reply, kinds=self.kinds.values(), seed=9)

    def _train(self, ctx: ClientContext, msg: Message) -> Message:
        sent = msg.arrays["params"]
        return Message("train", {"params": {k: sent[k] + self.vectors[ctx.cid][k] for k in sent}})

    def _reply(self, cid: str, msg: Message) -> Message:
        if cid in self.gone or self.drop.get(cid) == msg.kind:
            self.gone.add(cid)
            raise ConnectionError(f"client {cid} dropped at {msg.kind}")
        ctx = ClientContext(cid, "default", self.fed.rnd, 9, None, self.states[cid])  # type: ignore[arg-type]
        return dispatch(self.handlers, self.kinds, ctx, msg)

    def clipped_sum(self, cids: list[str]) -> np.ndarray:
        flat = [
            np.concatenate([self.vectors[c][k].double().flatten().numpy() for k in sorted(BASE)])
            for c in cids
        ]
        return sum(_clipped(u, 1.0) for u in flat)  # type: ignore[return-value]


def _flat(arrays: dict[str, Any]) -> np.ndarray:
    return np.concatenate([arrays[k].double().flatten().numpy() for k in sorted(arrays)])


@pytest.mark.parametrize("stage", ["none", KEYS, SHARES, "train", UNMASK])
def test_the_unmasked_ddg_sum_is_the_clipped_sum_within_the_bound(stage: str) -> None:
    """Noise off: the unmasked, decoded sum equals the plain sum of the clipped updates within
    n·γ·√D, with a client dropping at each stage (after sharing: unmasked from shares)."""
    cl = DDGClients({} if stage == "none" else {"3": stage}, sigma=0.0)
    got = secure_sum(cl.fed, cl.sa, {c: Message("train", {"params": BASE}) for c in CIDS}, BASE)
    summed = [c for c in CIDS if stage in ("none", UNMASK) or c != "3"]
    assert got.count == len(summed) and got.extra == 0.0
    assert got.dropped == (["3"] if stage == "train" else [])
    err = float(np.linalg.norm(_flat(got.total) - cl.clipped_sum(summed)))
    assert 0 < err < len(summed) * cl.ddg.gamma * math.sqrt(cl.ddg.rotated)


def test_the_unmasked_ddg_sum_carries_the_clients_noise() -> None:
    cl = DDGClients({}, sigma=0.02)
    got = secure_sum(cl.fed, cl.sa, {c: Message("train", {"params": BASE}) for c in CIDS}, BASE)
    noise = _flat(got.total) - cl.clipped_sum(CIDS)
    want = math.sqrt(7 * (0.02**2 + cl.ddg.gamma**2 / 4))
    # 170 coordinates of a rotated 256: the std within its sampling error
    assert float(noise.std()) == pytest.approx(want, rel=0.25)
