"""SecAgg+ in whole runs: embedded and on the Flower in-memory grid, refusals, the ledger."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedfm.config import load_config
from fedfm.runtime import run
from helpers.cli import run_cli
from helpers.config import toy_config
from helpers.grid import FakeGrid, flower_run

pytestmark = pytest.mark.usefixtures("task_identity")
SECAGG = {
    "secure_aggregation": "secagg+",
    "secagg": {"num_shares": 5, "reconstruction_threshold": 3},
}


def _cfg(tmp: Path, name: str, secure: bool, **kw: Any) -> dict[str, Any]:
    privacy = SECAGG if secure else {}
    return toy_config(
        tmp, name=name, **{"seed": 2, "num_clients": 6, "rounds": 2, "privacy": privacy, **kw}
    )


def _rows(folder: Path, log: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (folder / log).read_text().splitlines()]


def _final(folder: Path) -> torch.Tensor:
    """The global parameters of the last checkpoint, flat."""
    from safetensors.torch import load_file

    ck = sorted((folder / "checkpoints").glob("round_*"))[-1]
    arrays = load_file(ck / "server.safetensors")
    params = {k: v for k, v in arrays.items() if k.startswith("params/")}
    return torch.cat([params[k].double().flatten() for k in sorted(params)])


class DropGrid(FakeGrid):
    """A grid whose node ``drop`` stops answering fedfm messages from its ``at``-th of round 1
    (1: keys, 2: shares, 3: the masked update, 4: unmask)."""

    drop, at = 103, 3

    def pull_messages(self, ids: list[str]) -> list[Any]:
        from fedfm.runtime.flower import wire as W

        count = getattr(self, "count", 0)
        for m in self.pending:
            md = m.metadata
            mine = md.dst_node_id == self.drop and md.message_id in ids
            if mine and md.message_type == W.MESSAGE_TYPE and md.group_id == "1":
                count += 1
                self.count = count
                if count >= self.at:
                    self.dead = {self.drop - 100}
        return super().pull_messages(ids)


def test_embedded_and_flower_runs_sum_as_the_plain_run_within_the_bound(tmp_path: Path) -> None:
    plain = run(load_config(_cfg(tmp_path, "plain", False)), progress=False)
    del plain
    run(load_config(_cfg(tmp_path, "emb", True)), progress=False)
    flower_run(_cfg(tmp_path, "fl", True), tmp_path / "nodes")
    want = _final(tmp_path / "plain")
    # Δ = Σ r·u / Σ r with r = n_k/1000 ≈ 0.05: the sum's bound 6·16/(2²²−1) over Σ r ≈ 0.3,
    # twice over two rounds, and the second round starts from a moved model: 1e-3 is loose.
    for name in ("emb", "fl"):
        got = _final(tmp_path / name)
        assert 0 < float((got - want).abs().max()) < 1e-3, name
        ups = {
            (r["kind"], r["field"], r.get("secagg"))
            for r in _rows(tmp_path / name, "audit.jsonl")
            if r["direction"] == "up"
        }
        assert ups == {
            ("secagg.keys", "keys", "key material"),
            ("secagg.shares", "shares", "encrypted shares"),
            ("train", "masked", "masked vector"),
            ("secagg.unmask", "b", "key material"),
            ("secagg.unmask", "sk", "key material"),  # empty: nobody dropped
        }
    from fedfm.html_report import write_html

    html = write_html([tmp_path / "emb"], tmp_path / "report.html").read_text()
    assert "SecAgg+ bytes per stage" in html and "encrypted shares" in html
    assert "every field that crossed the wire is declared" in html


@pytest.mark.parametrize("at", [1, 2, 3, 4], ids=["keys", "shares", "masked", "unmask"])
def test_a_flower_node_dropping_at_each_stage_leaves_the_sum_exact(tmp_path: Path, at: int) -> None:
    """Node 3 dies at a stage of round 1; the round sums the others (and it, if it dies only
    while unmasking), as a plain run of those clients does, within the bound."""
    quick = {"timeout_s": 1}  # how long the server waits for the dead node
    flower_run(
        _cfg(tmp_path, "fl", True, rounds=1),
        tmp_path / "n1",
        grid_cls=type("Grid", (DropGrid,), {"at": at}),
        options=quick,
    )
    fails = _rows(tmp_path / "fl", "failures.jsonl")
    stage = {1: "secagg.keys", 2: "secagg.shares", 3: "train", 4: "secagg.unmask"}[at]
    assert [(f["client"], f["kind"]) for f in fails] == [("3", stage)]
    assert _rows(tmp_path / "fl", "metrics.jsonl")[-1]["clients"] == (6 if at == 4 else 5)
    # The plain run's reference: every client, or node 3 dead at its one message.
    grid = FakeGrid if at == 4 else type("Grid", (DropGrid,), {"at": 1})
    flower_run(
        _cfg(tmp_path, "plain", False, rounds=1), tmp_path / "n2", grid_cls=grid, options=quick
    )
    diff = float((_final(tmp_path / "fl") - _final(tmp_path / "plain")).abs().max())
    assert 0 < diff < 1e-3


@pytest.mark.parametrize(
    ("over", "field"),
    [
        (["privacy.secagg.reconstruction_threshold=11"], "privacy.secagg.reconstruction_threshold"),
        (["privacy.secagg.reconstruction_threshold=4"], "privacy.secagg.reconstruction_threshold"),
        (["privacy.secagg.modulus_range=1048576"], "privacy.secagg.modulus_range"),
        (  # the distributed discrete Gaussian's sum cannot fit 16 levels
            [
                "privacy.user_level.mode=client",
                "privacy.user_level.clip=1",
                "privacy.user_level.noise_multiplier=1",
                "privacy.user_level.min_clients=3",
                "privacy.secagg.modulus_range=16",
            ],
            "privacy.secagg.modulus_range",
        ),
        (  # a grid step so fine that the sum wraps around the modulus
            [
                "privacy.user_level.mode=client",
                "privacy.user_level.clip=1",
                "privacy.user_level.noise_multiplier=1",
                "privacy.user_level.min_clients=3",
                "privacy.secagg.gamma=1e-15",
            ],
            "privacy.secagg.gamma",
        ),
        (
            [
                "privacy.user_level.mode=client",
                "privacy.user_level.clip=1",
                "privacy.user_level.noise_multiplier=1",
                "privacy.user_level.min_clients=3",
                "privacy.user_level.adaptive.target_quantile=0.5",
            ],
            "privacy.user_level.adaptive",
        ),
        (["algorithm=scaffold"], "privacy.secure_aggregation"),
        (["algo.aggregator.name=median"], "algo.aggregator"),
        (["algo.update_cosines=true"], "algo.update_cosines"),
        (
            [
                "privacy.user_level.mode=server",
                "privacy.user_level.clip=1",
                "privacy.user_level.noise_multiplier=1",
            ],
            "privacy.secure_aggregation",
        ),
        (
            [
                "privacy.user_level.mode=client",
                "privacy.user_level.clip=1",
                "privacy.user_level.noise_multiplier=1",
                "privacy.user_level.min_clients=8",
                "privacy.secagg.reconstruction_threshold=6",
            ],
            "privacy.secagg.reconstruction_threshold",
        ),
    ],
)
def test_bad_secagg_input_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, over: list[str], field: str
) -> None:
    argv = [
        "run",
        "tabular-fedavg",
        f"out_dir={tmp_path}",
        "name=bad",
        "rounds=1",
        "privacy.secure_aggregation=secagg+",
        *over,
    ]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and field in err, err
    assert not (tmp_path / "bad").exists()


def test_tabular_dpfedavg_epsilon_under_secagg_is_recomputed(tmp_path: Path) -> None:
    """The preset's ε against the server under SecAgg+ with continuous noise shares,
    recomputed with dp-accounting: per client, a Gaussian of multiplier z (the sum's) for
    each round it took part in."""
    from fedfm.algorithms.base import ALGORITHMS
    from fedfm.core.fake import FakeFederation
    from fedfm.core.privacy import PrivacyLedger
    from fedfm.core.userdp import aggregate_epsilon
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    over = [
        f"out_dir={tmp_path}",
        "privacy.secure_aggregation=secagg+",
        "privacy.secagg.dp_noise=continuous",
    ]
    cfg = load_config("tabular-dpfedavg", over)
    algo_cfg, task_cfg = resolve(cfg)
    task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
    algo = ALGORITHMS.get(cfg.algorithm)(algo_cfg, task, cfg)
    dp, delta = algo.user_dp, 1e-4
    assert dp is not None and algo.secagg is not None
    assert algo.secagg.threshold == math.ceil(0.6 * 60) >= 20  # of 0.2·300 expected clients
    assert aggregate_epsilon(0.2, dp.z, 40, delta, "rdp") == pytest.approx(4.0, rel=1e-3)
    fed = FakeFederation([str(i) for i in range(300)], {})
    taken: dict[str, int] = {}
    for rnd in (1, 2, 3):
        fed.rnd = rnd
        for cid in dp.sample(fed):
            taken[cid] = taken.get(cid, 0) + 1
    ledger = PrivacyLedger(delta)
    for cid, k in taken.items():
        ledger.add_gaussian(cid, dp.z, 1.0, count=k, relation="client")
    assert algo.privacy.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-9)
    most = max(taken.values())
    assert ledger.epsilon() == pytest.approx(aggregate_epsilon(1.0, dp.z, most, delta, "rdp"))
    # Without SecAgg+ the server sees each noisy update: multiplier z/√20 per participation.
    bare = PrivacyLedger(delta)
    bare.add_gaussian("c", dp.z / math.sqrt(20), 1.0, count=most, relation="client")
    assert bare.epsilon() > 3 * ledger.epsilon()
    note = algo.privacy.notes["user_level"]["secure_aggregation"]
    assert note["threshold"] == 36 and "honest-but-curious" in note["assumptions"]


def test_tabular_dpfedavg_epsilon_under_the_discrete_gaussian_is_recomputed_by_hand(
    tmp_path: Path,
) -> None:
    """The preset's ε against the server under SecAgg+ with the distributed discrete Gaussian
    (the default noise), recomputed by hand: γ from the modular-clipping condition, Δ₂ and τ
    of Kairouz et al.'s Theorem 1, ρ-zCDP per participation, and the RDP → (ε, δ) conversion
    written out over the ledger's orders (no dp-accounting)."""
    from fedfm.algorithms.base import ALGORITHMS
    from fedfm.core.fake import FakeFederation
    from fedfm.core.privacy import RDP_ORDERS
    from fedfm.core.userdp import aggregate_epsilon
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    cfg = load_config(
        "tabular-dpfedavg", [f"out_dir={tmp_path}", "privacy.secure_aggregation=secagg+"]
    )
    algo_cfg, task_cfg = resolve(cfg)
    task = TASKS.get(task_cfg.kind)(task_cfg, cfg)
    algo = ALGORITHMS.get(cfg.algorithm)(algo_cfg, task, cfg)
    algo.bind_secure()
    dp, delta, n_max, m, c = algo.user_dp, 1e-4, 300, 20, 0.5
    assert dp is not None and dp.ddg is not None
    d = sum(t.numel() for t in algo.params.values())
    big_d = 1 << math.ceil(math.log2(d))
    sigma = dp.z * c / math.sqrt(m)
    # m_mod·γ = 2·8·√((300·c)²/D + 300·(γ²/4 + σ²)), solved for γ
    mod = 2**32
    gamma = math.sqrt(((n_max * c) ** 2 / big_d + n_max * sigma**2) / ((mod / 16) ** 2 - n_max / 4))
    assert dp.ddg.gamma == pytest.approx(gamma, rel=1e-9)
    d2 = min(
        (c + gamma * math.sqrt(big_d)) ** 2,
        c**2 + gamma**2 * big_d / 4 + gamma * (c + gamma * math.sqrt(big_d) / 2),  # √(2·½) = 1
    )
    s = (sigma / gamma) ** 2
    tau = 10 * sum(math.exp(-2 * math.pi**2 * s * k / (k + 1)) for k in range(1, n_max))
    rho = 0.5 * (math.sqrt(d2) / (math.sqrt(m) * sigma) + tau * math.sqrt(big_d)) ** 2
    fed = FakeFederation([str(i) for i in range(n_max)], {})
    taken: dict[str, int] = {}
    for rnd in (1, 2, 3):
        fed.rnd = rnd
        for cid in dp.sample(fed):
            taken[cid] = taken.get(cid, 0) + 1
    k = max(taken.values())

    def eps(a: float) -> float:  # RDP a·ρ·k → (ε, δ) (Canonne, Kamath & Steinke 2020, Prop. 12)
        return a * rho * k + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)

    by_hand = min(eps(a) for a in RDP_ORDERS)
    assert algo.privacy.epsilon() == pytest.approx(by_hand, rel=1e-6)
    assert by_hand <= rho * k + 2 * math.sqrt(rho * k * math.log(1 / delta))  # Bun & Steinke
    # Rounding costs a little: above the continuous sum's ε, within 1% of it.
    cont = aggregate_epsilon(1.0, dp.z, k, delta, "rdp")
    assert cont < by_hand < 1.01 * cont
    note = algo.privacy.notes["user_level"]["secure_aggregation"]
    assert note["discrete_gaussian"]["gamma"] == pytest.approx(gamma, rel=1e-9)
    assert "Theorem 1" in note["discrete_gaussian"]["theorem"]


