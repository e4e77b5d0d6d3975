"""Server optimizers, aggregation and SCAFFOLD against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from fedfm.core.aggregate import pseudo_gradient, weighted_mean
from fedfm.core.optim import (
    SERVER_OPTIMIZERS,
    ServerOptConfig,
    ServerOptimizer,
    fedadagrad_step,
    fedadam_step,
    fedavg_step,
    fedavgm_step,
    fedyogi_step,
    scaffold_client_control,
    scaffold_server_update,
)
from fedfm.errors import UnknownNameError

D = torch.float64  # hand-computed values are checked in float64 where the arithmetic allows


def t(*xs: float, dtype: torch.dtype = D) -> Tensor:
    return torch.tensor(xs, dtype=dtype)


def close(a: Tensor, expected: list[float] | Tensor, tol: float = 1e-9) -> None:
    exp = expected if isinstance(expected, Tensor) else torch.tensor(expected, dtype=a.dtype)
    torch.testing.assert_close(a, exp.to(a.dtype), rtol=tol, atol=tol)


def clone(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in d.items()}


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- aggregation


def test_weighted_mean_unequal_weights() -> None:
    ups = [{"w": t(1.0, 2.0), "b": t(0.0)}, {"w": t(3.0, 6.0), "b": t(4.0)}]
    out = weighted_mean(ups, [1, 3])
    # w: (1·1 + 3·3)/4 = 10/4 = 2.5 ; (1·2 + 3·6)/4 = 20/4 = 5
    close(out["w"], [2.5, 5.0])
    # b: (1·0 + 3·4)/4 = 3
    close(out["b"], [3.0])


def test_weighted_mean_zero_weight_client_ignored_and_dtypes_kept() -> None:
    ups = [
        {"w": t(2.0, dtype=torch.bfloat16), "n": torch.tensor([1])},
        {"w": t(100.0, dtype=torch.bfloat16), "n": torch.tensor([7])},
        {"w": t(4.0, dtype=torch.bfloat16), "n": torch.tensor([4])},
    ]
    out = weighted_mean(ups, [1.0, 0.0, 2.0])
    # w: (1·2 + 0·100 + 2·4)/3 = 10/3 = 3.333.. -> bfloat16 3.34375 (8 mantissa bits)
    assert out["w"].dtype == torch.bfloat16
    assert out["w"].item() == pytest.approx(10 / 3, abs=0.02)
    # n: integers are averaged then rounded: (1 + 0 + 2·4)/3 = 3
    assert out["n"].dtype == torch.int64 and out["n"].tolist() == [3]


def test_pseudo_gradient_is_weighted_mean_of_differences() -> None:
    params = {"w": t(1.0, 2.0)}
    ups = [{"w": t(3.0, 2.0)}, {"w": t(1.0, 6.0)}]
    delta = pseudo_gradient(params, ups, [1, 3])
    # Δ = 1/4·([3,2]−[1,2]) + 3/4·([1,6]−[1,2]) = 1/4·[2,0] + 3/4·[0,4] = [0.5, 3]
    close(delta["w"], [0.5, 3.0])


def test_pseudo_gradient_of_bfloat16_params_is_float32() -> None:
    params = {"w": t(1.0, dtype=torch.bfloat16)}
    delta = pseudo_gradient(params, [{"w": t(1.5, dtype=torch.bfloat16)}], [5])
    assert delta["w"].dtype == torch.float32
    close(delta["w"], [0.5])


# ----------------------------------------------------------------------------- step functions


def test_fedavg_two_steps() -> None:
    cfg = ServerOptConfig()  # η = 1
    p0 = {"w": t(1.0, -2.0)}
    p1, s1 = fedavg_step(p0, {"w": t(0.5, 3.0)}, {}, cfg)
    close(p1["w"], [1.5, 1.0])  # [1+0.5, −2+3]
    p2, s2 = fedavg_step(p1, {"w": t(-1.0, 0.25)}, s1, cfg)
    close(p2["w"], [0.5, 1.25])  # [1.5−1, 1+0.25]
    assert s1 == {} and s2 == {}

    half = ServerOptConfig(lr=0.5)
    p1h, _ = fedavg_step(p0, {"w": t(0.5, 3.0)}, {}, half)
    close(p1h["w"], [1.25, -0.5])  # [1 + 0.5·0.5, −2 + 0.5·3]


def test_fedavgm_two_steps_undamped() -> None:
    cfg = ServerOptConfig(name="fedavgm", momentum=0.9)  # η = 1
    p0 = {"w": t(1.0, -2.0)}
    p1, s1 = fedavgm_step(p0, {"w": t(1.0, -2.0)}, {}, cfg)
    # m1 = 0.9·0 + [1, −2] = [1, −2] ; θ1 = [1+1, −2−2] = [2, −4]
    close(s1["m/w"], [1.0, -2.0])
    close(p1["w"], [2.0, -4.0])
    p2, s2 = fedavgm_step(p1, {"w": t(0.5, 1.0)}, s1, cfg)
    # m2 = 0.9·[1, −2] + [0.5, 1] = [1.4, −0.8] ; θ2 = [2+1.4, −4−0.8] = [3.4, −4.8]
    close(s2["m/w"], [1.4, -0.8])
    close(p2["w"], [3.4, -4.8])


def test_fedavgm_two_steps_dampened_like_openfedllm() -> None:
    cfg = ServerOptConfig(name="fedavgm", momentum=0.9, momentum_dampening=True, lr=0.5)
    p0 = {"w": t(1.0, -2.0)}
    p1, s1 = fedavgm_step(p0, {"w": t(1.0, -2.0)}, {}, cfg)
    # first round m1 = Δ1 = [1, −2] ; θ1 = [1 + 0.5·1, −2 + 0.5·(−2)] = [1.5, −3]
    close(s1["m/w"], [1.0, -2.0])
    close(p1["w"], [1.5, -3.0])
    p2, s2 = fedavgm_step(p1, {"w": t(0.5, 1.0)}, s1, cfg)
    # m2 = 0.9·[1, −2] + 0.1·[0.5, 1] = [0.95, −1.7] ; θ2 = [1.5+0.475, −3−0.85]
    close(s2["m/w"], [0.95, -1.7])
    close(p2["w"], [1.975, -3.85])


def test_fedadagrad_two_steps() -> None:
    cfg = ServerOptConfig(name="fedadagrad", lr=1.0, beta1=0.5, tau=0.5)  # v0 = τ² = 0.25
    p0 = {"w": t(1.0, 1.0)}
    p1, s1 = fedadagrad_step(p0, {"w": t(1.2, -1.2)}, {}, cfg)
    # m1 = 0.5·0 + 0.5·[1.2, −1.2] = [0.6, −0.6] ; v1 = 0.25 + 1.44 = 1.69 (√ = 1.3)
    # θ1 = 1 ± 0.6/(1.3 + 0.5) = 1 ± 1/3 = [4/3, 2/3]
    close(s1["m/w"], [0.6, -0.6])
    close(s1["v/w"], [1.69, 1.69])
    close(p1["w"], [4 / 3, 2 / 3])
    p2, s2 = fedadagrad_step(p1, {"w": t(8.4, 0.0)}, s1, cfg)
    # m2 = [0.3 + 4.2, −0.3 + 0] = [4.5, −0.3] ; v2 = [1.69 + 70.56, 1.69] = [72.25, 1.69]
    # θ2 = [4/3 + 4.5/(8.5 + 0.5), 2/3 − 0.3/(1.3 + 0.5)] = [4/3 + 1/2, 2/3 − 1/6] = [11/6, 1/2]
    close(s2["m/w"], [4.5, -0.3])
    close(s2["v/w"], [72.25, 1.69])
    close(p2["w"], [11 / 6, 0.5])


def test_fedadam_two_steps() -> None:
    cfg = ServerOptConfig(name="fedadam", lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)  # v0 = 1
    p0 = {"w": t(1.0, 1.0)}
    p1, s1 = fedadam_step(p0, {"w": t(7.0, 0.0)}, {}, cfg)
    # m1 = [3.5, 0] ; v1 = 0.5·1 + 0.5·[49, 0] = [25, 0.5]
    # θ1 = [1 + 3.5/(5 + 1), 1 + 0] = [19/12, 1]
    close(s1["m/w"], [3.5, 0.0])
    close(s1["v/w"], [25.0, 0.5])
    close(p1["w"], [19 / 12, 1.0])
    p2, s2 = fedadam_step(p1, {"w": t(-5.0, 0.0)}, s1, cfg)
    # m2 = [0.5·3.5 − 0.5·5, 0] = [−0.75, 0] ; v2 = [0.5·25 + 0.5·25, 0.25] = [25, 0.25]
    # θ2 = [19/12 − 0.75/6, 1] = [19/12 − 1/8, 1] = [35/24, 1]
    close(s2["m/w"], [-0.75, 0.0])
    close(s2["v/w"], [25.0, 0.25])
    close(p2["w"], [35 / 24, 1.0])


def test_fedyogi_two_steps() -> None:
    cfg = ServerOptConfig(name="fedyogi", lr=1.0, beta1=0.5, beta2=0.5, tau=1.0)  # v0 = 1
    p0 = {"w": t(1.0, 1.0)}
    p1, s1 = fedyogi_step(p0, {"w": t(4.0, 0.5)}, {}, cfg)
    # Δ² = [16, 0.25]; sign(v0 − Δ²) = [−1, +1]
    # v1 = [1 + 0.5·16, 1 − 0.5·0.25] = [9, 0.875] ; m1 = [2, 0.25]
    # θ1 = [1 + 2/(3 + 1), 1 + 0.25/(√0.875 + 1)] = [1.5, 1 + 0.25/1.935414]
    close(s1["v/w"], [9.0, 0.875])
    close(s1["m/w"], [2.0, 0.25])
    close(p1["w"], [1.5, 1 + 0.25 / (math.sqrt(0.875) + 1)])
    p2, s2 = fedyogi_step(p1, {"w": t(2.0, 0.5)}, s1, cfg)
    # Δ² = [4, 0.25]; sign(v1 − Δ²) = [+1, +1]
    # v2 = [9 − 0.5·4, 0.875 − 0.5·0.25] = [7, 0.75] ; m2 = [1 + 1, 0.125 + 0.25] = [2, 0.375]
    # θ2 = θ1 + [2/(√7 + 1), 0.375/(√0.75 + 1)]
    close(s2["v/w"], [7.0, 0.75])
    close(s2["m/w"], [2.0, 0.375])
    exp = [1.5 + 2 / (math.sqrt(7) + 1), p1["w"][1].item() + 0.375 / (math.sqrt(0.75) + 1)]
    close(p2["w"], exp)


def test_adaptive_defaults_are_openfedllm_and_v_starts_at_tau_squared() -> None:
    cfg = ServerOptConfig(name="fedadam")
    assert (cfg.resolved_lr, cfg.tau, cfg.beta1, cfg.beta2) == (1e-3, 1e-3, 0.9, 0.99)
    p0 = {"w": t(0.0)}
    p1, s1 = fedadam_step(p0, {"w": t(0.01)}, {}, cfg)
    # m1 = 0.1·0.01 = 1e−3 ; v1 = 0.99·1e−6 + 0.01·1e−4 = 1.99e−6
    # θ1 = 1e−3 · 1e−3/(√1.99e−6 + 1e−3) = 1e−6/(1.410674e−3 + 1e−3) = 4.14822e−4
    close(s1["m/w"], [1e-3])
    close(s1["v/w"], [1.99e-6])
    close(p1["w"], [1e-6 / (math.sqrt(1.99e-6) + 1e-3)], tol=1e-12)
    # FedAdagrad with Δ = 0 leaves m = 0 and v = τ² = 1e−6
    _, s = fedadagrad_step(p0, {"w": t(0.0)}, {}, ServerOptConfig(name="fedadagrad"))
    close(s["v/w"], [1e-6], tol=1e-15)


def test_default_lr_per_optimizer() -> None:
    lrs = {n: ServerOptConfig(name=n).resolved_lr for n in SERVER_OPTIMIZERS}
    assert lrs == {
        "fedavg": 1.0,
        "fedavgm": 1.0,
        "fedadagrad": 1e-3,
        "fedadam": 1e-3,
        "fedyogi": 1e-3,
    }
    assert ServerOptConfig(name="fedadam", lr=0.1).resolved_lr == 0.1


def test_bfloat16_params_keep_dtype_and_float32_state() -> None:
    cfg = ServerOptConfig(name="fedyogi")
    p = {"w": t(1.0, 2.0, dtype=torch.bfloat16)}
    new, state = fedyogi_step(p, {"w": t(0.5, 0.5, dtype=torch.float32)}, {}, cfg)
    assert new["w"].dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in state.values())


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_step_does_not_mutate_or_alias_inputs(name: str) -> None:
    step = SERVER_OPTIMIZERS.get(name)
    cfg = ServerOptConfig(name=name)
    params = {"w": t(1.0, 2.0, 3.0)}
    delta = {"w": t(0.0, 0.0, 0.0)}
    _, state = step(params, {"w": t(0.1, -0.2, 0.3)}, {}, cfg)
    before = (clone(params), clone(delta), clone(state))
    new, new_state = step(params, delta, state, cfg)
    assert same(params, before[0]) and same(delta, before[1]) and same(state, before[2])
    # Outputs are fresh tensors even when Δ = 0 leaves the values equal.
    new["w"].add_(1.0)
    for v in new_state.values():
        v.add_(1.0)
    assert same(params, before[0]) and same(delta, before[1]) and same(state, before[2])


def test_aggregation_does_not_mutate_inputs() -> None:
    params = {"w": t(1.0, 2.0)}
    ups = [{"w": t(3.0, 2.0)}, {"w": t(1.0, 6.0)}]
    snap_p, snap_u = clone(params), [clone(u) for u in ups]
    pseudo_gradient(params, ups, [1, 3])
    out = weighted_mean(ups, [1, 0])
    out["w"].add_(5.0)  # the mean is a new tensor even when one client has all the weight
    assert same(params, snap_p) and all(same(u, s) for u, s in zip(ups, snap_u, strict=True))


# ----------------------------------------------------------------------------- wrapper


def _rounds(seed: int, n: int) -> list[tuple[list[dict[str, Tensor]], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ups = [{"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g)}]
        ups.append({"a": torch.randn(3, generator=g), "b": torch.randn(2, 2, generator=g)})
        out.append((ups, [int(torch.randint(1, 10, (1,), generator=g)), 4]))
    return out


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_server_optimizer_resume_matches_uninterrupted_run(name: str) -> None:
    cfg = ServerOptConfig(name=name, lr=0.1, momentum_dampening=name == "fedavgm")
    rounds = _rounds(0, 4)
    p0 = {"a": torch.zeros(3), "b": torch.ones(2, 2)}

    full = ServerOptimizer(cfg)
    p_full = p0
    for ups, ws in rounds:
        p_full = full.step(p_full, ups, ws)

    first = ServerOptimizer(cfg)
    p = p0
    for ups, ws in rounds[:2]:
        p = first.step(p, ups, ws)
    saved = st_save(first.state_dict())  # state must hold tensors only
    resumed = ServerOptimizer(cfg)
    resumed.load_state_dict(st_load(saved))
    assert same(resumed.state_dict(), first.state_dict())
    for ups, ws in rounds[2:]:
        p = resumed.step(p, ups, ws)

    assert same(p, p_full)
    assert same(resumed.state_dict(), full.state_dict())
    expected_keys = {"fedavg": set(), "fedavgm": {"m/a", "m/b"}}.get(
        name, {"m/a", "m/b", "v/a", "v/b"}
    )
    assert set(full.state_dict()) == expected_keys


def test_server_optimizer_step_equals_pure_functions_and_state_dict_is_a_copy() -> None:
    cfg = ServerOptConfig(name="fedavgm")
    opt = ServerOptimizer(cfg)
    params = {"w": t(1.0, 2.0)}
    ups = [{"w": t(3.0, 2.0)}, {"w": t(1.0, 6.0)}]
    new = opt.step(params, ups, [1, 3])
    # Δ = [0.5, 3] (see test_pseudo_gradient...) ; m = Δ ; θ = [1.5, 5]
    close(new["w"], [1.5, 5.0])
    sd = opt.state_dict()
    sd["m/w"].zero_()
    close(opt.state_dict()["m/w"], [0.5, 3.0])
    # apply_delta takes an already aggregated Δ: m = 0.9·[0.5, 3] + [1, 1] = [1.45, 3.7]
    close(opt.apply_delta(new, {"w": t(1.0, 1.0)})["w"], [2.95, 8.7])


def test_server_optimizer_refuses_bad_state() -> None:
    opt = ServerOptimizer(ServerOptConfig(name="fedadam"))
    with pytest.raises(ValueError, match="expected a tensor"):
        opt.load_state_dict({"m/w": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="unexpected state entry 'velocity/w'"):
        opt.load_state_dict({"velocity/w": t(1.0)})
    with pytest.raises(ValueError, match="unexpected state entry 'm/w'"):
        ServerOptimizer(ServerOptConfig()).load_state_dict({"m/w": t(1.0)})
    opt.load_state_dict({"m/zz": t(1.0)})
    with pytest.raises(ValueError, match="unexpected state entry 'm/zz'"):
        opt.step({"w": t(1.0)}, [{"w": t(2.0)}], [1])


# ----------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_server_update() -> None:
    x = {"w": t(1.0, 2.0)}
    c = {"w": t(0.5, -0.5)}
    dy = [{"w": t(2.0, 0.0)}, {"w": t(0.0, 4.0)}]
    dc = [{"w": t(1.0, 1.0)}, {"w": t(3.0, -1.0)}]
    new_x, new_c = scaffold_server_update(x, c, dy, dc, [1, 3], num_clients_total=10, lr_global=0.5)
    # Δx = 1/4·[2, 0] + 3/4·[0, 4] = [0.5, 3] ; x = [1, 2] + 0.5·[0.5, 3] = [1.25, 3.5]
    close(new_x["w"], [1.25, 3.5])
    # mean Δc = ([1, 1] + [3, −1])/2 = [2, 0] ; c = [0.5, −0.5] + (2/10)·[2, 0] = [0.9, −0.5]
    close(new_c["w"], [0.9, -0.5])
    assert same(x, {"w": t(1.0, 2.0)}) and same(c, {"w": t(0.5, -0.5)})


def test_scaffold_client_control_option_ii() -> None:
    ci, c = {"w": t(0.1, 0.2)}, {"w": t(0.3, -0.1)}
    x, y = {"w": t(1.0, 2.0)}, {"w": t(0.8, 2.4)}
    out = scaffold_client_control(ci, c, x, y, steps=4, lr=0.1)
    # (x − y)/(K·η_l) = [0.2, −0.4]/0.4 = [0.5, −1]
    # c_i⁺ = [0.1 − 0.3 + 0.5, 0.2 + 0.1 − 1] = [0.3, −0.7]
    close(out["w"], [0.3, -0.7])


def test_scaffold_client_control_recovers_constant_gradient() -> None:
    # K corrected SGD steps with a constant gradient g: y = x − K·η_l·(g + c − c_i),
    # so option II gives c_i⁺ = c_i − c + (g + c − c_i) = g.
    g, ci, c, x = t(0.7, -1.3), t(0.2, 0.4), t(-0.1, 0.5), t(2.0, 3.0)
    y = x.clone()
    for _ in range(5):
        y = y - 0.05 * (g + c - ci)
    out = scaffold_client_control({"w": ci}, {"w": c}, {"w": x}, {"w": y}, steps=5, lr=0.05)
    close(out["w"], g, tol=1e-12)


# ----------------------------------------------------------------------------- errors


def test_aggregation_errors() -> None:
    with pytest.raises(ValueError, match="no updates"):
        weighted_mean([], [])
    with pytest.raises(ValueError, match="no updates"):
        pseudo_gradient({"w": t(1.0)}, [], [])
    with pytest.raises(ValueError, match=r"total weight is 0\.0"):
        weighted_mean([{"w": t(1.0)}, {"w": t(2.0)}], [0, 0])
    with pytest.raises(ValueError, match=r"weight 1 is -1\.0"):
        weighted_mean([{"w": t(1.0)}, {"w": t(2.0)}], [2, -1])
    with pytest.raises(ValueError, match="weight 0 is nan"):
        weighted_mean([{"w": t(1.0)}], [float("nan")])
    with pytest.raises(ValueError, match="1 weights for 2 updates"):
        weighted_mean([{"w": t(1.0)}, {"w": t(2.0)}], [1])
    with pytest.raises(ValueError, match=r"names do not match \(missing 'b'; unexpected 'c'\)"):
        weighted_mean([{"w": t(1.0), "b": t(1.0)}, {"w": t(2.0), "c": t(1.0)}], [1, 1])
    with pytest.raises(ValueError, match=r"update 1 'w': shape \(2,\) does not match \(1,\)"):
        weighted_mean([{"w": t(1.0)}, {"w": t(2.0, 3.0)}], [1, 1])
    with pytest.raises(ValueError, match="missing 'b'"):
        pseudo_gradient({"w": t(1.0), "b": t(0.0)}, [{"w": t(2.0)}], [1])
    with pytest.raises(ValueError, match=r"'n' has dtype torch\.int64"):
        pseudo_gradient({"n": torch.tensor([1])}, [{"n": torch.tensor([2])}], [1])


def test_step_errors() -> None:
    cfg = ServerOptConfig(name="fedadam")
    with pytest.raises(ValueError, match=r"delta vs params.*missing 'b'"):
        fedadam_step({"w": t(1.0), "b": t(1.0)}, {"w": t(1.0)}, {}, cfg)
    with pytest.raises(ValueError, match="state 'v/w': shape"):
        fedadam_step({"w": t(1.0)}, {"w": t(1.0)}, {"v/w": t(1.0, 2.0)}, cfg)
    with pytest.raises(ValueError, match="fedavg: unexpected state entry 'm/w'"):
        fedavg_step({"w": t(1.0)}, {"w": t(1.0)}, {"m/w": t(1.0)}, ServerOptConfig())
    with pytest.raises(UnknownNameError, match="unknown server optimizer 'fedsgd'"):
        SERVER_OPTIMIZERS.get("fedsgd")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0},
        {"lr": float("inf")},
        {"tau": 0.0},
        {"beta1": 1.0},
        {"beta2": -0.1},
        {"momentum": 1.0},
        {"name": "fedsgd"},
        {"eta": 0.1},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ServerOptConfig(**kwargs)


def test_scaffold_errors() -> None:
    x, c = {"w": t(1.0)}, {"w": t(0.0)}
    with pytest.raises(ValueError, match="no client updates"):
        scaffold_server_update(x, c, [], [], [], num_clients_total=3)
    with pytest.raises(ValueError, match="num_clients_total=1 is below the 2 clients"):
        scaffold_server_update(x, c, [x, x], [c, c], [1, 1], num_clients_total=1)
    with pytest.raises(ValueError, match="1 delta_y but 2 delta_c"):
        scaffold_server_update(x, c, [x], [c, c], [1], num_clients_total=3)
    with pytest.raises(ValueError, match=r"delta_c 0 vs c_global.*missing 'w'"):
        scaffold_server_update(x, c, [x], [{"v": t(0.0)}], [1], num_clients_total=3)
    with pytest.raises(ValueError, match="steps=0"):
        scaffold_client_control(c, c, x, x, steps=0, lr=0.1)
    with pytest.raises(ValueError, match=r"lr=0\.0"):
        scaffold_client_control(c, c, x, x, steps=1, lr=0.0)
