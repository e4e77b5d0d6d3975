"""Algorithms one level above the maths: whole rounds checked against hand-computed numbers.

Each test builds an algorithm on a task whose data is a few constructed rows, lets the
algorithm's own client handlers answer (through :class:`~fedfm.core.federation.ClientRunner`,
the call path of every runtime) or canned clients answer, and compares what the server and
the clients computed with the formulas of the papers, worked out by hand in the comments.

The toy task's model is ``Linear(1, 1)`` (``weight`` w, ``bias`` b) with loss
``mean((w·x + b − y)²)``, so ``∂/∂w = mean(2·r·x)`` and ``∂/∂b = mean(2·r)`` with the residual
``r = w·x + b − y``. Learning rates are powers of two so that float32 holds every value exactly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fedfm.algorithms.base import AlgoConfig, client_half, kinds_of
from fedfm.algorithms.fedavg import (
    FedAvg,
    FedAvgConfig,
    FedProx,
    FedProxConfig,
    LocalOnly,
    Scaffold,
    ScaffoldConfig,
)
from fedfm.algorithms.fedekd import FedeKD, FedeKDConfig
from fedfm.config import TrainConfig, load_config
from fedfm.core.fake import FakeFederation
from fedfm.core.federation import ClientRunner, ClientState
from fedfm.core.kd import GATES
from fedfm.core.messages import Message
from fedfm.core.train import local_train
from helpers import flower as fs
from helpers import toy

Rows = dict[str, tuple[list[float], list[float]]]


def t(*xs: float) -> Tensor:
    return torch.tensor(xs)


def linear(w: float, b: float) -> dict[str, Tensor]:
    """Parameters of the toy model ``Linear(1, 1)``."""
    return {"weight": torch.tensor([[w]]), "bias": torch.tensor([b])}


def _task(rows: Rows, **run: Any) -> tuple[toy.ToyTask, Any]:
    """The toy task (one input feature) with these rows per client: ``cid -> (xs, ys)``."""
    cfg = load_config({"task": {"kind": "toy", "num_clients": len(rows), "dim": 1}, **run})
    task = toy.ToyTask(toy.ToyConfig(num_clients=len(rows), dim=1), cfg)
    task.data = {c: (torch.tensor(x).reshape(-1, 1), torch.tensor(y)) for c, (x, y) in rows.items()}
    return task, cfg


def _live(algo: Any, task: toy.ToyTask, seed: int = 0) -> tuple[FakeFederation, list]:
    """A federation whose clients run the algorithm's own client half, with persistent state.

    Returns the federation and the list every reply is appended to, as ``(round, cid, reply)``.
    """
    ids = task.client_ids()
    client = client_half(type(algo), algo.cfg, task, algo.run)  # built from the config alone
    runner = ClientRunner(client.handlers(), kinds_of(type(algo)), dict.fromkeys(ids, "default"),
                          task, seed)  # fmt: skip
    states = {c: ClientState() for c in ids}
    replies: list[tuple[int, str, Message]] = []

    def answer(cid: str, msg: Message) -> Message:
        reply, states[cid] = runner.call(cid, fed.rnd, states[cid], msg)
        replies.append((fed.rnd, cid, reply))
        return reply

    fed = FakeFederation(ids, answer, seed=seed, kinds=algo.messages)
    fed.states = states  # type: ignore[attr-defined]
    return fed, replies


def close(a: Tensor, expected: float | list, tol: float = 1e-6) -> None:
    exp = torch.tensor(expected, dtype=a.dtype).reshape(a.shape)
    torch.testing.assert_close(a, exp, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- FedAvg


def test_fedavg_aggregate_is_the_example_weighted_mean_of_the_client_updates() -> None:
    task, run = _task({"0": ([0.0], [0.0]), "1": ([0.0], [0.0]), "2": ([0.0], [0.0])})
    cfg = FedAvgConfig.model_validate({"server_opt": {"name": "fedavg", "lr": 0.5}})
    algo = FedAvg(cfg, task, run)
    algo.params = {"w": t(0.0, 8.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    given = {"0": (t(2.0, 8.0), 1), "1": (t(0.0, 4.0), 2), "2": (t(4.0, 0.0), 5)}
    fed = FakeFederation(
        list(given),
        {c: Message("train", {"params": {"w": w}}, {"num_examples": n, "loss": float(n)})
         for c, (w, n) in given.items()},
        kinds=algo.messages,
    )  # fmt: skip
    metrics = algo.round(fed)
    # Δ = Σ n_k/n·(θ_k − θ) = 1/8·[2, 0] + 2/8·[0, −4] + 5/8·[4, −8] = [2.75, −6]
    # (averaged uniformly it would be [2, −4]); θ ← θ + η·Δ with η = 0.5
    close(algo.params["w"], [1.375, 5.0])
    # train_loss is weighted alike: (1·1 + 2·2 + 5·5) / 8; update_norm = ‖[1.375, −3]‖
    assert metrics == {
        "train_loss": 30 / 8,
        "clients": 3,
        "update_norm": pytest.approx((1.375**2 + 9) ** 0.5),
    }


# ----------------------------------------------------------------------------- FedProx


def _one_client_round(algorithm: str, mu: float) -> tuple[Message, dict[str, Tensor]]:
    """One round of FedAvg or FedProx on one client with one row (x = 1, y = 3)."""
    task, run = _task({"0": ([1.0], [3.0])}, train={"steps": 2, "lr": 0.25, "batch_size": 8})
    algo: FedAvg = (
        FedProx(FedProxConfig(mu=mu), task, run) if algorithm == "fedprox"
        else FedAvg(FedAvgConfig(), task, run)
    )  # fmt: skip
    algo.params = linear(0.0, 0.0)
    algo.origin = dict(algo.params)  # update_norm's θ_0
    fed, replies = _live(algo, task)
    algo.round(fed)
    return replies[0][2], algo.params


def test_fedprox_local_steps_equal_the_hand_computed_proximal_steps() -> None:
    # Two SGD steps, η = 0.25, μ = 2, from w = b = 0 (= the global model w_g, b_g):
    #   step 1: r = −3, ∂w = ∂b = −6; the proximal gradient μ·(w − w_g) is 0 -> w = b = 1.5
    #   step 2: r = 0, the task gradient is 0; proximal μ·(1.5 − 0) = 3 -> w = b = 1.5 − 0.75
    reply, new = _one_client_round("fedprox", mu=2.0)
    close(reply.arrays["params"]["weight"], 0.75)
    close(reply.arrays["params"]["bias"], 0.75)
    # The reported loss is the task loss alone: (r² at step 1 + r² at step 2) / 2 = (9 + 0) / 2
    assert reply.meta == {"num_examples": 1, "loss": 4.5}
    close(new["weight"], 0.75)  # one client: the aggregate is its model


def test_fedprox_with_mu_differs_from_fedavg_and_mu_zero_is_fedavg() -> None:
    # FedAvg takes the same steps without the proximal pull: w = b = 1.5 after step 2.
    avg, _ = _one_client_round("fedavg", mu=0.0)
    close(avg.arrays["params"]["weight"], 1.5)
    close(avg.arrays["params"]["bias"], 1.5)
    prox0, _ = _one_client_round("fedprox", mu=0.0)
    assert torch.equal(prox0.arrays["params"]["weight"], avg.arrays["params"]["weight"])
    prox, _ = _one_client_round("fedprox", mu=0.5)
    # step 2 with μ = 0.5: 1.5 − 0.25·0.5·1.5 = 1.3125
    close(prox.arrays["params"]["weight"], 1.3125)


# ----------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_on_a_two_client_quadratic_follows_the_paper() -> None:
    """Karimireddy et al. 2020, Algorithm 1 with option II, two rounds worked by hand.

    Client i has one row x = 0, y = a_i (a_0 = 1, a_1 = 3): its loss is (b − a_i)², gradient
    g_i(b) = 2(b − a_i); the weight gets no gradient. K = 2 local steps, η_l = 0.25, η_g = 1.
      local step        y ← y − η_l·(g_i(y) − c_i + c)
      client control    c_i⁺ = c_i − c + (x − y_i)/(K·η_l)
      server            x ← x + η_g·mean(Δy_i);  c ← c + |S|/N·mean(Δc_i)
    """
    task, run = _task(
        {"0": ([0.0], [1.0]), "1": ([0.0], [3.0])},
        train={"steps": 2, "lr": 0.25, "batch_size": 8},
    )
    algo = Scaffold(ScaffoldConfig(lr_global=1.0), task, run)
    algo.params, algo.control = linear(0.0, 0.0), linear(0.0, 0.0)
    algo.origin = dict(algo.params)  # update_norm's θ_0
    fed, replies = _live(algo, task)

    def bias(field: str) -> dict[str, float]:
        return {c: float(r.arrays[field]["bias"]) for rnd, c, r in replies if rnd == fed.rnd}

    # Round 1 (x = 0, c = c_i = 0, no correction):
    #   client 0: y = 0 − 0.25·(−2) = 0.5; 0.5 − 0.25·(−1) = 0.75; c_0⁺ = (0 − 0.75)/0.5 = −1.5
    #   client 1: y = 0 − 0.25·(−6) = 1.5; 1.5 − 0.25·(−3) = 2.25; c_1⁺ = −2.25/0.5 = −4.5
    #   server: x = (0.75 + 2.25)/2 = 1.5;  c = 0 + 2/2·(−1.5 − 4.5)/2 = −3
    algo.round(fed)
    assert bias("delta_y") == {"0": 0.75, "1": 2.25}
    assert bias("delta_c") == {"0": -1.5, "1": -4.5}
    close(algo.params["bias"], 1.5)
    close(algo.control["bias"], -3.0)
    close(fed.states["0"].arrays["control/bias"], -1.5)  # c_i stays with the client
    # Round 2 (x = 1.5, c = −3): corrections c − c_i are −1.5 (client 0) and +1.5 (client 1).
    #   client 0: g = 1 → y = 1.5 − 0.25·(1 − 1.5) = 1.625; g = 1.25 → y = 1.6875
    #             Δy = 0.1875; c_0⁺ = −1.5 + 3 + (1.5 − 1.6875)/0.5 = 1.125, Δc = 2.625
    #   client 1: g = −3 → y = 1.5 − 0.25·(−3 + 1.5) = 1.875; g = −2.25 → y = 2.0625
    #             Δy = 0.5625; c_1⁺ = −4.5 + 3 + (1.5 − 2.0625)/0.5 = −2.625, Δc = 1.875
    #   server: x = 1.5 + (0.1875 + 0.5625)/2 = 1.875;  c = −3 + (2.625 + 1.875)/2 = −0.75
    fed.rnd = 2
    algo.round(fed)
    assert bias("delta_y") == {"0": 0.1875, "1": 0.5625}
    assert bias("delta_c") == {"0": 2.625, "1": 1.875}
    close(algo.params["bias"], 1.875)
    close(algo.control["bias"], -0.75)
    # The weight has no gradient and a zero control variate throughout: it never moves.
    close(algo.params["weight"], 0.0)
    close(algo.control["weight"], 0.0)


# ----------------------------------------------------------------------------- FedeKD


def _given_gate(energy: Tensor, beta: float) -> Tensor:
    """Trust 1 for every sample but the one of highest energy, which gets 0."""
    return (energy < energy.max()).float()


if "test-given" not in GATES:
    GATES.register("test-given", "a test gate: 0 for the highest-energy sample, else 1")(
        _given_gate
    )


def _backward_step(**algo: Any) -> tuple[Message, dict[str, Tensor]]:
    """FedeKD's backward stage on one client, one step, from hand-set private and proxy models.

    Two rows x = [1, 2], y = [1, 3]; private f = 1·x + 0 = [1, 2]; global proxy g = 0.
    """
    task, run = _task({"0": ([1.0, 2.0], [1.0, 3.0])}, train={"lr": 0.25, "batch_size": 8})
    client = client_half(FedeKD, FedeKDConfig(lam=0.5, backward_steps=1, **algo), task, run)
    runner = ClientRunner(client.handlers(), kinds_of(FedeKD), {"0": "default"}, task, 0)
    state = ClientState()
    state.set_group("private", linear(1.0, 0.0))
    reply, after = runner.call("0", 1, state, Message("backward", {"proxy": linear(0.0, 0.0)}))
    return reply, after.get_group("private")


def test_fedekd_backward_step_uses_the_sigmoid_gate_weights() -> None:
    # Energies ½(f − g)² = [0.5, 2]: mean 1.25, population std 0.75, z = [−1, 1].
    # With β = ln 3 the sigmoid gate gives w = σ(−β·z) = [σ(ln 3), σ(−ln 3)] = [3/4, 1/4].
    # D = (f − g)² = [1, 4]; gated KD = (¾·1 + ¼·4)/1 = 1.75; λ = 0.5.
    # Supervised: r = f − y = [0, −1]: loss 0.5, ∂w = mean(2·r·x) = −2, ∂b = mean(2·r) = −1.
    # KD: ∂w = λ·Σ w_i·2(f_i − g_i)·x_i = 0.5·(¾·2 + ¼·8) = 1.75; ∂b = 0.5·(¾·2 + ¼·4) = 1.25.
    # SGD, η = 0.25: w = 1 − 0.25·(−0.25) = 1.0625; b = 0 − 0.25·0.25 = −0.0625.
    reply, private = _backward_step(gate="sigmoid", beta=math.log(3.0))
    close(private["weight"], 1.0625)
    close(private["bias"], -0.0625)
    assert reply.meta == pytest.approx(
        {"num_examples": 2, "loss": 0.5 + 0.5 * 1.75, "energy": 1.25,
         "gate_min": 0.25, "gate_max": 0.75}
    )  # fmt: skip


def test_fedekd_backward_step_uses_whatever_weights_the_gate_gives() -> None:
    # The given gate trusts row 1 only (w = [1, 0]): KD = D_1 = 1, ∂w = ∂b = λ·2·1 = 1.
    # w = 1 − 0.25·(−2 + 1) = 1.25; b = 0 − 0.25·(−1 + 1) = 0.
    reply, private = _backward_step(gate="test-given")
    close(private["weight"], 1.25)
    close(private["bias"], 0.0)
    assert reply.meta["gate_min"] == 0.0 and reply.meta["gate_max"] == 1.0
    # Ungated (w = [1, 1]): KD = mean D = 2.5, ∂w = 0.5·(2 + 8)/2 = 2.5, ∂b = 0.5·(2 + 4)/2 = 1.5
    # w = 1 − 0.25·0.5 = 0.875; b = −0.25·0.5 = −0.125.
    _, ungated = _backward_step(gate="ungated")
    close(ungated["weight"], 0.875)
    close(ungated["bias"], -0.125)


# ----------------------------------------------------------------------------- FedRD


def _ce(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy written out: −mean(z_y − log Σ exp z)."""
    return -(logits.gather(1, y[:, None]).squeeze(1) - logits.exp().sum(1).log()).mean()


