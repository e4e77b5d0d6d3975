"""The privacy ledger of a run: every DP mechanism, composed per client (DESIGN.md principle 7).

An algorithm registers each DP mechanism it runs in ``self.privacy`` (a :class:`PrivacyLedger`
that every :class:`~fedfm.algorithms.base.Algorithm` has); the engine checkpoints the ledger
with the run, writes ``privacy.json`` into the run folder and shows the run's ε in the summary
(``fedfm report`` shows it too).

Mechanisms (each with its parameters, on the data of one client or of every client):

* ``dp-sgd``: ``steps`` steps of the Poisson-subsampled Gaussian mechanism at rate ``q`` with
  noise multiplier ``σ`` (noise std ``σ·C`` for clipping norm ``C``); see :mod:`fedfm.core.dp`.
* ``gaussian``: Gaussian noise of std ``σ`` on a query of L2 sensitivity ``Δ`` (counts, votes,
  centroids), ``count`` times.
* ``analytic-gaussian``: the same mechanism with ``σ`` from the analytic Gaussian calibration
  (Balle & Wang, "Improving the Gaussian Mechanism for Differential Privacy", ICML 2018; see
  :func:`analytic_gaussian_sigma`), listed under its own kind so reports say how ``σ`` was
  chosen; it is accounted exactly like ``gaussian``.
* ``dp-fedavg``: one round of client-level DP-FedAvg (:mod:`fedfm.core.userdp`): clients
  Poisson-sampled at rate ``q``, Gaussian noise of multiplier ``σ / Δ`` on the sum of their
  clipped updates, ``count`` rounds.
* ``ddg``: the distributed discrete Gaussian's sum under SecAgg+ (:mod:`fedfm.core.ddg`):
  ``ρ``-zCDP, registered as the Gaussian of multiplier ``σ / Δ = 1/√(2ρ)`` with the same
  Rényi curve (``σ`` the sum's noise std, ``Δ`` the rounded sensitivity inflated by the
  ``τ`` term). A composition that holds one is always accounted by RDP, whatever
  ``privacy.accountant`` says: zCDP bounds the Rényi divergences, not the whole privacy
  profile a PLD accountant would read off a Gaussian.

Neighbouring relation. Every guarantee is for add/remove: ``example`` mechanisms (DP-SGD,
counts, votes, centroids) for one record added to or removed from one client's data, their
sensitivities computed for that change; ``client`` mechanisms (DP-FedAvg) for one client
added or removed with all its records. A client-level guarantee implies the example-level one
(one record changes one client), so the per-client composition below is an example-level
bound; ``privacy.json`` names the relation of each mechanism and of the run.

Whose data. A mechanism registered for a client touches that client's records only (its DP-SGD,
its noisy count vector); one registered with ``client=None`` touches every client's records
(e.g. noise the server adds to a sum of votes).

Composition. For each client, every mechanism that touched its records composes, and its ε is
reported at the run's δ (``privacy.delta``). Each record lives on one client, and mechanisms of
different clients see disjoint records, so the run's guarantee for any one record is its
client's: the run's ε is the largest client ε (parallel composition).

Accountants (dp-accounting 0.6; ``privacy.accountant``):

* ``rdp`` (default): Rényi DP (Mironov 2017) at Opacus's orders (1.1 to 10.9 in steps of 0.1,
  then 12 to 63), so a client's DP-SGD ε equals Opacus's ``RDPAccountant``'s; fast for long
  runs. RDP's conversion to (ε, δ) is loose for a single Gaussian: an analytic Gaussian
  calibrated for ε = 1 reports more than 1 here.
* ``pld``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
  tighter (a single analytic Gaussian reports the ε it was calibrated for), slower for many
  DP-SGD steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from fedfm.errors import ConfigError

Accountant = Literal["rdp", "pld"]
Relation = Literal["example", "client"]
KINDS = ("dp-sgd", "gaussian", "analytic-gaussian", "dp-fedavg", "ddg")
ALL = "*"  # the client field of mechanisms that touch every client's records
RELATIONS: dict[str, str] = {
    "example": "add or remove one record at one client",
    "client": "add or remove one client with all its records",
}

# Opacus's RDPAccountant.DEFAULT_ALPHAS, so that DP-SGD epsilons agree with Opacus.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


@dataclass(frozen=True)
class Mechanism:
    """One DP mechanism as registered, with how often it ran.

    Attributes:
        kind: ``dp-sgd``, ``gaussian`` or ``analytic-gaussian``.
        name: What it protects, e.g. ``train``, ``counts``, ``votes``, ``centroids``.
        client: The client whose records it touches, ``"*"`` for every client.
        sigma: Noise standard deviation (DP-SGD: ``σ·C``).
        sensitivity: L2 sensitivity of the query (DP-SGD: the clipping norm ``C``).
        sampling_rate: Poisson sampling rate of each run (1: no sampling).
        count: How many times it ran (DP-SGD: steps).
        relation: The neighbouring relation its sensitivity is for (:data:`RELATIONS`).
    """

    kind: str
    name: str
    client: str
    sigma: float
    sensitivity: float
    sampling_rate: float = 1.0
    count: int = 1
    relation: str = "example"

    @property
    def noise_multiplier(self) -> float:
        """``sigma / sensitivity``: what the privacy of one run depends on."""
        return self.sigma / self.sensitivity

    def key(self) -> tuple[Any, ...]:
        """Everything but ``count``: runs with the same key are merged."""
        return (
            self.kind,
            self.name,
            self.client,
            self.sigma,
            self.sensitivity,
            self.sampling_rate,
            self.relation,
        )

    def event(self) -> Any:
        """The dp-accounting event of all its runs."""
        import dp_accounting

        if self.sigma == 0:
            return dp_accounting.NonPrivateDpEvent()
        one = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_rate < 1:
            one = dp_accounting.PoissonSampledDpEvent(self.sampling_rate, one)
        return dp_accounting.SelfComposedDpEvent(one, self.count)


@contextlib.contextmanager
def quiet_accounting() -> Iterator[None]:
    """Silences dp-accounting's per-order warnings.

    An RDP order whose series does not converge is left out of the bound, which stays valid.
    """
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def epsilon_of(mechanisms: list[Mechanism], delta: float, accountant: Accountant = "rdp") -> float:
    """ε at ``delta`` of the composition of ``mechanisms`` (0 when there are none)."""
    import dp_accounting
    from dp_accounting import pld, rdp

    if not mechanisms:
        return 0.0
    if any(m.sigma == 0 for m in mechanisms):
        return math.inf
    event = dp_accounting.ComposedDpEvent([m.event() for m in mechanisms])
    if any(m.kind == "ddg" for m in mechanisms):
        accountant = "rdp"  # a zCDP bound: its Rényi curve, not a Gaussian's privacy profile
    acc = rdp.RdpAccountant(RDP_ORDERS) if accountant == "rdp" else pld.PLDAccountant()
    with quiet_accounting():
        return float(acc.compose(event).get_epsilon(delta))


def analytic_gaussian_sigma(
    epsilon: float, delta: float, sensitivity: float = 1.0, count: int = 1
) -> float:
    """The smallest noise std of a Gaussian mechanism that is ``(epsilon, delta)``-DP.

    The analytic Gaussian mechanism (Balle & Wang 2018): the exact privacy profile of the
    Gaussian, solved for ``σ`` by dp-accounting (``get_smallest_gaussian_noise``). ``count``
    runs of the query compose as one query of sensitivity ``Δ·sqrt(count)``. Unlike the
    classical ``σ = Δ·sqrt(2 ln(1.25/δ))/ε``, it holds for every ε > 0 and is smaller.

    Raises:
        ConfigError: A parameter is out of range (fields ``privacy.epsilon``,
            ``privacy.delta``, ``privacy.sensitivity``).
    """
    from dp_accounting.pld import accountant, common

    if not epsilon > 0 or not math.isfinite(epsilon):
        raise ConfigError("privacy.epsilon", f"must be positive and finite, got {epsilon}")
    if not 0 < delta < 1:
        raise ConfigError("privacy.delta", f"must lie in (0, 1), got {delta}")
    if not sensitivity > 0:
        raise ConfigError("privacy.sensitivity", f"must be positive, got {sensitivity}")
    params = common.DifferentialPrivacyParameters(epsilon, delta)
    return float(accountant.get_smallest_gaussian_noise(params, count, sensitivity))


class PrivacyLedger:
    """Every DP mechanism of a run, composed per client with dp-accounting.

    Args:
        delta: The run's δ, at which every ε is reported.
        accountant: ``rdp`` (default) or ``pld`` (see the module doc).
        noise: Where the noise came from (``secret`` or ``seeded``; see
            :mod:`fedfm.core.secret`); ``seeded`` puts a warning in every report.

    Attributes:
        notes: Extra sections of the report (e.g. ``user_level``: DP-FedAvg's parameters).
    """

    def __init__(
        self, delta: float = 1e-5, accountant: Accountant = "rdp", noise: str = "secret"
    ) -> None:
        if not 0 < delta < 1:
            raise ConfigError("privacy.delta", f"must lie in (0, 1), got {delta}")
        if accountant not in ("rdp", "pld"):
            raise ConfigError("privacy.accountant", f"must be rdp or pld, got {accountant!r}")
        self.delta = delta
        self.accountant: Accountant = accountant
        self.noise = noise
        self.notes: dict[str, Any] = {}
        self._mechanisms: list[Mechanism] = []
        self._cache: dict[tuple[Any, ...], float] = {}

    # ----- registering -----
    def add(self, mechanism: Mechanism) -> None:
        """Registers runs of a mechanism, merged with earlier runs of the same parameters."""
        if mechanism.kind not in KINDS:
            raise ConfigError("privacy.kind", f"unknown mechanism {mechanism.kind!r} ({KINDS})")
        if mechanism.sigma < 0 or mechanism.sensitivity <= 0 or mechanism.count < 0:
            raise ConfigError("privacy.sigma", f"invalid mechanism parameters {mechanism}")
        if not 0 < mechanism.sampling_rate <= 1:
            raise ConfigError("privacy.sampling_rate", f"must lie in (0, 1], got {mechanism}")
        if mechanism.relation not in RELATIONS:
            raise ConfigError("privacy.relation", f"unknown relation {mechanism.relation!r}")
        if mechanism.count == 0:
            return
        for i, old in enumerate(self._mechanisms):
            if old.key() == mechanism.key():
                self._mechanisms[i] = Mechanism(
                    **{**asdict(old), "count": old.count + mechanism.count}
                )
                return
        self._mechanisms.append(mechanism)

    def add_dp_sgd(
        self,
        client: str | None,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
        max_grad_norm: float = 1.0,
        name: str = "train",
    ) -> None:
        """Registers ``steps`` DP-SGD steps of a client (``σ``, ``q``, ``C``)."""
        self.add(
            Mechanism(
                "dp-sgd",
                name,
                _client(client),
                noise_multiplier * max_grad_norm,
                max_grad_norm,
                sample_rate,
                int(steps),
            )
        )

    def add_dp_sgd_report(
        self, client: str, report: Mapping[str, float], name: str = "train"
    ) -> None:
        """Registers a client's :meth:`fedfm.core.dp.DPResult.report` (sent as reply meta)."""
        self.add_dp_sgd(
            client,
            float(report["noise_multiplier"]),
            float(report["sample_rate"]),
            int(report["steps"]),
            float(report["max_grad_norm"]),
            name,
        )

    def add_gaussian(
        self,
        client: str | None,
        sigma: float,
        sensitivity: float,
        count: int = 1,
        name: str = "gaussian",
        analytic: bool = False,
        relation: Relation = "example",
    ) -> None:
        """Registers ``count`` runs of Gaussian noise of std ``sigma``.

        The query has L2 ``sensitivity``; ``analytic``: ``sigma`` came from
        :func:`analytic_gaussian_sigma`.

        Args:
            client: The client that adds the noise, or None for the server.
            sigma: Noise standard deviation.
            sensitivity: L2 sensitivity of the query.
            count: Runs of the mechanism.
            name: Name of the mechanism in reports.
            analytic: ``sigma`` was calibrated by the analytic Gaussian mechanism.
            relation: The neighbouring relation ``sensitivity`` is for.
        """
        kind = "analytic-gaussian" if analytic else "gaussian"
        self.add(
            Mechanism(
                kind,
                name,
                _client(client),
                float(sigma),
                float(sensitivity),
                1.0,
                count,
                relation,
            )
        )

    # ----- reading -----
    def __len__(self) -> int:
        return len(self._mechanisms)

    @property
    def mechanisms(self) -> list[Mechanism]:
        """Every registered mechanism, merged."""
        return list(self._mechanisms)

    def clients(self) -> list[str]:
        """Clients with a mechanism of their own; ``["*"]`` when all are server-wide."""
        named = sorted({m.client for m in self._mechanisms if m.client != ALL}, key=_natural)
        return named or ([ALL] if self._mechanisms else [])

    def of_client(self, client: str) -> list[Mechanism]:
        """The mechanisms that touched ``client``'s records (its own and server-wide ones)."""
        return [m for m in self._mechanisms if m.client in (client, ALL)]

    def epsilon(self, client: str | None = None) -> float:
        """ε at the run's δ of one client, or of the run (the worst client) when ``None``."""
        if client is not None:
            return self._epsilon(self.of_client(client))
        return max((self._epsilon(self.of_client(c)) for c in self.clients()), default=0.0)

    def _epsilon(self, mechanisms: list[Mechanism]) -> float:
        key = tuple(sorted((m.key(), m.count) for m in mechanisms))
        if key not in self._cache:
            self._cache[key] = epsilon_of(mechanisms, self.delta, self.accountant)
        return self._cache[key]

    def relation(self) -> str:
        """The relation the run's ε is for: ``client`` when every mechanism is client-level."""
        levels = {m.relation for m in self._mechanisms}
        return "client" if levels == {"client"} else "example"

    def statements(self) -> dict[str, str]:
        """What the run's ε means: its neighbouring relation and where the noise came from."""
        out = {"relation": RELATIONS[self.relation()]}
        if self.noise == "seeded":
            from fedfm.core.secret import SEEDED_WARNING

            out["warning"] = SEEDED_WARNING
        return out

    def report(self) -> dict[str, Any]:
        """The content of ``privacy.json``: ε per mechanism, per client and for the run."""
        clients: dict[str, Any] = {}
        for client in self.clients():
            mechanisms = self.of_client(client)
            clients[client] = {
                "epsilon": self._epsilon(mechanisms),
                "mechanisms": {f"{m.kind}:{m.name}": self._epsilon([m]) for m in mechanisms},
            }
        worst = max(clients, key=lambda c: clients[c]["epsilon"]) if clients else None
        by_mechanism: dict[str, float] = {}
        for m in self._mechanisms:
            label = f"{m.kind}:{m.name}"
            by_mechanism[label] = max(by_mechanism.get(label, 0.0), self._epsilon([m]))
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "noise": self.noise,
            **self.statements(),
            "relations": {f"{m.kind}:{m.name}": RELATIONS[m.relation] for m in self._mechanisms},
            "composition": "per client, every mechanism on its records; run = worst client",
            "run": {"epsilon": clients[worst]["epsilon"] if worst else 0.0, "worst_client": worst},
            "mechanisms": {k: {"epsilon_max": v} for k, v in by_mechanism.items()},
            "clients": clients,
            "entries": [asdict(m) for m in self._mechanisms],
            **self.notes,
        }

    def write(self, path: Path) -> None:
        """Writes :meth:`report` to ``path`` (``privacy.json``) atomically."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.report(), indent=1))
        tmp.replace(path)

    def summary(self) -> dict[str, Any]:
        """The run's ε, δ and accountant (for ``summary.json`` and the terminal)."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "accountant": self.accountant,
            "noise": self.noise,
            **self.statements(),
        }

    # ----- checkpointing -----
    def state(self) -> list[dict[str, Any]]:
        """JSON-able mechanisms, for a checkpoint."""
        return [asdict(m) for m in self._mechanisms]

    def load_state(self, state: list[dict[str, Any]]) -> None:
        """Replaces the mechanisms with those of :meth:`state`."""
        self._mechanisms = [Mechanism(**m) for m in state]


def _client(client: str | None) -> str:
    return ALL if client is None else str(client)


def _natural(cid: str) -> tuple[int, int | str]:
    """Numeric client ids in numeric order, others after them."""
    return (0, int(cid)) if cid.isdigit() else (1, cid)