def _server_tensors(folder: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    ck = sorted((folder / "checkpoints").glob("round_*"))[-1]
    arrays = load_file(ck / "server.safetensors")
    keep = sorted(k for k in arrays if k.split("/")[0] in ("params", "proxy"))
    return torch.cat([arrays[k].double().flatten() for k in keep])


@pytest.mark.parametrize("algorithm", ["fedprox", "fedekd", "fedsdr", "dp-fedavg"])
def test_every_sum_algorithm_runs_under_secagg_as_its_plain_run(
    tmp_path: Path, algorithm: str
) -> None:
    """FedProx, FedeKD's proxy, FedSDR's LoRA-R and client-side DP-FedAvg under SecAgg+ (the
    defaults: every client holds a share, t = 60% of them): only protocol fields leave the
    clients, and without DP noise the model equals the plain run's within the bound."""
    from helpers import flower as fs

    base = fs.algorithm_config(tmp_path / "plain", algorithm.replace("dp-", ""))
    assert base is not None
    base["rounds"] = 1  # later rounds train from models that differ within the bound
    if algorithm == "dp-fedavg":
        level = {"clip": 0.5, "noise_multiplier": 1.0, "mode": "client", "min_clients": 2}
        base["privacy"] = {"delta": 1e-3, "user_level": level}
    secure = json.loads(json.dumps(base))
    secure["out_dir"] = str(tmp_path / "secure")
    secure.setdefault("privacy", {})["secure_aggregation"] = "secagg+"
    run(load_config(secure), progress=False)
    folder = tmp_path / "secure" / base["name"]
    ups = [r for r in _rows(folder, "audit.jsonl") if r["direction"] == "up"]
    update = {"fedekd": "forward"}.get(algorithm.replace("dp-", ""), "train")
    assert {r["field"] for r in ups if r["kind"] == update} == {"masked"}
    assert {
        r.get("secagg") for r in ups if r["kind"].startswith("secagg") or r["kind"] == update
    } == {
        "key material",
        "encrypted shares",
        "masked vector",
    }
    if algorithm == "dp-fedavg":  # noised on the clients: no plain twin to compare with
        note = json.loads((folder / "privacy.json").read_text())["user_level"]
        assert note["secure_aggregation"]["threshold"] >= 2
        return
    run(load_config(base), progress=False)
    diff = _server_tensors(folder) - _server_tensors(tmp_path / "plain" / base["name"])
    assert 0 < float(diff.abs().max()) < 1e-3


def test_distributed_dp_runs_on_the_flower_grid(tmp_path: Path) -> None:
    """Client-side DP-FedAvg under SecAgg+ on Flower: only the masked, noised vector and the
    protocol's public key material leave the clients; the ledger names the threshold."""
    level = {"clip": 0.5, "noise_multiplier": 1.0, "mode": "client", "min_clients": 3}
    privacy = {**SECAGG, "delta": 1e-3, "user_level": level}
    cfg = _cfg(tmp_path, "dp", True, privacy=privacy)
    flower_run(cfg, tmp_path / "nodes")
    ups = {
        (r["kind"], r["field"], r.get("privacy"), r.get("secagg"))
        for r in _rows(tmp_path / "dp", "audit.jsonl")
        if r["direction"] == "up"
    }
    assert ("train", "masked", "dp", "masked vector") in ups
    assert {p for _, _, p, _ in ups} == {"dp", "public"}
    note = json.loads((tmp_path / "dp" / "privacy.json").read_text())["user_level"]
    assert note["secure_aggregation"]["threshold"] == 3
    assert "fewer than t=3 clients collude" in note["secure_aggregation"]["assumptions"]