def _cka(a: Tensor, b: Tensor) -> Tensor:
    """Linear CKA with the centring matrix built explicitly (Kornblith et al. 2019, eq. 3)."""
    n = a.shape[0]
    h = torch.eye(n, dtype=a.dtype) - 1.0 / n
    k, l_ = a @ a.T, b @ b.T

    def hsic(p: Tensor, q: Tensor) -> Tensor:
        return torch.trace(p @ h @ q @ h)

    return hsic(k, l_) / (hsic(k, k) * hsic(l_, l_)).sqrt()


def test_fedrd_server_loss_equals_the_formula_on_the_public_batch(tmp_path: Any) -> None:
    """L = CE(y, z_s) + α·CE(y, z_t) + β·(KL(z_t ‖ z_s) − CKA(f_t, f_s)) on one whole batch."""
    from fedfm.engine import build
    from fedfm.models.encoders import clear_encoders

    cfg = fs.algorithm_config(tmp_path, "fedrd")
    assert cfg is not None
    n = 40
    cfg["algo"] = {
        **cfg["algo"], "public_size": n, "alpha": 0.7, "beta": 1.3,
        "server_train": {"steps": 1, "batch_size": n, "optimizer": "sgd", "lr": 0.01},
    }  # fmt: skip
    clear_encoders()
    algo = build(load_config(cfg)).algo
    srv = algo.server()
    m = srv.cotrainer
    assert m.phi is not None
    # The formula, from the modules' state before the step (the one batch is the whole public
    # set, in some order; every term is a mean over rows or invariant to their order).
    with torch.no_grad():
        x = algo.task.inputs(srv.public, list(range(n)))
        y = srv.public.y
        f_s = m.student.features(x).double()
        z_s = m.student.head(m.student.features(x)).double()
        f_t = m.phi(srv.public_feats).double()
        z_t = m.student.head(m.phi(srv.public_feats)).double()  # the shared head g
        p_t = z_t.softmax(1)
        kl = (p_t * (p_t.log() - z_s.log_softmax(1))).sum(1).mean()
        cka = _cka(f_t, f_s)
        expected = _ce(z_s, y) + 0.7 * _ce(z_t, y) + 1.3 * (kl - cka)
    metrics = algo.co_train(1)
    assert metrics["server_steps"] == 1
    assert metrics["server_loss"] == pytest.approx(float(expected), rel=1e-4)
    assert metrics["server_ce_t"] == pytest.approx(float(_ce(z_t, y)), rel=1e-4)
    assert metrics["server_kl"] == pytest.approx(float(kl), rel=1e-4)
    assert metrics["server_cka"] == pytest.approx(float(cka), rel=1e-4)


