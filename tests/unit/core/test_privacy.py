"""The privacy ledger: epsilons pinned against Opacus's and dp-accounting's own accountants."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from opacus.accountants import RDPAccountant
from scipy.stats import norm

from fedfm.core.privacy import RDP_ORDERS, PrivacyLedger, analytic_gaussian_sigma
from fedfm.errors import ConfigError

DELTA = 1e-5


def test_dp_sgd_epsilon_equals_opacus_rdp_accountant() -> None:
    ledger = PrivacyLedger(DELTA)
    for _ in range(4):  # four rounds of 250 steps merge into one mechanism of 1000 steps
        ledger.add_dp_sgd("3", noise_multiplier=1.1, sample_rate=0.01, steps=250)
    assert len(ledger) == 1 and ledger.mechanisms[0].count == 1000
    opacus = RDPAccountant()
    opacus.history = [(1.1, 0.01, 1000)]
    assert ledger.epsilon("3") == pytest.approx(opacus.get_epsilon(delta=DELTA), abs=1e-6)
    assert ledger.epsilon("3") == pytest.approx(1.711770, abs=1e-5)  # pinned
    assert ledger.epsilon() == ledger.epsilon("3")
    # The clipping norm scales the noise and the sensitivity alike: same epsilon.
    other = PrivacyLedger(DELTA)
    other.add_dp_sgd_report(
        "3", {"noise_multiplier": 1.1, "sample_rate": 0.01, "steps": 1000, "max_grad_norm": 0.5}
    )
    assert other.epsilon() == pytest.approx(ledger.epsilon(), abs=1e-12)


def test_gaussian_epsilons_equal_dp_accountings_own_rdp_and_pld() -> None:
    for accountant, fresh in (
        ("rdp", lambda: rdp.RdpAccountant(RDP_ORDERS)),
        ("pld", pld.PLDAccountant),
    ):
        ledger = PrivacyLedger(DELTA, accountant)
        ledger.add_gaussian("0", sigma=6.0, sensitivity=2.0, count=3, name="votes")
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 3)
        expected = fresh().compose(event).get_epsilon(DELTA)
        assert ledger.epsilon("0") == pytest.approx(expected, abs=1e-6), accountant
    rdp_eps = PrivacyLedger(DELTA, "rdp")
    rdp_eps.add_gaussian("0", sigma=6.0, sensitivity=2.0, count=3)
    assert ledger.epsilon() < rdp_eps.epsilon()  # PLD is the tighter accountant


def test_analytic_gaussian_sigma_meets_the_balle_wang_condition() -> None:
    eps, delta, sens = 1.0, DELTA, 2.0
    sigma = analytic_gaussian_sigma(eps, delta, sens)
    # Balle & Wang (2018), Theorem 8: the Gaussian is (eps, delta)-DP iff
    # Phi(D/(2s) - eps*s/D) - e^eps * Phi(-D/(2s) - eps*s/D) <= delta.
    a, b = sens / (2 * sigma), eps * sigma / sens
    achieved = norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)
    assert achieved == pytest.approx(delta, rel=1e-3)
    assert sigma == pytest.approx(2 * 3.7306, rel=1e-4)  # pinned: 3.73 per unit sensitivity
    classical = sens * math.sqrt(2 * math.log(1.25 / delta)) / eps
    assert sigma < classical
    ledger = PrivacyLedger(delta, "pld")
    ledger.add_gaussian(None, sigma, sens, name="counts", analytic=True)
    assert ledger.epsilon() == pytest.approx(eps, abs=1e-3)  # PLD recovers the calibration
    assert analytic_gaussian_sigma(eps, delta, sens, count=4) == pytest.approx(2 * sigma)
    with pytest.raises(ConfigError, match=r"privacy\.epsilon"):
        analytic_gaussian_sigma(0.0, delta)
    with pytest.raises(ConfigError, match=r"privacy\.delta"):
        analytic_gaussian_sigma(1.0, 1.0)


def test_composition_per_client_and_for_the_run() -> None:
    ledger = PrivacyLedger(DELTA)
    ledger.add_dp_sgd("0", 1.0, 0.05, 200)
    ledger.add_dp_sgd("1", 2.0, 0.05, 200)
    ledger.add_gaussian("0", sigma=5.0, sensitivity=1.0, name="counts", analytic=True)
    ledger.add_gaussian("1", sigma=5.0, sensitivity=1.0, name="counts", analytic=True)
    ledger.add_gaussian(None, sigma=8.0, sensitivity=1.0, name="votes")  # every client's data
    events = {
        "0": [(1.0, 0.05, 200), (5.0, 1.0, 1), (8.0, 1.0, 1)],
        "1": [(2.0, 0.05, 200), (5.0, 1.0, 1), (8.0, 1.0, 1)],
    }
    for cid, parts in events.items():
        composed = dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s))
                    if q < 1
                    else dp_accounting.GaussianDpEvent(s),
                    k,
                )
                for s, q, k in parts
            ]
        )
        expected = rdp.RdpAccountant(RDP_ORDERS).compose(composed).get_epsilon(DELTA)
        assert ledger.epsilon(cid) == pytest.approx(expected, abs=1e-6)
    assert ledger.clients() == ["0", "1"]
    assert ledger.epsilon() == ledger.epsilon("0") > ledger.epsilon("1")  # the worst client
    report = json.loads(json.dumps(ledger.report()))
    assert report["run"] == {"epsilon": ledger.epsilon(), "worst_client": "0"}
    assert set(report["clients"]["1"]["mechanisms"]) == {
        "dp-sgd:train",
        "analytic-gaussian:counts",
        "gaussian:votes",
    }
    assert report["clients"]["0"]["mechanisms"]["dp-sgd:train"] < ledger.epsilon("0")
    assert report["mechanisms"]["dp-sgd:train"]["epsilon_max"] == pytest.approx(
        report["clients"]["0"]["mechanisms"]["dp-sgd:train"]
    )
    # The state survives a checkpoint.
    again = PrivacyLedger(DELTA)
    again.load_state(json.loads(json.dumps(ledger.state())))
    assert again.report() == ledger.report()


def test_edge_cases_and_bad_input() -> None:
    ledger = PrivacyLedger(DELTA)
    assert ledger.epsilon() == 0.0 and ledger.clients() == [] and len(ledger) == 0
    ledger.add_gaussian(None, 4.0, 1.0)
    assert ledger.clients() == ["*"] and ledger.epsilon() == ledger.epsilon("7") > 0
    ledger.add_dp_sgd("2", noise_multiplier=0.0, sample_rate=0.1, steps=5)  # epsilon = inf
    assert ledger.epsilon("2") == math.inf and ledger.epsilon() == math.inf
    with pytest.raises(ConfigError, match=r"privacy\.delta"):
        PrivacyLedger(1.5)
    with pytest.raises(ConfigError, match=r"privacy\.accountant"):
        PrivacyLedger(DELTA, "moments")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"privacy\.sampling_rate"):
        ledger.add_dp_sgd("0", 1.0, 1.5, 10)
    with pytest.raises(ConfigError, match=r"privacy\.sigma"):
        ledger.add_gaussian("0", -1.0, 1.0)
