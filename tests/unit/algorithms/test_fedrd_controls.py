"""FedRD's controls and baselines: public fine-tuning, α = β = 0, warm-up, Fed-Hint, no-φ
alias, and the adapter on a frozen vision foundation model.

Runs in the digits setting with the tiny foundation model of ``helpers.fedrd``.
"""

from __future__ import annotations

import pytest
import torch

from fedfm.algorithms.base import ALGORITHMS
from fedfm.algorithms.fedrd import FedRD
from fedfm.core.fake import FakeFederation
from fedfm.core.messages import Message
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.models.encoders import ENCODERS, Encoder, register_encoder
from fedfm.models.objectives import hint_loss
from helpers.fedrd import LOADS, fedrd_config, same_state

pytestmark = pytest.mark.usefixtures("fedrd_fresh")


def _pixels_fm() -> Encoder:
    # The digits' own 64 pixels: an informative "foundation model" (a linear probe on raw
    # 8x8 digits is about 90 % accurate), unlike the random tiny FM of helpers.fedrd.
    return Encoder("test-pixels-fm", 64, lambda x: x.flatten(1))


if "test-pixels-fm" not in ENCODERS:
    register_encoder("test-pixels-fm", "images")(_pixels_fm)


def _reply(cid: str, msg: Message) -> Message:
    return Message("train", {"params": msg.arrays["params"]}, {"num_examples": 10, "loss": 0.0})


def test_public_fine_tuning_equals_fedrd_with_alpha_beta_zero(tmp_path) -> None:
    ft = build(fedrd_config(tmp_path, "fedavg-ft")).algo
    zero = build(fedrd_config(tmp_path, "fedrd", alpha=0.0, beta=0.0)).algo
    before = {k: v.clone() for k, v in ft.params.items()}
    assert LOADS == []
    m_ft = ft.co_train(1)
    assert LOADS == []  # the control never loads the foundation model
    assert ft.server().public_feats.shape == (100, 0)
    zero.co_train(1)
    assert LOADS == [0]
    # The same public batches and optimizer: zero-weighted teacher terms change nothing.
    for k in ft.params:
        torch.testing.assert_close(ft.params[k], zero.params[k], rtol=0, atol=1e-6)
    assert not same_state(ft.params, before)
    assert m_ft["server_steps"] == 3 and "server_cka" not in m_ft


def test_warm_up_trains_phi_and_g_only_once_before_round_one(tmp_path) -> None:
    algo = build(fedrd_config(tmp_path, warmup_epochs=2.0, teacher_eval_size=50)).algo
    srv = algo.server()
    phi0 = {k: v.clone() for k, v in srv.cotrainer.phi.state_dict().items()}
    p0 = {k: v.clone() for k, v in algo.params.items()}
    warm = algo.warm_up()
    assert warm["warmup_steps"] == 7  # ceil(2 epochs · 100 rows / 32)
    assert not same_state(srv.cotrainer.phi.state_dict(), phi0)
    assert not torch.equal(algo.params["head.weight"], p0["head.weight"])  # g moved
    for k in p0:  # the student's feature extractor got no gradient
        if not k.startswith("head."):
            assert torch.equal(algo.params[k], p0[k]), k
    fed = FakeFederation(["0", "1"], _reply, kinds=algo.messages)
    fed.rnd = 1
    assert "warmup_ce_t" in algo.round(fed)
    fed.rnd = 2
    assert "warmup_ce_t" not in algo.round(fed)


def test_warm_up_lowers_the_teacher_ce_on_the_public_set(tmp_path) -> None:
    def public_ce(a) -> float:
        srv = a.server()
        with torch.no_grad():
            _, z_t = srv.cotrainer.teacher(srv.public_feats)
        return float(torch.nn.functional.cross_entropy(z_t, srv.public.y))

    algo = build(fedrd_config(tmp_path, teacher="test-pixels-fm", warmup_epochs=10.0)).algo
    before = public_ce(algo)
    algo.warm_up()
    assert before > 2.0 and public_ce(algo) < before - 0.5


def test_warm_up_is_refused_without_a_teacher_path(tmp_path) -> None:
    for algorithm in ("fed-hint", "fedavg-ft"):
        with pytest.raises(ConfigError, match=r"algo\.warmup_epochs: objective .* no z_t"):
            build(fedrd_config(tmp_path, algorithm, warmup_epochs=1.0))