# ----------------------------------------------------------------------------- clipping


def _one_sgd_step(clip: float | None) -> Tensor:
    """One SGD step (η = 1) on loss 3·w₀ + 4·w₁ from w = 0: the gradient [3, 4] has norm 5."""
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)

    def loss(m: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
        out = m(batch).sum()
        return out, out

    batches = iter([torch.tensor([[3.0, 4.0]])] * 1)
    local_train(model, batches, loss, TrainConfig(lr=1.0, clip_norm=clip), 1)
    return model.weight.detach().flatten()


@pytest.mark.parametrize(
    ("clip", "step"),
    [(None, [-3.0, -4.0]), (10.0, [-3.0, -4.0]), (1.0, [-0.6, -0.8]), (2.5, [-1.5, -2.0])],
)
def test_gradient_clipping_scales_to_exactly_the_configured_norm(
    clip: float | None, step: list[float]
) -> None:
    # Clipped: g·c/‖g‖ (torch adds 1e-6 to ‖g‖, well inside the tolerance).
    close(_one_sgd_step(clip), step, tol=1e-5)


# ----------------------------------------------------------------------------- evaluation, rules


def test_personal_evaluation_scores_the_global_model_on_each_client_split() -> None:
    task, run = _task({"0": ([1.0], [3.0]), "1": ([2.0], [0.0])})
    algo = FedAvg(FedAvgConfig(personal_eval=True), task, run)
    algo.params = linear(1.0, 0.0)  # predicts x
    algo.origin = dict(algo.params)  # update_norm's θ_0
    fed, _ = _live(algo, task)
    out = algo.evaluate(fed)
    # Client 0: |1 − 3| = 2; client 1: |2 − 0| = 2 -> rmse 2 on both, loss (mse) 4.
    assert out["per_client"] == {"0": {"local/rmse": 2.0, "local/loss": 4.0},
                                 "1": {"local/rmse": 2.0, "local/loss": 4.0}}  # fmt: skip
    assert out["local/rmse"] == 2.0 and out["local/rmse/worst"] == 2.0
    sent = [m for _, _, m in fed.sent]
    assert all(torch.equal(m.arrays["params"]["weight"], t(1.0).reshape(1, 1)) for m in sent)


def test_a_robust_rule_replaces_the_mean_in_fedavg_rounds() -> None:
    task, run = _task({c: ([0.0], [0.0]) for c in "012"})
    cfg = FedAvgConfig.model_validate({"aggregator": {"name": "median"}})
    algo = FedAvg(cfg, task, run)
    algo.params = {"w": t(0.0)}
    algo.origin = dict(algo.params)  # update_norm's θ_0
    given = {"0": 1.0, "1": 2.0, "2": 30.0}  # one outlier
    fed = FakeFederation(
        list(given),
        {c: Message("train", {"params": {"w": t(w)}}, {"num_examples": 1, "loss": 0.0})
         for c, w in given.items()},
        kinds=algo.messages,
    )  # fmt: skip
    algo.round(fed)
    close(algo.params["w"], 2.0)  # the median, not the mean 11


def test_local_only_clients_start_from_the_same_model_and_keep_their_own() -> None:
    task, run = _task({"0": ([1.0], [3.0]), "1": ([1.0], [3.0])}, train={"steps": 1, "lr": 0.25})
    algo = LocalOnly(AlgoConfig(), task, run)
    fed, replies = _live(algo, task)
    algo.round(fed)
    first = [r.meta["loss"] for _, _, r in replies]
    assert first[0] == first[1]  # same data, same initial model: the same loss
    fed.rnd = 2
    algo.round(fed)
    second = [r.meta["loss"] for rnd, _, r in replies if rnd == 2]
    assert all(b < a for a, b in zip(first, second, strict=True))  # each continued its own
    own = fed.states["0"].arrays
    assert set(own) == {"model/weight", "model/bias"}
