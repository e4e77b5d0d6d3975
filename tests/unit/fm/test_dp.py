"""DP-SGD on the adapters of the shared tiny Llama: clipping, noise, sampling, accounting."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from opacus.accountants import RDPAccountant

from fedfm.config import TrainConfig
from fedfm.core.dp import (
    DPSGDConfig,
    calibrate_noise,
    dp_train,
    per_sample_loss,
    poisson_batches,
)
from fedfm.core.federation import ClientState
from fedfm.core.groups import get_group, join_groups
from fedfm.core.state import load_state, save_state
from fedfm.data.prompt import collate
from fedfm.errors import ConfigError
from fedfm.fm import Adapters, FoundationModel, FullWeights
from fedfm.models.generation import pad_id_of
from helpers.models import TINY_FM_LORA, randomize, tiny_fm

ROWS = [
    {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
    {"instruction": "Add 2 and 3.", "input": "", "output": "2 + 3 = 5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue, like the sky on a clear day."},
    {"instruction": "Is it raining?", "input": "Grey sky.", "output": "Maybe."},
]
SGD = TrainConfig(optimizer="sgd", lr=1.0, batch_size=4)


@pytest.fixture()
def fm() -> Any:
    fm = tiny_fm()
    fm.add_adapter("global", seed=1)
    fm.add_adapter("private", seed=2)
    randomize(fm, "private", 3, scale=0.3)
    return fm


def _snapshot(model: torch.nn.Module) -> set[Any]:
    """Every attribute and hook count of every module and parameter."""
    out: set[Any] = set()
    for name, module in model.named_modules():
        out |= {("module", name, key) for key in module.__dict__}
        hooks = (module._forward_hooks, module._backward_hooks, module._forward_pre_hooks)
        out.add(("hooks", name, *map(len, hooks)))
    for name, param in model.named_parameters():
        out |= {("param", name, key) for key in param.__dict__}
    return out


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten() for k in sorted(state)])


def test_per_sample_loss_is_each_rows_own_token_mean_or_sum(fm) -> None:
    rows = fm.encode(ROWS)
    batch = collate(rows, 0)
    with fm.use(["private"]) as model, torch.no_grad():
        mean = per_sample_loss(model, batch, "token_mean")
        total = per_sample_loss(model, batch, "token_sum")
        for i, row in enumerate(rows):  # HF's loss of the row alone is its token mean
            alone = collate([row], 0)
            assert mean[i] == pytest.approx(float(model(**alone).loss), abs=1e-5)
            n = sum(1 for t in row["labels"][1:] if t != -100)
            assert total[i] == pytest.approx(float(mean[i]) * n, rel=1e-5)


def test_one_step_clips_each_sample_and_averages_over_the_expected_batch(fm) -> None:
    rows = fm.encode(ROWS)
    clip = 0.05  # below every sample's gradient norm, so each one is scaled to norm 0.05
    before = fm.get_adapter("private")
    # By hand: per-sample gradients one row at a time, clipped, summed, divided by n = 4.
    expected = torch.zeros_like(_flat(before))
    with fm.use(["global", "private"], ["private"]) as model:
        names = sorted(k for k, p in model.named_parameters() if p.requires_grad)
        for row in rows:
            model.zero_grad()
            per_sample_loss(model, collate([row], 0)).sum().backward()
            params = dict(model.named_parameters())
            g = torch.cat([params[k].grad.flatten() for k in names])
            assert float(g.norm()) > clip
            expected += g * (clip / (float(g.norm()) + 1e-6))
        model.zero_grad(set_to_none=True)
    expected /= len(rows)
    dp = DPSGDConfig(noise_multiplier=0.0, max_grad_norm=clip, physical_batch_size=3)
    state = ClientState()
    res, _ = fm.dp_train(
        rows, state, Adapters(["global", "private"], ["private"]), train=SGD, dp=dp, delta=1e-5,
        steps=1, planned_steps=1, seed=0,
    )  # fmt: skip
    assert res.sample_rate == 1.0 and res.steps == 1  # batch_size >= n: every row, every step
    step = _flat(before) - _flat(fm.get_adapter("private"))  # lr = 1
    assert torch.allclose(step, expected, atol=1e-6)
    assert fm.active == [] and fm.trainable == []  # restored


def test_momentum_sgd_steps_on_the_clipped_mean_by_hand(fm) -> None:
    """DP-SGD with momentum SGD (``v ← μ·v + g; θ ← θ − lr·v``) over two steps, by hand."""
    rows = fm.encode(ROWS)
    clip, lr, mu = 0.05, 0.5, 0.9
    start = fm.get_adapter("private")

    def clipped_mean(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fm.set_adapter("private", state)
        total = {k: torch.zeros_like(v) for k, v in state.items()}
        with fm.use(["private"], ["private"]) as model:
            live = dict(model.named_parameters())
            names = fm.param_names("private")
            for row in rows:
                model.zero_grad()
                per_sample_loss(model, collate([row], 0)).sum().backward()
                g = {k: live[names[k]].grad.detach().clone() for k in state}
                norm = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
                assert norm > clip  # each one is scaled to norm `clip`
                for k in state:
                    total[k] += g[k] * (clip / (norm + 1e-6))
            model.zero_grad(set_to_none=True)
        return {k: v / len(rows) for k, v in total.items()}

    g1 = clipped_mean(start)
    first = {k: start[k] - lr * g1[k] for k in start}
    g2 = clipped_mean(first)
    second = {k: first[k] - lr * (mu * g1[k] + g2[k]) for k in start}
    fm.set_adapter("private", start)
    train = TrainConfig(optimizer="sgd", lr=lr, momentum=mu, batch_size=4)
    dp = DPSGDConfig(noise_multiplier=0.0, max_grad_norm=clip)
    fm.dp_train(
        rows, ClientState(), Adapters(["private"], ["private"]), train=train, dp=dp, delta=1e-5,
        steps=2, planned_steps=2, seed=0,
    )  # fmt: skip
    got = fm.get_adapter("private")
    assert torch.allclose(_flat(got), _flat(second), atol=1e-6)
    plain = {k: first[k] - lr * g2[k] for k in start}  # without momentum: another point
    assert not torch.allclose(_flat(got), _flat(plain), atol=1e-4)


def test_noise_is_gaussian_with_std_sigma_c_over_b_and_seeded(fm) -> None:
    rows = fm.encode(ROWS)
    start = fm.get_adapter("private")

    def update(sigma: float, seed: int) -> torch.Tensor:
        fm.set_adapter("private", start)
        dp = DPSGDConfig(noise_multiplier=sigma, max_grad_norm=0.5)
        fm.dp_train(
            rows, ClientState(), Adapters(["private"], ["private"]), train=SGD, dp=dp, delta=1e-5,
            steps=1, planned_steps=1, seed=seed,
        )  # fmt: skip
        return _flat(start) - _flat(fm.get_adapter("private"))

    clean = update(0.0, seed=0)
    noisy = update(2.0, seed=0)
    noise = (noisy - clean) * len(rows)  # undo the division by the expected batch size
    assert noise.numel() == 2048  # r=4 LoRA on q,k,v,o of two 32-wide layers
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.05)
    assert abs(float(noise.mean())) < 0.1  # 4.5 standard errors
    assert torch.equal(update(2.0, seed=0), noisy)  # same seed, same noise
    assert not torch.allclose(update(2.0, seed=1), noisy)


def test_micro_batches_and_infinite_epsilon(fm) -> None:
    rows = fm.encode(ROWS)
    start = fm.get_adapter("private")

    def update(dp: DPSGDConfig) -> torch.Tensor:
        fm.set_adapter("private", start)
        fm.dp_train(
            rows, ClientState(), Adapters(["private"], ["private"]), train=SGD, dp=dp, delta=1e-5,
            steps=1, planned_steps=1, seed=0,
        )  # fmt: skip
        return _flat(start) - _flat(fm.get_adapter("private"))

    one = update(DPSGDConfig(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=1))
    four = update(DPSGDConfig(noise_multiplier=0.0, max_grad_norm=0.05, physical_batch_size=4))
    assert torch.allclose(one, four, atol=1e-6)
    # epsilon = inf: the plain gradient of the mean per-sample loss, no clipping, no noise.
    fm.set_adapter("private", start)
    with fm.use(["private"], ["private"]) as model:
        model.zero_grad()
        per_sample_loss(model, collate(rows, 0)).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
    free = update(DPSGDConfig(epsilon=math.inf))
    assert torch.allclose(free, torch.cat([grads[k].flatten() for k in sorted(grads)]), atol=1e-6)
    assert not torch.allclose(free, four, atol=1e-4)  # clipping did something


def test_the_shared_model_is_left_clean_even_after_an_error(fm) -> None:
    rows = fm.encode(ROWS)
    model = fm.model
    clean = _snapshot(model)
    dp = DPSGDConfig(epsilon=4.0, physical_batch_size=2)
    kw = {"train": SGD, "dp": dp, "delta": 1e-5, "steps": 2, "planned_steps": 10}
    fm.dp_train(rows, ClientState(), Adapters(["global", "private"], ["private"]), seed=0, **kw)
    assert _snapshot(model) == clean
    bad = [*rows, {"input_ids": [1, 2], "attention_mask": [1, 1], "labels": [99999, 99999]}]
    with pytest.raises((IndexError, RuntimeError)):
        fm.dp_train(bad, ClientState(), Adapters(["private"], ["private"]), seed=0, **kw)
    assert _snapshot(model) == clean
    assert fm.active == [] and fm.trainable == []
    # The next client trains with DP again, and a plain forward/backward works as before.
    fm.dp_train(rows, ClientState(), Adapters(["global"], ["global"]), seed=1, **kw)
    with fm.use(["global"], ["global"]) as m:
        per_sample_loss(m, collate(rows, 0)).mean().backward()
        assert all(not hasattr(p, "grad_sample") for p in m.parameters())
        m.zero_grad(set_to_none=True)


def test_one_dp_train_for_full_weights_and_for_adapters() -> None:
    # A base of its own outside tiny_fm's numbering, so the bases later tests get stay theirs.
    args = {"vocab": "small", "hidden": 32, "layers": 2, "heads": 2, "seed": 7}
    fm = FoundationModel("tiny-llama", "float32", args, lora=TINY_FM_LORA)
    fm.reset_adapter("global", seed=1)
    fm.reset_adapter("private", seed=2)
    randomize(fm, "private", 3, scale=0.3)
    rows = fm.encode(ROWS)
    dp = DPSGDConfig(noise_multiplier=0.5, max_grad_norm=0.1)
    kw = {"train": SGD, "dp": dp, "delta": 1e-5, "steps": 2, "planned_steps": 2, "seed": 3}
    own = fm.get_weights()
    start = {k: v * 1.01 for k, v in own.items()}
    res, trained = fm.dp_train(rows, ClientState(), FullWeights(start), **kw)
    assert list(trained) == list(own)
    assert all(torch.equal(v, own[k]) for k, v in fm.get_weights().items())  # base restored
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    # The same steps by hand: core DP-SGD on the base carrying the weights.
    with fm.full_weights(start, trainable=True) as model:
        by_hand = dp_train(
            model, rows, ClientState(), pad_id=pad_id_of(fm.tokenizer), autocast=fm.autocast, **kw
        )
        expected = fm.get_weights()
    assert all(torch.equal(trained[k], expected[k]) for k in expected)
    assert (res.loss, res.epsilon) == (by_hand.loss, by_hand.epsilon)
    assert fm.active == [] and fm.trainable == []
    # Adapters: one trainable adapter comes back as get_adapter gives it, several grouped.
    _, one = fm.dp_train(rows, ClientState(), Adapters(["global", "private"], ["private"]), **kw)
    assert one.keys() == fm.get_adapter("private").keys()
    assert all(torch.equal(v, fm.get_adapter("private")[k]) for k, v in one.items())
    both = ["global", "private"]
    _, two = fm.dp_train(rows, ClientState(), Adapters(both, both), **kw)
    assert two.keys() == join_groups(fm.get_adapters(both)).keys()
    assert all(
        torch.equal(get_group(two, n)[k], v) for n in both for k, v in fm.get_adapter(n).items()
    )


def test_poisson_sampling_is_seeded_with_the_asked_rate() -> None:
    sizes = [len(b) for b in poisson_batches(1000, 0.03, 200, seed=4)]
    assert 25 < sum(sizes) / len(sizes) < 35 and len(set(sizes)) > 5
    assert list(poisson_batches(50, 0.2, 5, seed=4)) == list(poisson_batches(50, 0.2, 5, seed=4))
    assert list(poisson_batches(50, 0.2, 5, seed=4)) != list(poisson_batches(50, 0.2, 5, seed=5))


def test_calibrated_noise_reaches_the_target_and_bad_targets_name_the_field() -> None:
    sigma = calibrate_noise(2.0, 1e-5, 0.01, 1000)
    accountant = RDPAccountant()
    accountant.history = [(sigma, 0.01, 1000)]
    eps = accountant.get_epsilon(delta=1e-5)
    assert 1.99 <= eps <= 2.0  # Opacus's tolerance 0.01, on the private side
    accountant.history = [(sigma * 0.98, 0.01, 1000)]
    assert accountant.get_epsilon(delta=1e-5) > 2.0  # the smallest such noise, nearly
    assert calibrate_noise(math.inf, 1e-5, 0.01, 1000) == 0.0
    with pytest.raises(ConfigError, match=r"algo\.dp\.epsilon: epsilon=0\.05 .* 500 steps"):
        calibrate_noise(0.05, 1e-5, 0.1, 500)


def test_account_persists_across_rounds_and_resume_and_delta_is_checked(fm, tmp_path) -> None:
    rows = fm.encode(ROWS)
    dp = DPSGDConfig(epsilon=3.0)
    train = TrainConfig(optimizer="adamw", lr=1e-3, batch_size=2)
    kw = {"train": train, "dp": dp, "delta": 0.01, "planned_steps": 6}
    state = ClientState()
    first, _ = fm.dp_train(rows, state, Adapters(["private"], ["private"]), steps=3, seed=0, **kw)
    assert first.sample_rate == 0.5 and 0 < first.epsilon < 3.0
    save_state(state, tmp_path, "c0")  # what the store writes and a resumed run reads
    resumed = load_state(tmp_path, "c0")
    second, _ = fm.dp_train(
        rows, resumed, Adapters(["private"], ["private"]), steps=3, seed=1, **kw
    )
    assert second.noise_multiplier == first.noise_multiplier  # calibrated once
    assert resumed.meta["dp"]["history"] == [[first.noise_multiplier, 0.5, 6]]
    json.dumps(resumed.meta)
    accountant = RDPAccountant()
    accountant.history = [(first.noise_multiplier, 0.5, 6)]
    assert second.epsilon == pytest.approx(accountant.get_epsilon(delta=0.01), abs=1e-9)
    assert first.epsilon < second.epsilon <= 3.0  # the planned 6 steps spend at most the target
    assert second.report() == {
        "noise_multiplier": first.noise_multiplier,
        "sample_rate": 0.5,
        "steps": 3.0,
        "max_grad_norm": 1.0,
    }
    with pytest.raises(ConfigError, match=r"algo\.dp\.delta: delta=0\.25 must be below 1/n"):
        fm.dp_train(rows, ClientState(), Adapters(["private"], ["private"]), steps=1, seed=0,
                    **{**kw, "delta": 0.25})  # fmt: skip
    free, _ = fm.dp_train(
        rows, ClientState(), Adapters(["private"], ["private"]), steps=1, seed=0,
        **{**kw, "dp": DPSGDConfig(epsilon=math.inf)},
    )  # fmt: skip
    assert free.epsilon == math.inf and free.noise_multiplier == 0.0


def test_dp_train_on_the_raw_function_without_trainable_tensors_fails_clearly(fm) -> None:
    from fedfm.errors import FedfmError

    with pytest.raises(FedfmError, match="no trainable tensors"):
        dp_train(
            fm.model, fm.encode(ROWS), ClientState(), train=SGD, dp=DPSGDConfig(),
            delta=1e-5, steps=1, planned_steps=1, seed=0, pad_id=0,
        )  # fmt: skip


def test_a_dp_plan_is_checked_for_every_client_before_the_run() -> None:
    from fedfm.core.dp import plan_dp_sgd

    dp = DPSGDConfig(epsilon=4.0)
    sigmas = plan_dp_sgd(dp, 1e-3, {"0": 400, "1": 400, "2": 200}, 8, planned_steps=100)
    assert sigmas["0"] == sigmas["1"] == calibrate_noise(4.0, 1e-3, 8 / 400, 100)
    assert sigmas["2"] > sigmas["0"]  # a smaller client is sampled at a higher rate
    with pytest.raises(ConfigError, match=r"algo\.dp\.delta: client 2: delta=0\.005 must be below"):
        plan_dp_sgd(dp, 5e-3, {"0": 100, "2": 400}, 8, planned_steps=100)  # 1/400 < 0.005
    with pytest.raises(ConfigError, match=r"algo\.dp\.epsilon: client 0: epsilon=0\.1"):
        plan_dp_sgd(DPSGDConfig(epsilon=0.1), 1e-5, {"0": 400}, 8, planned_steps=100)
    assert plan_dp_sgd(DPSGDConfig(noise_multiplier=1.5), 1e-5, {"0": 400}, 8, 10) == {"0": 1.5}
