"""Client-level DP-FedAvg: each client's update clipped to norm C, Gaussian noise on the sum.

Papers:
    * McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private Recurrent Language
      Models", ICLR 2018 (DP-FedAvg; the fixed-denominator estimator).
    * Andrew, Thakkar, McMahan, Ramaswamy. "Differentially Private Learning with Adaptive
      Clipping", NeurIPS 2021 (the clipping bound follows a noised quantile).

One round (``N`` clients, rate ``q = clients.fraction``, ``m = q·N`` expected clients, ``z``
the noise multiplier, ``C_t`` this round's bound, ``M = min_clients``):

1. **Poisson sampling**: each client takes part independently with probability ``q``, the
   sampling the accountant assumes (so the number of clients varies from round to round).
2. **Clipping**: ``u_k = θ_k − θ`` over every aggregated tensor, ``ū_k = u_k·min(1, C_t/‖u_k‖₂)``.
3. **Noise on the sum**, divided by the expected count (McMahan et al.'s fixed denominator, so
   one client's presence changes the sum by at most ``C_t``):
   ``Δ = (Σ_k ū_k + ξ) / m``, ``ξ ~ N(0, (z_Δ·C_t)²·I)``.

   * ``mode: server`` (trusted server): the server clips every raw update and draws ``ξ``.
   * ``mode: client``: client ``k`` clips its own update and sends ``ū_k + ξ_k`` with
     ``ξ_k ~ N(0, (z_Δ·C_t)²/M·I)``; with at least ``M`` replies the shares add up to at least
     the variance of ``ξ``. A round with fewer replies leaves the model (and the bound) as
     they were. The noise scales with the ``C_t`` the client is told, so a server that lies
     about ``C_t`` cannot weaken it.
4. **Adaptive clipping** (``adaptive``): ``b_k = 1[‖u_k‖₂ ≤ C_t]``; the centred count
   ``b̃ = (Σ_k (b_k − ½) + N(0, σ_b²))/m + ½`` has sensitivity ½, and
   ``C_{t+1} = C_t·exp(−η_C·(b̃ − γ))``. Update and count together are one Gaussian of
   multiplier ``z`` when ``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)`` (Andrew et al., Sec. 3.1);
   client mode sends ``(b_k − ½) + N(0, σ_b²/M)`` as ``clip_bit``. Without ``adaptive``,
   ``z_Δ = z`` and ``C_t = clip``.
5. The server optimizer (:mod:`fedfm.core.optim`) applies ``Δ`` like any pseudo-gradient.

DP-FedAvg is a wrapper, as Flower's DP strategies and client mods wrap a strategy and a
client app: on the server it adds the bound to the update messages and takes over the
round's sum (:meth:`UserDP.configure`, :class:`DPSum`) inside the one aggregation step
(:func:`fedfm.core.aggregate.aggregate_round`); on a client :class:`ClientDP` privatises
what the algorithm's handler replies. No algorithm holds or reads it.

Accounting (dp-accounting, ``privacy.accountant``), relation: one client added or removed
with all its records. Each round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``; rounds
compose. Against whom:

* ``server`` mode: anyone who sees the global models and their updates; the server itself is
  trusted (it sees every raw update). The ledger holds the aggregate mechanism.
* ``client`` mode: the server sees each client's noisy update. Per round a client takes
  part in, that is a Gaussian of multiplier ``z/√M`` on that client's data, with no
  amplification by sampling (the server drew the sample): this is what the ledger composes,
  client by client. The aggregate's ε (what secure aggregation of the shares would give
  against the server) is reported beside it (``epsilon_secure_aggregation``).
* ``client`` mode under SecAgg+ (``privacy.secure_aggregation``, :mod:`fedfm.core.secagg`):
  the server sees only the sum of at least ``t ≥ M`` shares, so the ledger composes a
  Gaussian of multiplier ``z`` per participation (:meth:`UserDP.secure`).

``epsilon`` calibrates ``z`` for the aggregate after the run's ``rounds`` (dp-accounting's
``calibrate_dp_mechanism``); a given ``noise_multiplier`` is checked against it.

Choices of ours: clients weigh equally (the weights are public, McMahan et al.'s "uniform"
variant) whatever their sizes; Poisson sampling replaces fedfm's fixed-size sampling and
``clients.min_clients`` (a round may ask nobody); noise of server mode and the sample are
drawn from the server's own secret stream unless ``privacy.noise: seeded``. Flower 1.42's
server-side wrappers (``DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping``) divide by the
number of sampled clients and average with the wrapped strategy's example weights; with every
client in every round and equal weights both give noise std ``z·C/N`` on the mean
(``tests/test_userdp.py``). Flower's adaptive wrapper counts the *clipped* updates in its
norm bit yet applies Andrew et al.'s update for the unclipped share, and scales the noise by
the bound after updating it; here the bit and the order are Andrew et al.'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedfm.core import ddg as _ddg
from fedfm.core.aggregate import compute_dtype
from fedfm.core.federation import ClientContext, Federation, Handler
from fedfm.core.messages import Arrays, Message, MessageKind, MetaSpec
from fedfm.core.privacy import Mechanism as _Mechanism
from fedfm.core.privacy import PrivacyLedger, epsilon_of, quiet_accounting
from fedfm.core.replies import meta_number
from fedfm.core.robust import AggregatorConfig
from fedfm.core.secret import SecretStream, noise_seed
from fedfm.core.seeding import derive_seed
from fedfm.core.settings import RunView, UserLevelConfig
from fedfm.errors import ConfigError

log = logging.getLogger("fedfm")

FIELD = "privacy.user_level"
CLIP = "clip"  # the down meta field carrying this round's bound (client mode)
BIT = "clip_bit"  # the up meta field of a client's noisy count share (client mode, adaptive)
NOISE_CAP = 1e3  # calibration searches z in (0, NOISE_CAP]
#: Specs of the two meta fields an update kind carries under client-side DP-FedAvg.
UPDATE_META = {CLIP: MetaSpec("float", ge=0), BIT: MetaSpec("float")}


class Skipped(dict[str, Tensor]):
    """The result of a round whose update is not applied (too few clients for the noise)."""


def round_event(q: float, z: float, rounds: int = 1) -> Any:
    """``rounds`` rounds of DP-FedAvg as a dp-accounting event."""
    import dp_accounting

    one: Any = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        one = dp_accounting.PoissonSampledDpEvent(q, one)
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def aggregate_epsilon(q: float, z: float, rounds: int, delta: float, accountant: str) -> float:
    """Client-level ε of ``rounds`` rounds at rate ``q`` and multiplier ``z``."""
    if rounds == 0:
        return 0.0
    if z == 0:
        return math.inf
    mech = _Mechanism("dp-fedavg", "updates", "*", z, 1.0, q, rounds, "client")
    return epsilon_of([mech], delta, accountant)  # type: ignore[arg-type]


def calibrate_multiplier(
    epsilon: float, delta: float, q: float, rounds: int, accountant: str
) -> float:
    """The smallest ``z`` whose ``rounds`` rounds at rate ``q`` reach ``(epsilon, delta)``.

    Raises:
        ConfigError: No ``z`` up to :data:`NOISE_CAP` reaches it (``privacy.user_level.epsilon``).
    """
    from dp_accounting import mechanism_calibration as mc
    from dp_accounting import pld, rdp

    from fedfm.core.privacy import RDP_ORDERS

    def fresh() -> Any:
        return rdp.RdpAccountant(RDP_ORDERS) if accountant == "rdp" else pld.PLDAccountant()

    if aggregate_epsilon(q, NOISE_CAP, rounds, delta, accountant) > epsilon:
        raise ConfigError(
            f"{FIELD}.epsilon",
            f"epsilon={epsilon:g} at delta={delta:g} cannot be reached in {rounds} rounds at"
            f" client rate {q:g} with a noise multiplier up to {NOISE_CAP:g}",
        )
    with quiet_accounting():
        z = mc.calibrate_dp_mechanism(
            fresh,
            lambda z: round_event(q, z, rounds),
            epsilon,
            delta,
            mc.ExplicitBracketInterval(1e-3, NOISE_CAP),
        )
    return float(z)


def split_noise(z: float, count_stddev: float) -> float:
    """``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)``: the update noise once the count takes its share.

    As Flower's ``compute_adaptive_noise_params`` (Andrew et al. 2021, Sec. 3.1).

    Raises:
        ConfigError: ``z ≥ 2σ_b`` (``privacy.user_level.adaptive.count_stddev``).
    """
    if z == 0:
        return 0.0
    if z >= 2 * count_stddev:
        raise ConfigError(
            f"{FIELD}.adaptive.count_stddev",
            f"{count_stddev:g} must exceed noise_multiplier/2 = {z / 2:g}: the count's noise"
            " alone would spend more than the whole budget",
        )
    return float((z**-2 - (2 * count_stddev) ** -2) ** -0.5)


def _finite(x: float) -> float | None:
    """``x``, or None (JSON null) when it is infinite."""
    return x if math.isfinite(x) else None


def _cpu64(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.float64)


def clip_update(update: Mapping[str, Tensor], bound: float) -> tuple[Arrays, float]:
    """``u·min(1, C/‖u‖₂)`` in float64 (norm over every tensor) and ``‖u‖₂``.

    Tensors are taken in sorted name order, so the norm is the same to the last bit whatever
    the order of the mapping (a restored checkpoint, a message off the wire).
    """
    u = {k: _cpu64(update[k]) for k in sorted(update)}
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in u.values()))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in u.items()}, norm


def gaussian_like(arrays: Mapping[str, Tensor], std: float, gen: torch.Generator) -> Arrays:
    """``N(0, std²)`` float64 noise shaped as ``arrays``.

    Drawn in sorted name order: the same draws whatever the order of the mapping.
    """
    return {
        k: std * torch.randn(arrays[k].shape, generator=gen, dtype=torch.float64)
        for k in sorted(arrays)
    }


def standard_normal(gen: torch.Generator) -> float:
    """One ``N(0, 1)`` draw from ``gen`` (float64)."""
    return float(torch.randn(1, generator=gen, dtype=torch.float64))


class UserDP:
    """A run's client-level DP-FedAvg: calibration, sampling, clipping, noise, accounting.

    Built by every process of the run from the same config. It wraps the server step
    (:meth:`sample`, :meth:`configure` of the update messages, :meth:`accumulator`, called
    by :meth:`fedfm.algorithms.base.Algorithm.aggregate`) and, in client mode, the client's
    handlers (:class:`ClientDP`, calling :meth:`privatise`): the algorithms never mention it.

    Args:
        cfg: ``privacy.user_level``.
        run: The run config (rate, rounds, δ, accountant, noise source).
        num_clients: N.
        ledger: The run's privacy ledger.

    Raises:
        ConfigError: An unreachable ε, a noise multiplier that misses the asked ε, client
            mode without ``min_clients``, or a count noise too small for adaptive clipping.
    """

    def __init__(
        self, cfg: UserLevelConfig, run: RunView, num_clients: int, ledger: PrivacyLedger
    ) -> None:
        self.cfg = cfg
        self.run = run
        self.ledger = ledger
        self.num_clients = num_clients
        self.q = run.clients.fraction
        self.expected = self.q * num_clients  # m
        self.client_side = cfg.mode == "client"
        self.noise = run.privacy.noise
        delta, acc = run.privacy.delta, run.privacy.accountant
        self._check_min_clients()
        self.z = self._multiplier(delta, acc)
        self.count_stddev = 0.0
        self.z_update = self.z
        if cfg.adaptive is not None:
            sb = cfg.adaptive.count_stddev
            self.count_stddev = (sb if sb is not None else self.expected / 20) if self.z else 0.0
            self.z_update = split_noise(self.z, self.count_stddev)
        self.share = 1.0 / math.sqrt(cfg.min_clients) if self.client_side else 1.0  # type: ignore[arg-type]
        self.secure_threshold = 0  # SecAgg+'s t when the server sees only the sum (secure())
        self.ddg: _ddg.DDG | None = None  # the distributed discrete Gaussian (use_ddg())
        self.state: dict[str, Any] = {"clip": cfg.clip, "rounds": 0}
        self.last: dict[str, float] = {}
        self._noise_seed = 0  # of this round's server noise, drawn with the sample
        self._note()

    def secure(self, threshold: int) -> None:
        """The run sums the clients' noised updates under SecAgg+ with threshold ``t``.

        Against the server the ledger then holds the aggregate's Gaussian (multiplier ``z``)
        for each client's participation rather than each noisy update's (``z/√M``).

        Raises:
            ConfigError: ``t < min_clients``: a sum of fewer shares than the full noise could
                be unmasked (``privacy.secagg.reconstruction_threshold``).
        """
        m = int(self.cfg.min_clients or 0)
        if threshold < m:
            raise ConfigError(
                "privacy.secagg.reconstruction_threshold",
                f"{threshold} is below privacy.user_level.min_clients={m}: a sum of fewer noise"
                " shares than the full noise could be unmasked",
            )
        self.secure_threshold = threshold
        self._note()

    @property
    def wants_ddg(self) -> bool:
        """Client mode under SecAgg+ with the distributed discrete Gaussian as its noise."""
        p = self.run.privacy
        return (
            self.client_side
            and p.secure_aggregation == "secagg+"
            and p.secagg.dp_noise == "discrete_gaussian"
        )

    def ddg_plan(self, dim: int) -> _ddg.DDG:
        """The distributed discrete Gaussian for updates of ``dim`` coordinates.

        Each client's noise std is the continuous share's, ``z_Δ·C/√M``; every process of
        the run computes the same plan from the config.

        Raises:
            ConfigError: Adaptive clipping (the grid and the bound would move every round),
                or a modulus or ``γ`` that does not fit (:func:`fedfm.core.ddg.plan`).
        """
        if self.cfg.adaptive is not None:
            raise ConfigError(
                f"{FIELD}.adaptive",
                "the distributed discrete Gaussian (privacy.secagg.dp_noise) needs a fixed"
                " bound; use privacy.secagg.dp_noise=continuous or a fixed clip",
            )
        sa = self.run.privacy.secagg
        clip = float(self.cfg.clip)
        return _ddg.plan(
            clip, self.z_update * clip * self.share, sa.modulus_range, dim,
            int(self.cfg.min_clients or 1), self.num_clients, sa.gamma, sa.beta,
        )  # fmt: skip

    def use_ddg(self, ddg: _ddg.DDG) -> None:
        """The run's noise is ``ddg``: the ledger composes its zCDP bound from now on."""
        self.ddg = ddg
        self._note()

    # ----- checks and calibration -----
    def _check_min_clients(self) -> None:
        m = self.cfg.min_clients
        if self.client_side and m is None:
            raise ConfigError(
                f"{FIELD}.min_clients",
                "client-side noise needs a minimum number of clients per round (each client adds"
                " z·C/√min_clients of the noise)",
            )
        if m is not None and m > self.num_clients:
            raise ConfigError(
                f"{FIELD}.min_clients", f"{m} is more than the {self.num_clients} clients"
            )

    def _multiplier(self, delta: float, accountant: str) -> float:
        cfg, rounds = self.cfg, self.run.rounds
        if cfg.noise_multiplier is None and cfg.epsilon is None:
            raise ConfigError(FIELD, "set epsilon or noise_multiplier")
        if cfg.noise_multiplier is None:
            assert cfg.epsilon is not None
            return calibrate_multiplier(cfg.epsilon, delta, self.q, rounds, accountant)
        z = cfg.noise_multiplier
        if cfg.epsilon is not None:
            got = aggregate_epsilon(self.q, z, rounds, delta, accountant)
            if got > cfg.epsilon:
                raise ConfigError(
                    f"{FIELD}.noise_multiplier",
                    f"{z:g} gives epsilon={got:.4g} after {rounds} rounds at client rate"
                    f" {self.q:g}, above the asked epsilon={cfg.epsilon:g}",
                )
        return z

    # ----- server half -----
    @property
    def clip(self) -> float:
        """This round's bound ``C_t``."""
        return float(self.state["clip"])

    def _server_seed(self, fed: Federation, purpose: str) -> int:
        if self.noise == "seeded":
            return derive_seed(self.run.seed, fed.rnd, "user-dp", purpose)
        return SecretStream(self.state, "secret").draw(purpose)

    def sample(self, fed: Federation) -> list[str]:
        """This round's clients (Poisson at rate ``q``), registering the round's mechanisms."""
        pool = fed.client_ids()
        self._noise_seed = self._server_seed(fed, "noise")
        if self.q >= 1:
            cids = pool
        else:
            rng = np.random.default_rng(self._server_seed(fed, "sample"))
            cids = [c for c, u in zip(pool, rng.random(len(pool)), strict=True) if u < self.q]
        self._register(cids)
        return cids

    def _register(self, cids: list[str]) -> None:
        if self.wants_ddg and self.secure_threshold and self.ddg is None:
            raise RuntimeError("the distributed discrete Gaussian is not planned (use_ddg)")
        # Noise in units of C when the bound moves, so that every round merges into one entry.
        fixed = self.cfg.adaptive is None
        sens = self.clip if fixed else 1.0
        if not self.client_side:
            name = "updates" if fixed else "updates (adaptive bound)"
            self.ledger.add(
                _Mechanism("dp-fedavg", name, "*", self.z * sens, sens, self.q, 1, "client")
            )
            return
        if self.ddg is not None:  # Theorem 1's ρ as the Gaussian of the same Rényi curve
            agg, z_eff = self.ddg.sigma * math.sqrt(self.ddg.least), self.ddg.multiplier()
            for cid in cids:
                self.ledger.add(
                    _Mechanism(
                        _ddg.KIND, "sum seen by the server (SecAgg+, discrete Gaussian)", cid,
                        agg, agg / z_eff if z_eff else 1.0, 1.0, 1, "client",
                    )
                )  # fmt: skip
            return
        if self.secure_threshold:  # the server sees the sum of at least t ≥ M shares
            for cid in cids:
                self.ledger.add_gaussian(
                    cid, self.z * sens, sens, name="sum seen by the server (SecAgg+)",
                    relation="client",
                )  # fmt: skip
            return
        for cid in cids:  # every asked client released its share, answered or not
            self.ledger.add_gaussian(
                cid, self.z * self.share * sens, sens, name="update seen by the server",
                relation="client",
            )  # fmt: skip

    def down_meta(self) -> dict[str, float]:
        """What a ``train`` message carries for DP-FedAvg: the bound, in client mode."""
        return {CLIP: self.clip} if self.client_side else {}

    def accumulator(self, base: Mapping[str, Tensor]) -> DPSum:
        """This round's clipped, noised sum of updates ``θ_k − base``."""
        return DPSum(self, base)

    def configure(self, messages: Mapping[str, Message]) -> dict[str, Message]:
        """The update messages with :meth:`down_meta` added (as Flower's ``configure_fit``).

        A message sent to several clients stays one message (it is encoded once).
        """
        extra = self.down_meta()
        if not extra:
            return dict(messages)
        made: dict[int, Message] = {}
        for m in messages.values():
            if id(m) not in made:
                made[id(m)] = Message(m.kind, m.arrays, {**m.meta, **extra})
        return {c: made[id(m)] for c, m in messages.items()}

    def refuse_robust(self, aggregator: AggregatorConfig) -> None:
        """Refuses a robust rule: DP-FedAvg aggregates by its own clipped, noised sum.

        Raises:
            ConfigError: ``algo.aggregator`` is not the mean.
        """
        if not aggregator.plain:
            raise ConfigError(
                "algo.aggregator",
                "privacy.user_level aggregates by its own clipped, noised sum: leave the"
                " aggregator at the mean",
            )

    def end_round(self, total: Arrays, bits: float, count: int) -> Arrays:
        """Noise (server mode), the fixed denominator, the next bound; the round's metrics."""
        m = self.expected
        clip = self.clip
        skipped = self.client_side and count < int(self.cfg.min_clients or 0)
        gen = torch.Generator().manual_seed(self._noise_seed)
        if not self.client_side:
            noise = gaussian_like(total, self.z_update * clip, gen)
            total = {k: t + noise[k] for k, t in total.items()}
            if self.cfg.adaptive is not None:
                bits += self.count_stddev * standard_normal(gen)
        self.last = {"user_dp/clip": clip, "user_dp/skipped": float(skipped)}
        if not skipped and self.cfg.adaptive is not None:
            a = self.cfg.adaptive
            below = bits / m + 0.5  # b̃: the noised share of updates at most C_t
            self.state["clip"] = clip * math.exp(-a.lr * (below - a.target_quantile))
            self.last["user_dp/below_clip"] = below
        self.state["rounds"] = int(self.state["rounds"]) + 1
        self._note()
        if skipped:
            log.warning(
                "round skipped by DP-FedAvg: %d replies, fewer than min_clients=%d (the noise"
                " shares would not add up)",
                count,
                self.cfg.min_clients,
            )
            return Skipped()
        return {k: t / m for k, t in total.items()}

    def metrics(self) -> dict[str, float]:
        """The last round's figures and the client-level ε spent so far."""
        out = dict(self.last)
        out["user_dp/epsilon"] = self.ledger.epsilon()
        return out

    def _note(self) -> None:
        delta, acc = self.run.privacy.delta, self.run.privacy.accountant
        rounds = int(self.state["rounds"])
        note: dict[str, Any] = {
            "mode": self.cfg.mode,
            "relation": "add or remove one client with all its records",
            "adversary": (
                "the server: it sees each client's noisy update (no secure aggregation)"
                if self.client_side
                else "anyone who sees the global models; the server is trusted and sees every"
                " raw update"
            ),
            "sampling": f"Poisson, each client with probability q={self.q:g} per round",
            "noise_multiplier": self.z,
            "update_noise_multiplier": self.z_update,
            "count_stddev": self.count_stddev,
            "clip": self.clip,
            "rounds": rounds,
            "planned_rounds": self.run.rounds,
            "expected_clients": self.expected,
            "epsilon_one_round": aggregate_epsilon(self.q, self.z, 1, delta, acc),
            "epsilon_planned": aggregate_epsilon(self.q, self.z, self.run.rounds, delta, acc),
        }
        if self.client_side:
            note["min_clients"] = self.cfg.min_clients
            note["epsilon_secure_aggregation"] = aggregate_epsilon(
                self.q, self.z, rounds, delta, acc
            )
        if self.secure_threshold:
            note["adversary"] = (
                "an honest-but-curious server that sees only the sum of the noised updates"
                " (SecAgg+), colluding with fewer than the threshold of clients"
            )
            note["secure_aggregation"] = self._secure_note(rounds, delta, acc)
        self.ledger.notes["user_level"] = note

    def _secure_note(self, rounds: int, delta: float, acc: str) -> dict[str, Any]:
        """What distributed DP under SecAgg+ assumes, and its ε against the server."""
        m, t = int(self.cfg.min_clients or 0), self.secure_threshold
        # c clients that collude with the server take their own noise out of the sum.
        c = t - 1
        z, z_left = self.z, self.z * math.sqrt((m - c) / m) if m > c else 0.0
        if self.ddg is not None:  # Theorem 1's bound as a Gaussian's Rényi curve: RDP only
            z, acc = self.ddg.multiplier(), "rdp"
            z_left = self.ddg.multiplier(m - c) if m > c else 0.0
        note = {
            "protocol": "SecAgg+ (Bell et al. 2020)",
            "threshold": t,
            "assumptions": (
                f"honest-but-curious server; fewer than t={t} clients collude with it; at"
                f" least min_clients={m} noise shares in every unmasked sum (t ≥ min_clients)"
            ),
            "epsilon_server_every_round": _finite(aggregate_epsilon(1.0, z, rounds, delta, acc)),
            "epsilon_server_note": (
                "the ledger's run ε composes, per client, the rounds it took part in: the"
                " server drew the sample, so no amplification by sampling against it"
            ),
            "epsilon_if_sample_hidden": (
                None  # amplification by sampling is proven for the Gaussian, not zCDP
                if self.ddg is not None
                else _finite(aggregate_epsilon(self.q, z, rounds, delta, acc))
            ),
            "epsilon_every_round_with_colluders": _finite(
                aggregate_epsilon(1.0, z_left, rounds, delta, acc)
            ),
            "colluders": c,
        }
        if self.ddg is not None:
            note["quantisation"] = (
                "distributed discrete Gaussian: each client clips, rotates, scales by 1/γ,"
                " rounds conditionally and adds discrete Gaussian noise on the integer grid"
                " before masking; ε is Theorem 1's zCDP bound for what is sent (RDP accountant)"
            )
            note["discrete_gaussian"] = self.ddg.note()
        else:
            note["quantisation"] = (
                "privacy.secagg.dp_noise=continuous: each client adds its continuous Gaussian"
                " share, then clips to ±clipping_range and rounds stochastically before"
                " masking; ε is that of the continuous sum, which does not strictly cover the"
                " rounding"
            )
        return note

    def state_dict(self) -> dict[str, Any]:
        """Bound, rounds and the server's secret stream, for the checkpoint."""
        return {"state": dict(self.state), "last": dict(self.last)}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        self.state = dict(saved["state"])
        self.last = dict(saved.get("last", {}))
        self._note()

    # ----- client half -----
    def privatise(
        self, ctx: ClientContext, update: Mapping[str, Tensor], msg: Message
    ) -> tuple[Arrays, dict[str, float]]:
        """Client mode: this client's update clipped and noised with its share of the noise.

        Args:
            ctx: The client's context (its secret stream draws the noise).
            update: ``u_k`` (``θ_k − θ``, or a difference the client computed).
            msg: The server's message, carrying this round's bound ``clip``.

        Returns:
            ``ū_k + ξ_k`` in each tensor's dtype, and the meta fields to send (the noisy count
            share ``clip_bit`` when adaptive).
        """
        clip = meta_number(msg, CLIP)
        clipped, norm = clip_update(update, clip)
        gen = torch.Generator().manual_seed(noise_seed(ctx, "user-dp", self.noise))
        noise = gaussian_like(clipped, self.z_update * clip * self.share, gen)
        out = {k: (t + noise[k]).to(update[k].dtype) for k, t in clipped.items()}
        meta: dict[str, float] = {}
        if self.cfg.adaptive is not None:
            bit = (1.0 if norm <= clip else 0.0) - 0.5
            bit += self.count_stddev * self.share * standard_normal(gen)
            meta[BIT] = bit
        return out, meta

    def privatise_params(
        self, ctx: ClientContext, sent: Mapping[str, Tensor], trained: Mapping[str, Tensor],
        msg: Message,
    ) -> tuple[Arrays, dict[str, float]]:  # fmt: skip
        """:meth:`privatise` of ``trained − sent``, returned as parameters ``sent + ū + ξ``."""
        update = {k: _cpu64(trained[k]) - _cpu64(sent[k]) for k in sent}
        noisy, meta = self.privatise(ctx, update, msg)
        return {k: (_cpu64(sent[k]) + noisy[k]).to(sent[k].dtype) for k in sent}, meta


