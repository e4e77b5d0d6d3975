"""Edges of the numerical core that mutation testing found unpinned (docs/testing.md).

Each test pins a behaviour that a surviving mutant changed without any other test noticing:
defaults, the ``"sum"`` reduction, per-row sums over a batch of several rows, the sign of the
small constants that keep divisions finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedfm.core.kd import (
    gated_kd,
    gated_mean,
    kd_kl,
    kd_mse,
    sigmoid_gate,
    soft_ce,
    symmetric_kl_energy,
)

LN3 = math.log(3.0)


def test_sum_reduction_is_the_sum_over_the_batch() -> None:
    s, t = torch.zeros(2, 2), torch.tensor([[LN3, 0.0], [0.0, LN3]])
    per = kd_kl(s, t, reduction="none")
    # Row 0: KL([3/4, 1/4] ‖ [1/2, 1/2]) = ¾·ln(3/2) + ¼·ln(1/2) = 0.130812; row 1 mirrors it.
    torch.testing.assert_close(per, torch.tensor([0.130812, 0.130812]), atol=1e-6, rtol=0)
    assert float(kd_kl(s, t, reduction="sum")) == pytest.approx(2 * 0.130812, abs=1e-6)
    # kd_mse: ‖s − t‖² per row = [1 + 4, 9] (two outputs), summed = 14, mean = 7
    a, b = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.zeros(2, 2)
    assert float(kd_mse(a, b, reduction="sum")) == 14.0
    assert float(kd_mse(a, b)) == 7.0


def test_soft_ce_defaults_are_temperature_1_and_the_batch_mean() -> None:
    s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]])
    # −Σ q·log p with q = [3/4, 1/4], p = [1/2, 1/2]: ln 2 = 0.693147
    assert float(soft_ce(s, t)) == pytest.approx(math.log(2.0), abs=1e-6)


def test_symmetric_energy_is_per_row_on_a_batch_of_several_rows() -> None:
    # Row 0: p = q -> 0. Row 1: p = [3/4, 1/4], q = [1/4, 3/4]:
    #   ½(KL(p‖q) + KL(q‖p)) = ½·Σ(p − q)(log p − log q) = ½·2·(½·ln 3) = ½·ln 3
    #   H(p) + H(q) = 2·(−¾·ln ¾ − ¼·ln ¼) = 2·0.562335 = 1.124671
    private = torch.tensor([[0.0, 0.0], [LN3, 0.0]])
    proxy = torch.tensor([[0.0, 0.0], [0.0, LN3]])
    e = symmetric_kl_energy(private, proxy)
    assert e.shape == (2,)
    torch.testing.assert_close(e, torch.tensor([0.0, 0.5 * LN3 / 1.124671]), atol=1e-6, rtol=0)


def test_symmetric_energy_of_confident_opposite_predictions_is_large_and_positive() -> None:
    # Both distributions are (numerically) one-hot, on different classes: the entropies vanish
    # and ε_H alone keeps the energy finite; it must stay positive (trust falls with energy).
    e = symmetric_kl_energy(torch.tensor([[60.0, 0.0]]), torch.tensor([[0.0, 60.0]]))
    assert math.isfinite(float(e)) and float(e) > 1e6


def test_the_gate_trusts_the_lower_energy_even_for_nearly_equal_energies() -> None:
    # std_B = 1e-9 is below STD_EPS = 1e-8: z = ±1e-9 / (1e-9 + 1e-8) = ±1/11.
    w = sigmoid_gate(torch.tensor([0.0, 2e-9], dtype=torch.float64), beta=1.0)
    expected = torch.tensor([1 / (1 + math.exp(-1 / 11)), 1 / (1 + math.exp(1 / 11))])
    torch.testing.assert_close(w, expected.double(), atol=1e-7, rtol=0)


def test_gated_mean_divides_by_the_sum_of_the_weights_even_when_it_is_below_one() -> None:
    values, weights = torch.tensor([2.0, 4.0]), torch.tensor([0.25, 0.125])
    # (0.25·2 + 0.125·4) / 0.375 = 1 / 0.375
    assert float(gated_mean(values, weights)) == pytest.approx(1 / 0.375)
    assert float(gated_mean(values, torch.zeros(2))) == 0.0  # no trust at all: 0, not NaN


def test_gated_kd_defaults_are_the_sigmoid_gate_with_beta_1() -> None:
    d, e = torch.tensor([1.0, 4.0]), torch.tensor([0.5, 2.0])
    loss, w = gated_kd(d, e)
    # z = [−1, 1]: w = [σ(1), σ(−1)]
    s1 = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(w, torch.tensor([s1, 1 - s1]), atol=1e-6, rtol=0)
    assert float(loss) == pytest.approx(s1 * 1.0 + (1 - s1) * 4.0, abs=1e-6)


# ----------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_server_update_defaults_to_a_global_step_of_1_and_takes_one_client() -> None:
    from fedfm.core.optim import scaffold_server_update

    x, c = {"w": torch.tensor([1.0])}, {"w": torch.tensor([0.5])}
    new_x, new_c = scaffold_server_update(
        x, c, [{"w": torch.tensor([2.0])}], [{"w": torch.tensor([4.0])}], [3], num_clients_total=4
    )
    # x + 1·Δy = 3; c + (1/4)·Δc = 0.5 + 1 = 1.5
    assert float(new_x["w"]) == 3.0 and float(new_c["w"]) == 1.5
    with pytest.raises(ValueError, match=r"lr_global=0\.0 must be > 0"):
        scaffold_server_update(x, c, [x], [c], [1], num_clients_total=1, lr_global=0.0)
    with pytest.raises(ValueError, match="lr_global=inf must be > 0"):
        scaffold_server_update(x, c, [x], [c], [1], num_clients_total=1, lr_global=math.inf)


# ----------------------------------------------------------------------------- local training


def test_the_local_optimizer_is_built_with_every_configured_setting() -> None:
    from fedfm.config import TrainConfig
    from fedfm.core.train import make_optimizer

    p = [torch.nn.Parameter(torch.zeros(2))]
    cases = [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)]
    for name, cls in cases:
        cfg = TrainConfig(optimizer=name, lr=0.2, momentum=0.5, weight_decay=0.1)
        opt = make_optimizer(p, cfg)
        group = opt.param_groups[0]
        assert type(opt) is cls and group["params"] == p, name
        assert (group["lr"], group["weight_decay"]) == (0.2, 0.1), name
        if name == "sgd":
            assert group["momentum"] == 0.5


def test_steps_from_epochs_are_at_least_one_and_round_up() -> None:
    from fedfm.config import TrainConfig
    from fedfm.core.train import num_steps

    assert num_steps(TrainConfig(epochs=0.01, batch_size=32), 10) == 1
    assert num_steps(TrainConfig(epochs=1.0, batch_size=8), 17) == 3


def test_what_travels_is_trainable_parameters_and_float_buffers() -> None:
    from fedfm.core.train import get_params, state_keys

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)  # a frozen tensor never leaves a client
    keys = state_keys(model)
    assert keys == ["0.weight", "1.weight", "1.bias", "1.running_mean", "1.running_var"]
    assert list(get_params(model, ["1.bias"])) == ["1.bias"]


def test_prox_mu_without_a_reference_is_off() -> None:
    from fedfm.config import TrainConfig
    from fedfm.core.train import local_train

    def run(**kw: float) -> torch.Tensor:
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(model.weight, 1.0)

        def loss(m: torch.nn.Module, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = m(b).sum()
            return out, out

        local_train(model, iter([torch.ones(1, 1)] * 2), loss, TrainConfig(lr=0.25, **kw), 1)
        return model.weight.detach().flatten()

    # Task gradient 1: w = 1 − 0.25 = 0.75; prox_mu without prox_ref changes nothing.
    torch.testing.assert_close(run(), torch.tensor([0.75]))
    torch.testing.assert_close(run(prox_mu=5.0), torch.tensor([0.75]))


def test_an_extra_loss_on_the_weights_moves_them() -> None:
    from fedfm.config import TrainConfig
    from fedfm.core.train import local_train

    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)

    def loss(m: torch.nn.Module, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = (m(b) * 0).sum()
        return out, out

    def l2(m: torch.nn.Module, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return (m.weight**2).sum()  # gradient 2w = 2

    local_train(model, iter([torch.ones(1, 1)]), loss, TrainConfig(lr=0.25), 1, extra_loss=l2)
    assert float(model.weight.detach()) == 0.5


# ----------------------------------------------------------------------------- messages


def test_metrics_with_a_key_that_is_not_a_string_are_refused() -> None:
    from fedfm.core.messages import MetaSpec

    assert MetaSpec("metrics").problem({1: 0.5}) == "entry 1 key is not a str"
    assert MetaSpec("metrics").problem({"acc": 0.5}) is None


def test_local_round_takes_its_budget_in_epochs_from_the_client_data() -> None:
    from fedfm.config import TrainConfig, load_config
    from fedfm.core.federation import ClientContext, ClientState
    from fedfm.core.train import local_round
    from helpers import toy

    run = load_config({"task": {"kind": "toy", "num_clients": 1}})
    task = toy.ToyTask(toy.ToyConfig(num_clients=1, per_client=24), run)
    ctx = ClientContext("0", "default", 1, 0, task, ClientState())
    res = local_round(ctx, task.build_model(), TrainConfig(epochs=1.0, batch_size=8, lr=1e-3))
    assert res.steps == 3  # ceil(1 · 24 / 8)


def test_scaffold_refuses_a_bool_step_count_and_sums_default_to_a_global_step_of_1() -> None:
    from fedfm.core.optim import ScaffoldSums, scaffold_client_control

    w = {"w": torch.zeros(1)}
    with pytest.raises(ValueError, match="steps=True must be an integer"):
        scaffold_client_control(w, w, w, w, steps=True, lr=0.1)  # type: ignore[arg-type]
    sums = ScaffoldSums({"w": torch.tensor([1.0])}, {"w": torch.tensor([0.0])})
    sums.add({"w": torch.tensor([2.0])}, {"w": torch.tensor([4.0])}, 1.0)
    new_x, new_c = sums.apply(2)
    assert float(new_x["w"]) == 3.0 and float(new_c["w"]) == 2.0  # x + Δy; c + (1/2)·Δc


def test_local_round_shuffles_with_the_purpose_batches_by_default() -> None:
    from fedfm.config import TrainConfig, load_config
    from fedfm.core.federation import ClientContext, ClientState, derive_seed
    from fedfm.core.train import local_round
    from helpers import toy

    seeds: list[int] = []

    class Recording(toy.ToyTask):
        def batches(self, data: object, batch_size: int, seed: int) -> object:
            seeds.append(seed)
            return super().batches(data, batch_size, seed)

    run = load_config({"task": {"kind": "toy", "num_clients": 1}})
    task = Recording(toy.ToyConfig(num_clients=1), run)
    local_round(ClientContext("0", "default", 4, 7, task, ClientState()), task.build_model(),
                TrainConfig(steps=1, lr=1e-3))  # fmt: skip
    assert seeds == [derive_seed(7, 4, "0", "batches")]


def test_bool_and_str_meta_specs_refuse_other_types() -> None:
    from fedfm.core.messages import MetaSpec

    assert MetaSpec("bool").problem(1) == "must be a bool, got int 1"
    assert MetaSpec("str").problem(3) == "must be a string, got int 3"
    assert MetaSpec("bool").problem(True) is None and MetaSpec("str").problem("x") is None