def test_hint_loss_by_hand() -> None:
    r = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    t = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    loss = hint_loss(r, t)
    # squared errors 1, 4, 9, 16, averaged over rows and features
    assert float(loss.detach()) == pytest.approx(7.5)
    loss.backward()
    assert r.grad is not None
    torch.testing.assert_close(r.grad, (r - t).detach() / 2)


def test_fed_hint_trains_a_regressor_onto_the_teacher_features(tmp_path) -> None:
    algo = build(fedrd_config(tmp_path, "fed-hint", teacher_eval_size=50)).algo
    srv = algo.server()
    m = srv.cotrainer
    assert m.hint is not None and (m.hint.in_features, m.hint.out_features) == (16, 24)
    assert m.phi is None and m.teacher_head is None and not m.has_teacher_path
    w0 = m.hint.weight.detach().clone()
    metrics = algo.co_train(1)
    assert metrics["server_hint"] > 0 and metrics["server_steps"] == 3
    assert not torch.equal(m.hint.weight, w0)
    arrays, _ = algo.state_dict()
    assert any(k.startswith("hint/") for k in arrays)
    assert "teacher/acc" not in algo.evaluate(FakeFederation([], _reply, kinds=algo.messages))


def test_fed_hint_lowers_the_hint_loss_on_the_public_set(tmp_path) -> None:
    algo = build(fedrd_config(tmp_path, "fed-hint", beta=1.0)).algo

    def public_hint() -> float:
        srv = algo.server()
        m = srv.cotrainer
        from fedfm.algorithms.fedrd import set_params

        set_params(m.student, algo.params)
        with torch.no_grad():
            f_s = m.student.features(algo.task.inputs(srv.public, range(len(srv.public))))
            return float(hint_loss(m.hint(f_s), srv.public_feats))

    before = public_hint()
    for r in range(1, 6):
        algo.co_train(r)
    assert public_hint() < before


def test_variants_are_presets_of_fedrd_under_their_names(tmp_path) -> None:
    from fedfm.engine import resolve

    names = ("fedrd", "fedrd-nophi", "fedrd-kd", "fed-hint", "fedavg-ft")
    assert all(ALGORITHMS.get(name) is FedRD for name in names)
    defaults = {name: resolve(fedrd_config(tmp_path, name))[0] for name in names}
    assert not defaults["fedrd-nophi"].reprogram and not defaults["fedrd-kd"].reprogram
    assert defaults["fedrd"].reprogram and defaults["fedrd"].objective == "fedrd"
    assert defaults["fed-hint"].objective == "hint" and defaults["fedavg-ft"].objective == "ce"
    # Each preset changes one default; a key the config sets wins over it.
    base = defaults["fedrd"].model_dump()
    for name, change in {"fedrd-nophi": "reprogram", "fed-hint": "objective"}.items():
        assert {k for k, v in defaults[name].model_dump().items() if base[k] != v} == {change}
    assert resolve(fedrd_config(tmp_path, "fedrd-nophi", reprogram=True))[0].reprogram


def test_unknown_objective_names_the_field(tmp_path) -> None:
    from fedfm.config import load_config
    from fedfm.engine import resolve

    cfg = fedrd_config(tmp_path).model_dump()
    cfg["algo"]["objective"] = "nope"
    with pytest.raises(Exception, match=r"algo\.objective"):
        resolve(load_config(cfg))


def test_fm_adapter_sends_only_the_adapter_and_keeps_the_fm_frozen() -> None:
    from fedfm.core.train import state_keys
    from fedfm.models.registry import build_model

    torch.manual_seed(0)
    model = build_model("fm-adapter", in_channels=1, num_classes=3, fm_size=32, pretrained=False)
    keys = state_keys(model)
    assert keys and all(k.split(".")[0] in ("norm", "fc1", "fc2", "proj", "head") for k in keys)
    n_sent = sum(model.state_dict()[k].numel() for k in keys)
    assert n_sent == sum(p.numel() for p in model.parameters())  # nothing of the FM travels
    frozen = model._fm
    cache, fm = frozen.cache, frozen.encoder().module
    assert fm is not None
    x = torch.rand(5, 1, 8, 8)
    model.train()
    misses = cache.misses
    out = model(x)
    assert out.shape == (5, 3) and cache.misses == misses + 5
    f1 = frozen(x[:3])
    assert cache.misses == misses + 5  # cached by the pixels
    torch.testing.assert_close(f1, frozen.encoder().encode(x[:3]))  # a fresh eval-mode forward
    assert not fm.training  # model.train() does not reach the FM
    assert not any(p.requires_grad for p in fm.parameters())
    out.sum().backward()
    assert model.head.weight.grad is not None and model.fc1.weight.grad is not None