class DPSum:
    """One round's sum of clipped updates ``θ_k − base`` (an :class:`Aggregator`).

    Server mode clips each raw update and counts it against the bound; client mode sums
    what the clients clipped and noised. :meth:`result` is ``Δ`` (or :class:`Skipped`).
    """

    def __init__(self, dp: UserDP, base: Mapping[str, Tensor]) -> None:
        self.dp = dp
        self.base = base
        self.total = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in base.items()}
        self.bits = 0.0
        self.count = 0

    def add(self, update: Mapping[str, Tensor], weight: float = 1.0) -> None:
        """Adds one client's ``θ_k``; the weight is ignored (every client counts once)."""
        u = {k: _cpu64(update[k]) - _cpu64(b) for k, b in self.base.items()}
        if not self.dp.client_side:
            clipped, norm = clip_update(u, self.dp.clip)
            u = clipped
            self.bits += (1.0 if norm <= self.dp.clip else 0.0) - 0.5
        for k, t in u.items():
            self.total[k] += t
        self.count += 1

    def add_sum(self, total: Mapping[str, Tensor], bits: float, count: int) -> None:
        """Adds the sum of ``count`` clients' noised updates and count shares (SecAgg+)."""
        for k, t in total.items():
            self.total[k] += _cpu64(t)
        self.bits += bits
        self.count += count

    def fold(self, reply: Message, field: str) -> None:
        """Adds a reply's tensors of ``field`` and, in client mode, its count share."""
        self.add(reply.arrays[field])
        if self.dp.client_side and BIT in reply.meta:
            self.bits += meta_number(reply, BIT)

    def result(self) -> Arrays:
        """``Δ = (Σ ū_k + ξ)/m`` in each tensor's compute dtype, or :class:`Skipped`."""
        delta = self.dp.end_round(self.total, self.bits, self.count)
        if isinstance(delta, Skipped):
            return delta
        return {k: delta[k].to(compute_dtype(k, b)) for k, b in self.base.items()}

    def close(self) -> Arrays | None:
        """:meth:`result`, or None for a round skipped (a :class:`RoundSum`)."""
        delta = self.result()
        return None if isinstance(delta, Skipped) else delta


