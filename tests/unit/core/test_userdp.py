"""Client-level DP-FedAvg: Flower's DP wrappers and dp-accounting as anchors, sensitivities by
hand for both neighbouring relations, and the refusals of bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedfm.config import load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.messages import Message
from fedfm.core.privacy import PrivacyLedger
from fedfm.core.userdp import DPSum, Skipped, UserDP, clip_update, split_noise
from fedfm.errors import ConfigError, MessageError, TooFewClientsError
from fedfm.runtime import run
from helpers import toy
from helpers.cli import run_cli
from helpers.config import make_config, toy_config

# Client-level DP-FedAvg on 40 toy clients, half sampled per round; ``_level`` changes the
# user-level section.
USERDP: dict[str, Any] = toy_config(
    "runs",
    name="dp",
    seed=5,
    num_clients=40,
    clients={"fraction": 0.5},
    privacy={"delta": 1e-3, "user_level": {"clip": 1.0, "epsilon": 4.0, "mode": "server"}},
)


def _level(**user: Any) -> dict[str, Any]:
    return {**USERDP["privacy"]["user_level"], **user}


def _user_dp(tmp: Path, n: int = 40, **user: Any) -> UserDP:
    cfg = load_config(make_config(USERDP, tmp, privacy__user_level=_level(**user)))
    assert cfg.privacy.user_level is not None
    return UserDP(cfg.privacy.user_level, cfg, n, PrivacyLedger(1e-3))


# ----------------------------------------------------------------------------- Flower's wrappers


def test_server_clipping_and_noise_scale_equal_flowers_fixed_clipping(tmp_path: Path) -> None:
    """Every client in every round, equal weights: Flower's and fedfm's formulas coincide."""
    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.supercore.differential_privacy import compute_clip_model_update, compute_stdv

    n, clip = 8, 0.3
    dp = _user_dp(tmp_path, n, clip=clip, noise_multiplier=1.3, epsilon=None)
    dp.q, dp.expected = 1.0, float(n)  # q = 1: every client, m = N
    flower = DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.3, clip, n)
    assert dp.z_update * clip / dp.expected == pytest.approx(
        compute_stdv(flower.noise_multiplier, flower.clipping_norm, flower.num_sampled_clients)
    )
    # The same clipped update as Flower's (FlatClip over every tensor).
    gen = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(5, generator=gen), "b": torch.randn(2, 3, generator=gen)}
    client = {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()}
    ours, norm = clip_update({k: client[k] - base[k] for k in base}, clip)
    theirs = [client[k].double().numpy() for k in base]
    compute_clip_model_update(theirs, [base[k].double().numpy() for k in base], clip)
    for k, t in zip(base, theirs, strict=True):
        np.testing.assert_allclose((ours[k] + base[k].double()).numpy(), t, rtol=1e-12)
    assert norm > clip  # it was clipped
    # The noise drawn has that scale: Δ of n unchanged clients is noise / m only.
    fed = FakeFederation([str(i) for i in range(n)], {})
    big = {"w": torch.zeros(200_000)}
    assert dp.sample(fed) == fed.client_ids()
    acc = dp.accumulator(big)
    for _ in range(n):
        acc.add(big, weight=123.0)  # example weights are ignored
    delta = acc.result()
    assert float(delta["w"].std()) == pytest.approx(1.3 * clip / n, rel=0.01)


def test_adaptive_noise_split_and_refusal_equal_flowers(tmp_path: Path) -> None:
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    for z, m in ((1.0, 100.0), (0.7, 40.0), (2.9, 60.0)):
        stddev, z_update = compute_adaptive_noise_params(z, m, None)
        assert stddev == m / 20
        assert split_noise(z, stddev) == pytest.approx(z_update, rel=1e-12)
    with pytest.raises(ValueError):
        compute_adaptive_noise_params(2.0, 20.0, None)  # 2σ_b = 2 ≤ z
    with pytest.raises(ConfigError, match=r"privacy\.user_level\.adaptive\.count_stddev"):
        split_noise(2.0, 1.0)
    dp = _user_dp(tmp_path, 40, noise_multiplier=1.0, epsilon=None, adaptive={})
    assert dp.count_stddev == 20 / 20  # m = q·N = 0.5·40 clients expected per round
    assert dp.z_update == pytest.approx(compute_adaptive_noise_params(1.0, 20.0, None)[1])


def test_adaptive_bound_follows_andrews_geometric_update(tmp_path: Path) -> None:
    """C ← C·exp(−η(b̃ − γ)), b̃ the (here noiseless) share of updates at most C."""
    dp = _user_dp(tmp_path, 4, clip=1.0, noise_multiplier=0.0, epsilon=None, adaptive={})
    dp.q, dp.expected = 1.0, 4.0
    fed = FakeFederation(["0", "1", "2", "3"], {})
    dp.sample(fed)
    acc = dp.accumulator({"w": torch.zeros(2)})
    for norm in (0.5, 0.9, 2.0, 3.0):  # two of four at most C = 1: the bound stays
        acc.add({"w": torch.tensor([norm, 0.0])})
    acc.result()
    assert dp.clip == pytest.approx(1.0 * math.exp(-0.2 * (2 / 4 - 0.5)))
    acc = dp.accumulator({"w": torch.zeros(2)})
    dp.sample(fed)
    for norm in (0.1, 0.2, 0.3, 5.0):  # three of four below: the bound shrinks
        acc.add({"w": torch.tensor([norm, 0.0])})
    acc.result()
    assert dp.clip == pytest.approx(math.exp(-0.2 * (3 / 4 - 0.5)))
    assert dp.last["user_dp/below_clip"] == pytest.approx(0.75)


# ----------------------------------------------------------------------------- accounting


def test_epsilon_of_a_run_is_recomputed_from_its_config_with_dp_accounting(tmp_path: Path) -> None:
    import dp_accounting
    from dp_accounting import rdp

    from fedfm.core.privacy import RDP_ORDERS

    run(load_config(make_config(USERDP, tmp_path)), progress=False)
    folder = tmp_path / "dp"
    cfg = load_config(str(folder / "config.yaml"))
    priv = json.loads((folder / "privacy.json").read_text())
    level = cfg.privacy.user_level
    assert level is not None and priv["relation"].startswith("add or remove one client")
    q, rounds, delta = cfg.clients.fraction, cfg.rounds, cfg.privacy.delta
    z = priv["user_level"]["noise_multiplier"]

    def eps(z: float, t: int) -> float:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t
        )
        return rdp.RdpAccountant(RDP_ORDERS).compose(event).get_epsilon(delta)

    assert priv["run"]["epsilon"] == pytest.approx(eps(z, rounds), rel=1e-9)
    assert eps(z, rounds) <= level.epsilon + 1e-6  # calibrated to reach the asked ε
    assert eps(0.99 * z, rounds) > level.epsilon  # and no more noise than needed
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["user_dp/epsilon"] for r in rows[1:]] == pytest.approx(
        [eps(z, t) for t in range(1, rounds + 1)], rel=1e-9
    )  # per round, as spent so far
    entry = next(e for e in priv["entries"] if e["kind"] == "dp-fedavg")
    assert (entry["sampling_rate"], entry["count"], entry["relation"]) == (q, rounds, "client")


def test_client_mode_accounts_each_noisy_update_the_server_sees(tmp_path: Path) -> None:
    """Against the server: per participation a Gaussian of multiplier z/√M, no sampling."""
    level = _level(mode="client", min_clients=4)
    cfg = make_config(USERDP, tmp_path, name="cl", privacy__user_level=level)
    run(load_config(cfg), progress=False)
    priv = json.loads((tmp_path / "cl" / "privacy.json").read_text())
    note = priv["user_level"]
    z = note["noise_multiplier"]
    audit = [json.loads(x) for x in (tmp_path / "cl" / "audit.jsonl").read_text().splitlines()]
    asked: dict[str, int] = {}
    for row in audit:
        if row["direction"] == "down" and row["field"] == "params":
            asked[row["client"]] = asked.get(row["client"], 0) + 1
    ledger = PrivacyLedger(1e-3)
    for cid, k in asked.items():
        ledger.add_gaussian(cid, z / 2.0, 1.0, count=k, relation="client")  # √M = 2
    assert priv["run"]["epsilon"] == pytest.approx(ledger.epsilon(), rel=1e-9)
    assert note["epsilon_secure_aggregation"] < priv["run"]["epsilon"]
    # Only the clipped, noised parameters left the clients, each marked a DP output.
    ups = [r for r in audit if r["direction"] == "up"]
    assert {(r["field"], r["privacy"]) for r in ups} == {("params", "dp")}


# ----------------------------------------------------------------------------- sensitivities


def test_example_level_sensitivities_by_hand() -> None:
    """One record added or removed at one client: counts move by 1, votes by at most 1."""
    from fedfm.algorithms.dpsyn_mechanisms import code_counts, knn_votes

    codes = torch.tensor([0, 1, 1, 2, 1])
    full, less = code_counts(codes, 3), code_counts(codes[:-1], 3)
    assert float((full - less).norm()) == 1.0
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    private, synth = unit(rng.normal(size=(6, 5))), unit(rng.normal(size=(9, 5)))
    pc, sc = np.array([0, 0, 1, 1, 0, 1]), np.array([0] * 5 + [1] * 4)
    for k in (1, 2, 4):
        change = knn_votes(private, pc, synth, sc, k) - knn_votes(private[1:], pc[1:], synth, sc, k)
        assert np.linalg.norm(change) == pytest.approx(1.0)  # K votes of 1/√K, norm 1
    few = knn_votes(private[:1], pc[:1], synth[:2], sc[:2], 4)  # fewer than K candidates
    assert np.linalg.norm(few) < 1.0


def test_client_level_sensitivities_by_hand(tmp_path: Path) -> None:
    """One client added or removed: the clipped sum moves by at most C, the centred count by ½."""
    dp = _user_dp(tmp_path, 3, clip=0.5, noise_multiplier=0.0, epsilon=None, adaptive={})
    base = {"w": torch.zeros(3), "v": torch.zeros(2)}
    gen = torch.Generator().manual_seed(3)
    ups = [{k: 4 * torch.randn(t.shape, generator=gen) for k, t in base.items()} for _ in range(3)]
    ups.append({k: 0.01 * torch.ones(t.shape) for k, t in base.items()})  # below the bound

    def sums(updates: list[dict[str, torch.Tensor]]) -> DPSum:
        acc = dp.accumulator(base)
        for u in updates:
            acc.add(u)
        return acc

    for drop in range(len(ups)):
        a, b = sums(ups), sums(ups[:drop] + ups[drop + 1 :])
        diff = math.sqrt(sum(float((a.total[k] - b.total[k]).pow(2).sum()) for k in base))
        assert diff <= 0.5 + 1e-12
        assert abs(a.bits - b.bits) == 0.5
    assert isinstance(Skipped(), dict)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("over", "line"),
    [
        (["privacy.user_level.clip=0"], "privacy.user_level.clip: input should be greater than 0"),
        (["privacy.user_level.clip=-1"], "privacy.user_level.clip: input should be greater than 0"),
        (
            ["privacy.user_level.noise_multiplier=0.3"],
            "privacy.user_level.noise_multiplier: 0.3 gives epsilon=",
        ),
        (["privacy.user_level.min_clients=null"], "privacy.user_level.min_clients: client-side"),
        (
            ["privacy.user_level.epsilon=1e-9"],
            "privacy.user_level.epsilon: epsilon=1e-09 at delta=0.0001 cannot be reached",
        ),
        (
            ["privacy.user_level.adaptive={count_stddev: 0.1}"],
            "privacy.user_level.adaptive.count_stddev: 0.1 must exceed",
        ),
        (
            ["algorithm=local"],
            "privacy.user_level: algorithm 'local' does not aggregate client updates",
        ),
        (["algo.aggregator.name=median"], "algo.aggregator: privacy.user_level aggregates"),
    ],
)
def test_bad_dp_fedavg_input_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, over: list[str], line: str
) -> None:
    argv = ["run", "tabular-dpfedavg", f"out_dir={tmp_path}", "name=bad", *over]
    code, _, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and f"config error: {line}" in err, err
    assert not (tmp_path / "bad").exists()  # nothing written


def test_a_dp_kind_with_an_undeclared_field_is_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from fedfm.algorithms.base import ALGORITHMS, Algorithm
    from fedfm.core.messages import MessageKind

    class Leaky(Algorithm):
        messages = (
            MessageKind(
                "noisy", up_arrays=("noised",), up_meta=("loss",), dp_fields=("noised",),
                dp=True, private=True,
            ),
        )  # fmt: skip

    if "test-leaky" not in ALGORITHMS:
        ALGORITHMS.register("test-leaky", "a DP kind that would send its loss")(Leaky)
    path = tmp_path / "leaky.yaml"
    path.write_text(
        json.dumps(
            {"name": "leaky", "algorithm": "test-leaky", "task": {"kind": "toy"},
             "out_dir": str(tmp_path), "plots": False}
        )
    )  # fmt: skip
    code, _, err = run_cli(["run", str(path)], monkeypatch, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "config error: messages.noisy.loss: a DP client's message may carry only" in err
    assert not (tmp_path / "leaky").exists()
    # At run time a private kind refuses a reply carrying any other field.
    kind = Leaky.messages[0]
    with pytest.raises(MessageError, match="field 'loss' is neither a DP mechanism's output"):
        kind.check(Message("noisy", {"noised": {}}, {"loss": 0.5}), "up")


# ----------------------------------------------------------------------------- algorithms


def _toy_run(**privacy: Any) -> Any:
    level = {"clip": 1.0, "noise_multiplier": 0.0, "mode": "server", **privacy}
    cfg = load_config(
        {
            "task": {"kind": "toy", "num_clients": 4},
            "train": {"steps": 2, "lr": 0.5},
            "privacy": {"user_level": level},
        }
    )
    return toy.ToyTask(toy.ToyConfig(num_clients=4), cfg), cfg


def test_dp_fedavg_round_by_hand_with_uniform_weights_and_the_fixed_denominator() -> None:
    """Noise off: Δ = Σ clip(θ_k − θ) / (q·N), whatever each client says its size is."""
    from fedfm.algorithms.fedavg import FedAvg, FedAvgConfig

    task, run_cfg = _toy_run()
    algo = FedAvg(FedAvgConfig(), task, run_cfg)
    algo.params = {"w": torch.tensor([1.0, 2.0])}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    ups = {"0": [4.0, 6.0], "1": [1.0, 2.5], "2": [1.0, 2.0], "3": [0.0, 2.0]}  # norms 5, .5, 0, 1

    def reply(cid: str, msg: Message) -> Message:
        meta = {"num_examples": 10 ** int(cid), "loss": 1.0}
        return Message("train", {"params": {"w": torch.tensor(ups[cid])}}, meta)

    fed = FakeFederation(["0", "1", "2", "3"], reply, kinds=algo.messages)
    algo.round(fed)
    # clipped: [3,4]/5 = [.6,.8]; [0,.5]; [0,0]; [-1,0]  -> sum [-.4, 1.3] / 4
    torch.testing.assert_close(algo.params["w"], torch.tensor([1.0 - 0.1, 2.0 + 0.325]))


def test_dp_scaffold_derives_the_control_update_from_the_noised_mean() -> None:
    from fedfm.algorithms.fedavg import Scaffold, ScaffoldConfig

    task, run_cfg = _toy_run(mode="client", min_clients=2)
    algo = Scaffold(ScaffoldConfig(lr_global=1.0), task, run_cfg)
    algo.params, algo.control = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 0.0])}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    kinds = algo.message_kinds().values()
    dys = {"0": [0.6, 0.8], "1": [0.0, 0.4], "2": [0.2, 0.0], "3": [0.0, 0.0]}  # all within C

    def reply(cid: str, msg: Message) -> Message:
        assert msg.meta == {"clip": 1.0}  # this round's bound travels down in client mode
        return Message("train", {"delta_y": {"w": torch.tensor(dys[cid])}})

    fed = FakeFederation(["0", "1", "2", "3"], reply, kinds=kinds)
    algo.round(fed)
    mean = torch.tensor([0.8, 1.2]) / 4
    torch.testing.assert_close(algo.params["w"], torch.tensor([1.0, 2.0]) + mean)
    c = torch.tensor([0.5, 0.0])
    torch.testing.assert_close(algo.control["w"], c + 1.0 * (-c - mean / (2 * 0.5)))

    # A private kind refuses Δc, the loss or the size next to the noised Δy.
    def leaky(cid: str, msg: Message) -> Message:
        meta = {"num_examples": 3}
        return Message("train", {"delta_y": {"w": torch.tensor(dys[cid])}}, meta)

    fed = FakeFederation(["0", "1"], leaky, kinds=kinds)
    with pytest.raises(TooFewClientsError, match="only 0 of 2"):
        algo.round(fed)
    assert "undeclared meta field 'num_examples'" in fed.failures[0]["error"]


UPDATE_ALGORITHMS = ["fedavg", "fedprox", "scaffold", "fedekd", "fedsdr"]


@pytest.mark.parametrize("algorithm", UPDATE_ALGORITHMS)
def test_every_aggregating_algorithm_sends_only_noised_updates_in_client_mode(
    tmp_path: Path, algorithm: str
) -> None:
    from helpers import flower as fs

    cfg = fs.algorithm_config(tmp_path, algorithm)
    assert cfg is not None
    n = 4 if algorithm in ("fedavg", "fedprox", "scaffold", "fedekd") else 3
    cfg["privacy"] = {
        "delta": 1e-3,
        "user_level": {"clip": 0.5, "noise_multiplier": 1.0, "mode": "client", "min_clients": 1},
    }
    cfg["clients"] = {"fraction": 1.0}
    run(load_config(cfg), progress=False)
    folder = tmp_path / cfg["name"]
    audit = [json.loads(x) for x in (folder / "audit.jsonl").read_text().splitlines()]
    update_kinds = {"fedekd": {"forward", "backward"}}.get(algorithm, {"train"})
    ups = [r for r in audit if r["direction"] == "up" and r["kind"] in update_kinds]
    assert ups and {r["privacy"] for r in ups} == {"dp"}
    assert {r["field"] for r in ups} <= {"params", "delta_y", "proxy"}
    priv = json.loads((folder / "privacy.json").read_text())
    assert priv["relation"].startswith("add or remove one client") and priv["run"]["epsilon"] > 0
    assert len(priv["clients"]) == n


# ----------------------------------------------------------------------------- noise size

# Coordinates of the noise-size checks: the SD estimate's relative standard error is
# 1/√(2·D) ≈ 0.16%, so a 1.5% tolerance is about 9 of them (and a tenth of a share fails).
NOISE_DIM = 100_000
NOISE_REL = 0.015


@pytest.mark.parametrize("adaptive", [None, {"count_stddev": 5.0}], ids=["fixed", "adaptive"])
def test_a_clients_noise_is_its_share_z_c_over_root_m(tmp_path: Path, adaptive: Any) -> None:
    """Client mode: sent − clipped update has SD ``z_Δ·C/√M`` in both clipping modes."""
    from fedfm.core.federation import ClientContext
    from fedfm.core.state import ClientState

    level = dict(mode="client", min_clients=4, noise_multiplier=1.2, epsilon=None, clip=0.5)
    dp = _user_dp(tmp_path, 40, **level, adaptive=adaptive)
    assert (dp.z_update > dp.z) == (adaptive is not None)  # the count takes its share
    gen = torch.Generator().manual_seed(3)
    update = {"a": torch.randn(NOISE_DIM // 2, generator=gen), "b": torch.randn(NOISE_DIM // 2)}
    ctx = ClientContext("7", "default", 1, 5, None, ClientState())  # type: ignore[arg-type]
    sent, _ = dp.privatise(ctx, update, Message("train", meta={"clip": 0.5}))
    clipped, norm = clip_update(update, 0.5)
    assert norm > 0.5  # clipped to C: the noise is not measured against a raw update
    noise = torch.cat([(sent[k].double() - clipped[k]).flatten() for k in sorted(clipped)])
    want = dp.z_update * 0.5 / math.sqrt(4)
    assert float(noise.std()) == pytest.approx(want, rel=NOISE_REL)
    assert abs(float(noise.mean())) < 5 * want / math.sqrt(NOISE_DIM)


@pytest.mark.parametrize("adaptive", [None, {"count_stddev": 5.0}], ids=["fixed", "adaptive"])
def test_the_servers_noise_on_the_aggregate_is_z_c(tmp_path: Path, adaptive: Any) -> None:
    """Server mode: Δ of unchanged clients is ``ξ/m`` with SD ``z_Δ·C/m``."""
    n = 8
    dp = _user_dp(tmp_path, n, noise_multiplier=0.9, epsilon=None, clip=0.4, adaptive=adaptive)
    fed = FakeFederation([str(i) for i in range(n)], {})
    dp.sample(fed)
    zeros = {"w": torch.zeros(NOISE_DIM)}
    acc = dp.accumulator(zeros)
    for _ in range(4):
        acc.add(zeros)
    delta = acc.result()["w"].double()
    assert float(delta.std()) == pytest.approx(dp.z_update * 0.4 / dp.expected, rel=NOISE_REL)


def test_the_client_wrapper_sends_only_the_noised_update_and_configure_adds_the_bound(
    tmp_path: Path,
) -> None:
    """ClientDP around a handler: the reply keeps no loss or size, its update is noised."""
    from fedfm.algorithms.fedavg import TRAIN
    from fedfm.core.federation import ClientContext
    from fedfm.core.messages import MessageKind
    from fedfm.core.state import ClientState
    from fedfm.core.userdp import ClientDP

    dp = _user_dp(tmp_path, 8, mode="client", min_clients=2, noise_multiplier=1.0, epsilon=None)
    sent = {"w": torch.zeros(3)}
    trained = {"w": torch.tensor([3.0, 0.0, 4.0])}  # ‖u‖ = 5, clipped to C = 1

    def train(ctx: Any, msg: Message) -> Message:
        return Message("train", {"params": trained}, {"num_examples": 9, "loss": 0.5})

    def evaluate(ctx: Any, msg: Message) -> Message:
        return Message("evaluate")

    kinds = {"train": TRAIN.as_private(), "evaluate": MessageKind("evaluate")}
    wrapped = ClientDP(dp).handlers({"train": train, "evaluate": evaluate}, kinds)
    assert wrapped["evaluate"] is evaluate  # not an update kind: untouched
    msg = Message("train", {"params": sent})
    fed = FakeFederation(["0", "1"], {})
    dp.sample(fed)
    out = dp.configure({"0": msg, "1": msg})
    assert out["0"] is out["1"] and out["0"].meta == {"clip": 1.0}  # one message, the bound
    ctx = ClientContext("0", "default", 1, 5, None, ClientState())  # type: ignore[arg-type]
    reply = wrapped["train"](ctx, out["0"])
    assert set(reply.arrays) == {"params"} and reply.meta == {}
    noise = reply.arrays["params"]["w"].double() - torch.tensor([0.6, 0.0, 0.8]).double()
    assert 0 < float(noise.abs().max()) < 8 * dp.z * 1.0 / math.sqrt(2)  # ξ_k ~ N(0, (zC)²/M)
