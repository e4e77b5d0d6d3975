"""FedRD: loss terms, frozen server-only foundation model, public-set checks, widths, baselines.

Runs on sklearn's 8x8 digits with the tiny random foundation model of ``helpers.fedrd`` (a
conv layer with BatchNorm, so a forward pass in train mode would move its running statistics).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

import fedfm.tasks.text  # noqa: F401  (registers the text task)
from fedfm.algorithms.fedrd import FedRD
from fedfm.config import load_config
from fedfm.core.federation import ClientContext, ClientState
from fedfm.core.messages import Message
from fedfm.engine import build
from fedfm.errors import ConfigError
from fedfm.models.objectives import distillation_terms
from fedfm.runtime import run
from fedfm.tasks.base import IMAGE_VIEW
from fedfm.tasks.public import used_ids
from helpers.fedrd import BUILT, LOADS, fedrd_config, same_state

pytestmark = pytest.mark.usefixtures("fedrd_fresh")


# ----------------------------------------------------------------------------- the loss


def test_distillation_terms_hand_computed() -> None:
    # z_s = [0, 0] -> p_s = [1/2, 1/2]; z_t = [ln 3, 0] -> p_t = [3/4, 1/4]; y = 0.
    # CE(y, z_t) = -ln(3/4) = 0.287682; KL(p_t || p_s) = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812.
    # Two examples with non-constant 1-d features: CKA = squared correlation = 1, L_CKA = -1.
    y = torch.tensor([0, 0])
    z_s = torch.zeros(2, 2)
    z_t = torch.tensor([[math.log(3.0), 0.0]] * 2)
    f_s, f_t = torch.tensor([[1.0], [2.0]]), torch.tensor([[5.0, 1.0], [3.0, 2.0]])
    loss, parts = distillation_terms(y, z_s, f_s, z_t, f_t, alpha=0.5, beta=2.0)
    assert parts["ce_t"] == pytest.approx(0.287682, abs=1e-6)
    assert parts["kl"] == pytest.approx(0.130812, abs=1e-6)
    assert parts["cka"] == pytest.approx(1.0, abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * 0.287682 + 2.0 * (0.130812 - 1.0), abs=1e-5)
    # temperature 2: p_t = softmax([ln 3 / 2, 0]) = [√3/(√3+1), 1/(√3+1)], KL scaled by 4
    q = math.sqrt(3) / (math.sqrt(3) + 1)
    kl2 = (q * math.log(2 * q) + (1 - q) * math.log(2 * (1 - q))) * 4
    _, parts2 = distillation_terms(y, z_s, f_s, z_t, f_t, 1.0, 1.0, temperature=2.0)
    assert parts2["kl"] == pytest.approx(kl2, abs=1e-6)


def test_kd_gradient_is_zero_when_student_equals_teacher() -> None:
    z = torch.randn(4, 3)
    z_s = z.clone().requires_grad_()
    feats = torch.randn(4, 5)
    f_s = feats.clone().requires_grad_()
    loss, parts = distillation_terms(
        torch.tensor([0, 1, 2, 0]), z_s, f_s, z, feats, alpha=0.0, beta=1.0, detach_teacher=True
    )
    loss.backward()
    assert parts["kl"] == pytest.approx(0.0, abs=1e-7)
    assert parts["cka"] == pytest.approx(1.0, abs=1e-6)
    assert z_s.grad.abs().max() < 1e-6 and f_s.grad.abs().max() < 1e-5


# ----------------------------------------------------------------------------- the run


def test_fedrd_run_keeps_fm_frozen_and_out_of_clients(tmp_path: Any) -> None:
    cfg = fedrd_config(tmp_path, teacher_eval_size=50)
    run(cfg, progress=False)
    rows = [
        json.loads(x) for x in (tmp_path / "fedrd" / "metrics.jsonl").read_text().split("\n")[:-1]
    ]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0]["public_size"] == 100 and rows[0]["teacher_dim"] == 24
    for r in rows[1:]:
        assert 0.0 <= r["server_cka"] <= 1.0 and math.isfinite(r["server_loss"])
        assert r["server_steps"] == 3 and "teacher/acc" in r and "acc" in r
        # only the student travels: its bytes, not the foundation model's
        assert r["bytes_up"] > 0
    # loaded once, on the server, outside every client handler
    assert LOADS == [0]
    module, before = BUILT[0]
    assert same_state(module.state_dict(), before)
    assert not module.training


def test_client_handler_never_loads_the_fm(tmp_path: Any) -> None:
    # What a client process does on Flower: build the algorithm from the config, run handlers.
    setup = build(fedrd_config(tmp_path))
    algo = setup.algo
    assert isinstance(algo, FedRD)
    ctx = ClientContext("0", "default", 1, 0, setup.task, ClientState())
    reply = setup.client.handlers()["train"](ctx, Message("train", {"params": algo.params}))
    assert set(reply.arrays["params"]) == set(algo.params)
    assert LOADS == [] and algo._teacher is None and algo._srv is None


def test_co_training_changes_phi_and_student_not_the_fm(tmp_path: Any) -> None:
    algo = build(fedrd_config(tmp_path)).algo
    srv = algo.server()
    phi0 = {k: v.clone() for k, v in srv.cotrainer.phi.state_dict().items()}
    params0 = {k: v.clone() for k, v in algo.params.items()}
    metrics = algo.co_train(1)
    assert metrics["server_steps"] == 3
    assert not same_state(srv.cotrainer.phi.state_dict(), phi0)
    assert not torch.equal(algo.params["head.weight"], params0["head.weight"])
    module, before = BUILT[0]
    assert same_state(module.state_dict(), before)
    # the shared head g is the student's head: the teacher path reads it
    assert srv.cotrainer.teacher_head is None


def test_public_set_is_disjoint_and_overlap_is_refused(tmp_path: Any) -> None:
    setup = build(fedrd_config(tmp_path))
    srv = setup.algo.server()
    clients = set(used_ids(setup.task).tolist())
    public = set(srv.public.ids.tolist())
    assert len(public) == 100 and not public & clients
    assert not public & set(setup.task.test_data().ids.tolist())
    some_client = sorted(clients)[:3]
    with pytest.raises(ConfigError, match=r"algo\.public_ids.*overlaps client data: 3 shared"):
        build(fedrd_config(tmp_path, public_ids=some_client)).algo.server()
    test_ids = setup.task.test_data().ids[:2].tolist()
    with pytest.raises(ConfigError, match="overlaps the test set"):
        build(fedrd_config(tmp_path, public_ids=test_ids)).algo.server()
    with pytest.raises(ConfigError, match="not training rows"):
        build(fedrd_config(tmp_path, public_ids=[10**9])).algo.server()
    with pytest.raises(ConfigError, match="only 437 training rows are held by no client"):
        build(fedrd_config(tmp_path, public_size=500)).algo.server()
    # explicit ids that no client holds are accepted
    ok = sorted(public)[:20]
    assert build(fedrd_config(tmp_path, public_ids=ok)).algo.server().public.ids.tolist() == ok


def test_width_mismatch_fails_when_built(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"input width 999 .* feature width 24"):
        build(fedrd_config(tmp_path, reprogram_in=999)).algo.server()
    with pytest.raises(ConfigError, match=r"output width 7 .* input width 16"):
        build(fedrd_config(tmp_path, reprogram_out=7)).algo.server()


def test_kd_baseline_uses_raw_features_and_cka_across_widths(tmp_path: Any) -> None:
    algo = build(fedrd_config(tmp_path, "fedrd-nophi")).algo
    srv = algo.server()
    m = srv.cotrainer
    assert m.phi is None and m.teacher_head.in_features == 24
    assert m.student.head.in_features == 16  # CKA compares 24-d with 16-d features
    metrics = algo.co_train(1)
    assert 0.0 <= metrics["server_cka"] <= 1.0


def test_checkpoint_and_resume(tmp_path: Any) -> None:
    algo = build(fedrd_config(tmp_path)).algo
    algo.co_train(1)
    arrays, meta = algo.state_dict()
    assert any(k.startswith("phi/") for k in arrays)
    fresh = build(fedrd_config(tmp_path)).algo
    fresh.load_state_dict(arrays, meta)
    phi = fresh.server().cotrainer.phi.state_dict()
    assert all(torch.equal(phi[k], arrays[f"phi/{k}"]) for k in phi)
    # a resumed engine run continues from the checkpoint and builds the server half lazily
    cfg = fedrd_config(tmp_path)
    run(cfg.model_copy(update={"rounds": 1}), progress=False)
    run(cfg, resume=True, progress=False)
    text = (tmp_path / "fedrd" / "metrics.jsonl").read_text()
    assert [json.loads(x)["round"] for x in text.splitlines()] == [0, 1, 2]


def test_text_fedrd_uses_the_task_public_split(tmp_path: Any) -> None:
    cfg = load_config(
        {
            "name": "text-fedrd",
            "algorithm": "fedrd",
            "rounds": 1,
            "out_dir": str(tmp_path),
            "plots": False,
            "threads": 1,
            "algo": {
                "teacher": "test-tiny-text-fm",
                "server_train": {"steps": 2, "batch_size": 16, "optimizer": "adam", "lr": 0.01},
                "teacher_eval_size": 40,
            },
            "task": {
                "kind": "text",
                "dataset": "trec",
                "vocab_size": 512,
                "public_size": 60,
                "max_train": 400,
                "max_test": 80,
                "model_args": {"embed_dim": 8, "hidden": 8},
            },
            "partition": {"scheme": "iid", "num_clients": 3},
            "train": {"steps": 2, "batch_size": 16, "lr": 0.5},
        }
    )
    setup = build(cfg)
    srv = setup.algo.server()
    assert srv.public.ids.tolist() == setup.task.public_data().ids.tolist()
    assert srv.public_feats.shape == (60, 12)
    summary = run(cfg, progress=False)
    assert "teacher/acc" in summary["final"] and 0 <= summary["final"]["server_cka"] <= 1
    assert all(n == 0 for n in LOADS)


# ----------------------------------------------------------------------------- presets, study

FEDRD_PRESETS = [
    "fedrd-vision",
    "fedrd-vision-nophi",
    "fedrd-vision-fedavg",
    "fedrd-vision-ft",
    "fedrd-vision-hint",
    "fedrd-vision-adapter",
    "fedrd-text",
    "fedrd-text-nophi",
    "fedrd-text-ft",
    "fedrd-text-hint",
    "fedrd-text-fedavg",
    "fedrd-text-lora",
]


@pytest.mark.parametrize("preset", FEDRD_PRESETS)
def test_presets_validate(preset: str) -> None:
    from fedfm.engine import resolve

    algo_cfg, task_cfg = resolve(load_config(preset))
    assert algo_cfg is not None
    assert task_cfg.kind in ("image", "text")


def test_study_grid_and_job_configs() -> None:
    from fedfm.reproduce.fedrd_paper import FULL, QUICK, Cell, cells, job_config

    jobs = cells(FULL)
    assert len(jobs) == 3 * 2 * (7 + 6)  # seeds x alphas x (vision + text methods)
    assert [j.seed for j in jobs] == sorted(j.seed for j in jobs)  # seed by seed
    zero = job_config(Cell("vision", 0.1, 1, "ab0"), FULL)
    assert zero["algo"]["alpha"] == zero["algo"]["beta"] == 0.0
    assert zero["algo"]["warmup_epochs"] > 0 and zero["partition"]["alpha"] == 0.1
    assert zero["seed"] == 1 and zero["rounds"] >= 40
    assert Cell("vision", 0.1, 1, "ab0").name == "vision-a0.1-s1-ab0"
    ft = job_config(Cell("vision", 0.1, 1, "ft"), FULL)
    fedrd = job_config(Cell("vision", 0.1, 1, "fedrd"), FULL)
    assert ft["algo"]["server_train"] == fedrd["algo"]["server_train"]  # same epochs
    assert ft["algo"]["public_size"] == fedrd["algo"]["public_size"]
    for key in ("task", "partition", "train", "clients"):
        assert ft[key] == fedrd[key], key  # the same clients and local training
    # the quick grid's smaller sizes reach the server's algo only where it has a public set,
    # and the adapter's foundation model sees the teacher's input size
    q = {m: job_config(Cell("vision", 0.5, 0, m), QUICK) for m in QUICK.methods}
    assert q["fedrd"]["algo"]["public_size"] == 100 and "public_size" not in q["fedavg"]["algo"]
    assert q["adapter"]["task"]["model_args"]["fm_size"] == 32
    assert all(c["task"]["max_train"] == 300 for c in q.values())


# ----------------------------------------------------------------------------- server half alone


def test_fedrd_round_against_a_fake_federation_by_hand(tmp_path: Any) -> None:
    from fedfm.core.fake import FakeFederation

    algo = build(fedrd_config(tmp_path)).algo
    glob = {k: v.clone() for k, v in algo.params.items()}
    shift = {"0": (1.0, 10), "1": (2.0, 30)}  # client -> (change of every tensor, examples)

    def reply(cid: str, msg: Message) -> Message:
        if cid not in shift:
            raise RuntimeError("offline")
        d, n = shift[cid]
        params = {k: v + d for k, v in msg.arrays["params"].items()}
        return Message("train", {"params": params}, {"num_examples": n, "loss": d})

    aggregated: dict[str, torch.Tensor] = {}
    co_train = algo.co_train

    def spy(rnd: int) -> dict[str, float]:
        aggregated.update({k: v.clone() for k, v in algo.params.items()})
        return co_train(rnd)

    algo.co_train = spy  # type: ignore[method-assign]
    fed = FakeFederation(["0", "1", "2", "3"], reply, kinds=algo.messages)
    metrics = algo.round(fed)
    # FedAvg step: every tensor moves by (10·1 + 30·2) / 40 = 1.75, then co-training starts.
    for k, v in glob.items():
        torch.testing.assert_close(aggregated[k], v + 1.75)
    assert metrics["train_loss"] == pytest.approx(1.75) and metrics["clients"] == 2
    assert metrics["server_steps"] == 3 and math.isfinite(metrics["server_loss"])
    assert not torch.equal(algo.params["head.weight"], aggregated["head.weight"])
    assert LOADS == [0]  # the foundation model was loaded once, by the server half


# ----------------------------------------------------------------------------- capabilities


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"task": {"kind": "toy"}, "algo": {"teacher": "auto"}}, "algo.teacher: no default"),
        ({"algo": {"teacher": "test-tiny-text-fm"}}, r"algo\.teacher: 'test-tiny-text-fm' needs"),
        ({"task": {"kind": "toy"}}, r"algo\.teacher: 'test-tiny-fm' needs images\(data\)"),
        ({"algo": {"public_size": 0}}, r"algo\.public_size: FedRD needs a public set"),
        ({"algo": {"teacher": "nope"}}, "algo.teacher: unknown encoder 'nope'"),
        ({"algo": {"teacher_options": {"nope": 1}}}, "algo.teacher_options: bad options"),
    ],
)
def test_missing_task_capabilities_fail_at_config_load(tmp_path, changes, message) -> None:
    from fedfm.engine import resolve
    from helpers import toy  # noqa: F401  (registers the toy task)

    cfg = fedrd_config(tmp_path).model_dump()
    for section, values in changes.items():
        cfg[section] = values if section == "task" else {**cfg[section], **values}
    if cfg["task"]["kind"] == "toy":
        cfg["partition"] = {}
    with pytest.raises(ConfigError, match=message):
        resolve(load_config(cfg))


def test_task_rows_are_prepared_as_client_data(tmp_path: Any) -> None:
    from fedfm.tasks.base import PUBLIC_SPLIT, SOURCE_ROWS, SPLIT_INPUTS

    task = build(fedrd_config(tmp_path)).task
    assert {SOURCE_ROWS, SPLIT_INPUTS, IMAGE_VIEW} <= task.provides(task.cfg)
    assert PUBLIC_SPLIT not in task.provides(task.cfg)
    data = task.client_data("1")
    order = torch.argsort(data.ids)
    rows = task.rows(data.ids.tolist())  # in the source's order
    pos = {int(i): k for k, i in enumerate(task.pool_ids().tolist())}
    assert [pos[int(i)] for i in rows.ids] == sorted(pos[int(i)] for i in rows.ids)
    same = torch.argsort(rows.ids)
    assert torch.equal(rows.x[same], data.x[order]) and torch.equal(rows.y[same], data.y[order])
    assert torch.equal(task.images(rows), rows.x) and task.inputs(rows, [0, 2]).shape[0] == 2
    # Tabular rows are standardised with the clients' statistics, as client data are.
    tab = build(
        load_config({"task": {"kind": "tabular"}, "partition": {"num_clients": 3}})
    ).task  # fmt: skip
    part = tab.client_data("0")
    back = tab.rows(part.ids.tolist())
    o1, o2 = torch.argsort(part.ids), torch.argsort(back.ids)
    torch.testing.assert_close(back.x[o2], part.x[o1])
    with pytest.raises(ConfigError, match=r"task\.kind: .tabular. does not provide image_view"):
        tab.images(back)