# ----------------------------------------------------------------------------- the wrappers


class ClientDP:
    """Client-side DP-FedAvg around an algorithm's handlers (as Flower's clipping mod).

    The algorithm's handler trains and replies as without DP; the reply of each update kind
    then leaves with only its update clipped and noised and the noisy count share.

    The update kinds are those this run declares private (:meth:`MessageKind.as_private`).
    A kind whose update field the server also sent (parameters) is privatised as ``trained
    − sent`` and sent back as parameters (:meth:`UserDP.privatise_params`); another (a
    difference the client computed, SCAFFOLD's ``Δy``) as it is (:meth:`UserDP.privatise`).

    Args:
        dp: The run's DP-FedAvg as the client builds it (its noise share).
    """

    def __init__(self, dp: UserDP) -> None:
        self.dp = dp

    def handlers(
        self, inner: Mapping[str, Handler], kinds: Mapping[str, MessageKind]
    ) -> dict[str, Handler]:
        """``inner`` with each private kind's handler wrapped."""
        out = dict(inner)
        for name, kind in kinds.items():
            if kind.private and name in inner:
                out[name] = self._wrap(inner[name], kind)
        return out

    def _wrap(self, inner: Handler, kind: MessageKind) -> Handler:
        def handle(ctx: ClientContext, msg: Message) -> Message:
            return self.reply(ctx, msg, inner(ctx, msg), kind)

        return handle

    def reply(self, ctx: ClientContext, msg: Message, reply: Message, kind: MessageKind) -> Message:
        """What leaves the client of ``reply``: its update privatised, its public fields."""
        # Under SecAgg+ the kind's one up field is the masked vector; the update is its field.
        fields = (kind.secure_field,) if kind.secure_field else kind.up_arrays
        arrays: dict[str, Arrays] = {}
        meta: dict[str, Any] = {k: v for k, v in reply.meta.items() if k in kind.public_fields}
        for name in fields:
            sent = msg.arrays.get(name)
            if sent is not None:
                arrays[name], noise_meta = self.dp.privatise_params(
                    ctx, sent, reply.arrays[name], msg
                )
            else:
                arrays[name], noise_meta = self.dp.privatise(ctx, reply.arrays[name], msg)
            meta.update(noise_meta)
        return Message(reply.kind, arrays, meta)
