"""DP federated text generation (dpsyn): mechanisms, roles, ledger, audit, artefacts, resume."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from fedfm.algorithms.dpsyn import (
    PROFILE,
    TRAIN,
    VOTE,
    DPSyn,
    DPSynClient,
    DPSynConfig,
    allot,
    code_counts,
    knn_votes,
    noisy,
    select,
)
from fedfm.config import load_config
from fedfm.core.dp import sample_rate
from fedfm.core.federation import ClientState, assign_roles
from fedfm.core.messages import Message
from fedfm.core.privacy import analytic_gaussian_sigma
from fedfm.engine import build
from fedfm.errors import ConfigError, MessageError
from fedfm.eval.synthetic import SyntheticEvalConfig, frechet_distance, logreg_scores
from fedfm.models.encoders import minilm_dir, text_embedder
from fedfm.runtime import run
from helpers.bases import DPSYN, DPSYN_DELTA
from helpers.config import make_config
from helpers.runfiles import jsonl_rows

DELTA = DPSYN_DELTA  # the runs' delta


BACKWARD: list[str] = []  # the handler kind running when backward was called


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One complete run (profile, 1 DP round, generation, voting), with backward watched."""
    tmp = tmp_path_factory.mktemp("dpsyn")
    handler = {"kind": ""}
    real_backward = torch.autograd.backward
    wrapped = {}
    for name in ("profile", "train", "vote"):  # the client half's handlers
        original = getattr(DPSynClient, name)

        def watch(self: Any, ctx: Any, msg: Any, _o: Any = original, _n: str = name) -> Any:
            handler["kind"] = _n
            try:
                return _o(self, ctx, msg)
            finally:
                handler["kind"] = ""

        wrapped[name] = original
        setattr(DPSynClient, name, watch)

    def probe(*args: Any, **kw: Any) -> Any:
        BACKWARD.append(handler["kind"])
        return real_backward(*args, **kw)

    torch.autograd.backward = probe
    try:
        run(load_config(make_config(DPSYN, tmp, name="full")), progress=False)
    finally:
        torch.autograd.backward = real_backward
        for name, original in wrapped.items():
            setattr(DPSynClient, name, original)
    return tmp / "full"


# ----------------------------------------------------------------------------- mechanisms


def test_analytic_gaussian_sigma_is_dp_accountings_and_tight() -> None:
    for eps in (0.5, 1.0, 4.0):
        sigma = analytic_gaussian_sigma(eps, DELTA)
        params = pld.common.DifferentialPrivacyParameters(eps, DELTA)
        assert sigma == pytest.approx(pld.accountant.get_smallest_gaussian_noise(params, 1, 1.0))
        # Exactly (eps, delta): the PLD of this Gaussian reaches eps, 5% less noise exceeds it.
        for scale, ok in ((1.0, True), (0.95, False)):
            acc = pld.PLDAccountant().compose(dp_accounting.GaussianDpEvent(scale * sigma))
            assert (acc.get_epsilon(DELTA) <= eps * 1.001) is ok
        # Tighter than the classical calibration sqrt(2 ln(1.25/δ))/ε (valid for ε < 1).
        if eps < 1:
            assert sigma < math.sqrt(2 * math.log(1.25 / DELTA)) / eps


def test_profile_noise_has_the_calibrated_scale() -> None:
    sigma = analytic_gaussian_sigma(1.0, DELTA)
    counts = code_counts(torch.tensor([0, 0, 1, 2, 2, 2]), 4)
    assert counts.tolist() == [2.0, 1.0, 3.0, 0.0]
    draws = torch.stack([noisy(counts, sigma, seed) - counts for seed in range(3000)])
    assert float(draws.std()) == pytest.approx(sigma, rel=0.03)
    assert float(draws.mean()) == pytest.approx(0.0, abs=0.05 * sigma)
    assert torch.equal(noisy(counts, sigma, 7), noisy(counts, sigma, 7))  # seeded


def test_allotment_rounds_the_clipped_profile() -> None:
    # P = [3, 1, -2] clips to [3, 1, 0]: s = 8 gives 6, 2, 0.
    assert allot(torch.tensor([3.0, 1.0, -2.0]), 8) == [6, 2, 0]
    assert allot(torch.tensor([-1.0, -1.0]), 4) == [2, 2]  # nothing left: uniform


def test_votes_go_to_the_k_nearest_of_the_same_code_with_weight_one_over_sqrt_k() -> None:
    e = np.eye(3, dtype=np.float64)
    # Synthetic: 0,1 of code 0 (along x, y), 2,3 of code 1 (along x, z).
    syn = np.stack([e[0], e[1], e[0], e[2]])
    syn_codes = np.array([0, 0, 1, 1])
    # One private sample of code 0 near x, one of code 1 near z, one of code 2 (no synthetic).
    near_x = np.array([0.9, 0.1, 0.0]) / np.linalg.norm([0.9, 0.1, 0.0])
    priv = np.stack([near_x, e[2], e[0]])
    priv_codes = np.array([0, 1, 2])
    one = knn_votes(priv, priv_codes, syn, syn_codes, k=1)
    # Within code 0 the nearest is 0 (not 2, which is as near but of code 1).
    assert one.tolist() == [1.0, 0.0, 0.0, 1.0]
    two = knn_votes(priv, priv_codes, syn, syn_codes, k=2)
    w = 1 / math.sqrt(2)
    assert two == pytest.approx([w, w, w, w])
    # One private sample's votes have L2 norm 1; fewer candidates than K: less than 1.
    alone = knn_votes(priv[:1], priv_codes[:1], syn, syn_codes, k=2)
    assert np.linalg.norm(alone) == pytest.approx(1.0)
    few = knn_votes(priv[:1], priv_codes[:1], syn, syn_codes, k=4)
    assert np.linalg.norm(few) == pytest.approx(math.sqrt(2 / 4))
    # A code without private samples gets no votes, whatever the embeddings.
    assert knn_votes(priv[:1], priv_codes[:1], syn, syn_codes, k=2)[2:].tolist() == [0.0, 0.0]


def test_resampling_follows_the_clipped_votes_within_each_code() -> None:
    cfg = DPSynConfig(num_samples=4, resample_size=40000)
    votes = np.maximum(np.array([3.0, 1.0, 0.0, -5.0, 2.0]), 0.0)  # clipped, as the server does
    codes = np.array([0, 0, 0, 1, 1])
    kept, unvoted = select(votes, codes, [2, 2], cfg, seed=1)
    freq = Counter(kept)
    assert len(kept) == 40000 and unvoted == []
    # Code 0 gets its half of the draws in proportion 3:1:0, code 1 all on sample 4.
    assert freq[0] / 20000 == pytest.approx(0.75, abs=0.01)
    assert freq[1] / 20000 == pytest.approx(0.25, abs=0.01)
    assert freq[2] == 0 and freq[3] == 0 and freq[4] == 20000
    # A code whose votes are all zero is drawn uniformly and reported.
    kept, unvoted = select(np.array([0.0, 0.0, 1.0]), np.array([0, 0, 1]), [2, 1], cfg, seed=2)
    assert unvoted == [0]
    # Over the whole set the draws follow the votes regardless of codes.
    every = DPSynConfig(num_samples=4, resample_size=40000, resample_scope="all")
    freq = Counter(select(votes, codes, [2, 2], every, seed=3)[0])
    assert freq[0] / 40000 == pytest.approx(0.5, abs=0.01)


def test_rank_mode_keeps_the_top_share_of_each_code() -> None:
    cfg = DPSynConfig(selection="rank", keep_fraction=0.5)
    votes = np.array([1.0, 5.0, 3.0, 0.0, 0.0, 2.0])
    kept, _ = select(votes, np.array([0, 0, 0, 0, 1, 1]), [4, 2], cfg, seed=0)
    assert kept == [1, 2, 5]


# ----------------------------------------------------------------------------- roles


def test_roles_take_fractions_or_explicit_ids() -> None:
    cids = [str(i) for i in range(6)]
    roles = {c.cid: c.role for c in assign_roles(cids, {"strong": ["1", "4"]}, seed=0)}
    assert [c for c, r in roles.items() if r == "strong"] == ["1", "4"]
    mixed = {c.cid: c.role for c in assign_roles(cids, {"strong": ["0"], "weak": 0.5}, seed=0)}
    assert mixed["0"] == "strong" and sum(r == "weak" for r in mixed.values()) == 3
    # Fractions alone are assigned exactly as before lists were allowed.
    old = assign_roles(cids, {"strong": 0.5}, seed=3)
    assert sum(c.role == "strong" for c in old) == 3
    with pytest.raises(ConfigError, match=r"clients\.roles\.strong"):
        assign_roles(cids, {"strong": ["9"]}, seed=0)


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"algo__delta": 0.05}, "algo.delta"),  # clients hold 40 rows: 1/n = 0.025
        ({"privacy__delta": 0.05}, "privacy.delta"),
        ({"algo__epsilon_train": 0}, "algo.epsilon_train"),
        ({"algo__epsilon_profile": -1}, "algo.epsilon_profile"),
        ({"algo__epsilon_vote": 0}, "algo.epsilon_vote"),
        ({"algo__k": 0}, "algo.k"),
        ({"task__code_columns": ["genre"]}, "task.code_columns"),
        ({"clients__roles": {"strong": 0.1}}, "clients.roles"),
        ({"clients__roles": {"weak": 1.0}}, "clients.roles"),
        ({"rounds": 4}, "rounds"),
        ({"algo__embedder": "nope"}, "algo.embedder"),
        # 16 tokens hold the chat template but cut "Write a rotten review." to "Write a rot".
        (
            {"task__prompt": {"max_length": 48, "max_prompt_length": 16}},
            "task.prompt.max_prompt_length",
        ),
    ],
)
def test_bad_values_fail_at_load_naming_the_field(tmp_path: Path, over: Any, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(load_config(make_config(DPSYN, tmp_path, name="bad", **over)))
    assert err.value.field == field


def test_epsilon_inf_is_accepted_as_a_word() -> None:
    assert DPSynConfig(epsilon_train="inf").train_epsilon == math.inf


# ----------------------------------------------------------------------------- the run


def test_weak_clients_never_call_backward_and_strong_ones_do(full: Path) -> None:
    assert "train" in BACKWARD  # the probe sees DP-SGD's backward passes
    assert not [k for k in BACKWARD if k in ("vote", "profile")]
    assert VOTE.no_grad and PROFILE.no_grad and not TRAIN.no_grad
    assert "strong" not in VOTE.roles and TRAIN.roles == ("strong",)


def test_a_backward_inside_a_weak_handler_fails(tmp_path: Path) -> None:
    setup = build(load_config(make_config(DPSYN, tmp_path, name="nograd")))
    runner = setup.client_runner()
    weak = [c.cid for c in setup.clients() if c.role != "strong"]
    strong = [c.cid for c in setup.clients() if c.role == "strong"]
    msg = Message("vote", meta={"texts": ["a good film", "dull"], "codes": [1, 0]})
    with pytest.raises(MessageError, match="does not handle"):
        runner.call(strong[0], 4, ClientState(), msg)
    algo = setup.algo
    original = algo.task.texts

    def sneaky(data: Any) -> list[str]:
        w = torch.ones(1, requires_grad=True)
        (w * 2).sum().backward()  # a weak client that tries to compute a gradient
        return original(data)

    algo.task.texts = sneaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        runner.call(weak[0], 4, ClientState(), msg)


def test_only_noised_counts_votes_and_dp_adapters_leave_clients(tmp_path: Path) -> None:
    setup = build(load_config(make_config(DPSYN, tmp_path, name="audit")))
    runner, algo, task = setup.client_runner(), setup.algo, setup.task
    assert isinstance(algo, DPSyn)
    weak = next(c.cid for c in setup.clients() if c.role != "strong")
    strong = next(c.cid for c in setup.clients() if c.role == "strong")
    # Counts: the true counts plus exactly the seeded analytic-Gaussian noise, never bare.
    reply, _ = runner.call(weak, 0, ClientState(), Message("profile"))
    true = code_counts(task.code_ids(task.client_data(weak)), 2)
    sent = reply.arrays["counts"]["counts"]
    assert not torch.equal(sent, true)
    noise = sent - true
    assert float(noise.abs().min()) > 0
    # Votes: noise on every entry, scale sigma_vote.
    texts = ["a good film"] * 8 + ["a dull film"] * 8
    msg = Message("vote", meta={"texts": texts, "codes": [1] * 8 + [0] * 8})
    reply, _ = runner.call(weak, 4, ClientState(), msg)
    votes = reply.arrays["votes"]["votes"]
    assert set(reply.arrays) == {"votes"} and not reply.meta
    bare = knn_votes(
        text_embedder("hashed-ngrams")(task.texts(task.client_data(weak))),
        task.code_ids(task.client_data(weak)).numpy(),
        text_embedder("hashed-ngrams")(texts),
        np.array(msg.meta["codes"]),
        2,
    )
    assert float((votes.numpy() - bare).__abs__().min()) > 0
    # Adapters: after DP-SGD with noise (sigma > 0 reported), different from what was sent.
    sent_adapter = algo.params
    reply, state = runner.call(
        strong, 1, ClientState(), Message("train", {"adapter": sent_adapter})
    )
    assert set(reply.arrays) == {"adapter"} and not reply.meta  # no loss, size or rate
    assert any(not torch.equal(reply.arrays["adapter"][k], v) for k, v in sent_adapter.items())
    assert state.meta["dp"]["noise_multiplier"] > 0  # the client's own account, in its state
    assert state.meta["dp"]["history"]


def test_audit_shows_only_the_declared_fields(full: Path) -> None:
    up: dict[str, set[str]] = {}
    for row in jsonl_rows(full / "audit.jsonl"):
        if row["direction"] == "up":
            up.setdefault(row["kind"], set()).add(row["field"])
    assert up == {
        "profile": {"counts"},
        "train": {"adapter"},
        "vote": {"votes"},
    }
    # Each field a client sent is marked a DP mechanism's output.
    ups = [r for r in jsonl_rows(full / "audit.jsonl") if r["direction"] == "up"]
    assert ups and {r["privacy"] for r in ups} == {"dp"}
    voters = {r["client"] for r in jsonl_rows(full / "audit.jsonl") if r["kind"] == "vote"}
    trainers = {r["client"] for r in jsonl_rows(full / "audit.jsonl") if r["kind"] == "train"}
    assert voters and trainers and not voters & trainers


def test_ledger_pins_each_mechanism_and_composes_per_client(full: Path) -> None:
    priv = json.loads((full / "privacy.json").read_text())
    cfg = load_config(str(full / "config.yaml"))
    setup = build(cfg)
    strong = {c.cid for c in setup.clients() if c.role == "strong"}
    entries = priv["entries"]
    for e in entries:
        if e["name"] == "profile":
            assert e["sigma"] == pytest.approx(analytic_gaussian_sigma(1.0, DELTA))
            assert e["sensitivity"] == 1.0 and e["count"] == 1
        if e["name"] == "vote":
            assert e["sigma"] == pytest.approx(analytic_gaussian_sigma(2.0, DELTA))
            assert e["client"] not in strong
        if e["kind"] == "dp-sgd":
            n = len(setup.task.client_data(e["client"]))
            q = sample_rate(8, n)
            sigma = get_noise_multiplier(
                target_epsilon=8.0, target_delta=DELTA, sample_rate=q, steps=2, accountant="rdp"
            )
            assert e["sigma"] == pytest.approx(sigma) and e["sampling_rate"] == pytest.approx(q)
            assert e["client"] in strong and e["count"] == 2
            acc = RDPAccountant()
            acc.history = [(sigma, q, 2)]
            mech = priv["clients"][e["client"]]["mechanisms"]["dp-sgd:train"]
            assert mech == pytest.approx(acc.get_epsilon(DELTA), rel=1e-4)  # RDP of two libraries
            assert mech <= 8.0 + 0.01
    for cid, rec in priv["clients"].items():
        kinds = set(rec["mechanisms"])
        expect = {"analytic-gaussian:profile"}
        expect |= {"dp-sgd:train"} if cid in strong else {"analytic-gaussian:vote"}
        assert kinds == expect
        assert rec["epsilon"] >= max(rec["mechanisms"].values())  # composition costs
    summary = json.loads((full / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(priv["run"]["epsilon"])
    fin = summary["finish"]
    assert fin["epsilon/strong"] == max(priv["clients"][c]["epsilon"] for c in strong)
    weak = [c for c in priv["clients"] if c not in strong]
    assert fin["epsilon/weak"] == max(priv["clients"][c]["epsilon"] for c in weak)
    for label, rec in priv["mechanisms"].items():
        assert fin[f"epsilon/{label}"] == rec["epsilon_max"]


@pytest.mark.parametrize("preset", ["dpsyn-rotten-tomatoes", "dpsyn-drug-reviews"])
def test_presets_validate(preset: str) -> None:
    from fedfm.engine import resolve

    algo, task = resolve(load_config(preset))
    assert isinstance(algo, DPSynConfig) and task.kind == "control_text"
    assert load_config(preset).rounds == algo.train_rounds + 2


def test_synthetic_sets_and_evaluation_are_in_the_run(full: Path) -> None:
    art = full / "artefacts"
    before, after = jsonl_rows(art / "synthetic_initial.jsonl"), jsonl_rows(art / "synthetic.jsonl")
    profile = json.loads((art / "profile.json").read_text())
    assert len(before) == sum(profile["allotment"])
    for code, n in zip(profile["codes"], profile["allotment"], strict=True):
        assert sum(r["code"] == code for r in before) == n
        assert sum(r["code"] == code for r in after) == n  # resampled within each code
    assert {r["label"] for r in before} <= {0, 1} and all("text" in r for r in after)
    assert {r["source_id"] for r in after} <= {r["id"] for r in before}
    rows = jsonl_rows(full / "metrics.jsonl")
    gen, vote = rows[2], rows[3]
    for row in (gen, vote):
        assert {"acc", "macro_f1", "clf/acc", "clf/macro_f1", "frechet"} <= set(row)
    assert {"real/acc", "real/clf/acc", "floor/acc", "floor/frechet"} <= set(gen)
    assert vote["voters"] == 2


def test_the_synthetic_set_is_an_ordinary_text_source(full: Path, tmp_path: Path) -> None:
    path = full / "artefacts" / "synthetic.jsonl"
    cfg = {
        "name": "downstream",
        "out_dir": str(tmp_path),
        "rounds": 1,
        "plots": False,
        "algorithm": "fedavg",
        "task": {
            "kind": "text",
            "dataset": "synthetic",
            "source_options": {"path": str(path)},
            "local_test_fraction": 0,
        },
        "partition": {"scheme": "iid", "num_clients": 2},
        "train": {"steps": 2, "batch_size": 4},
    }
    setup = build(load_config(cfg))
    held = json.loads((full / "artefacts" / "heldout.json").read_text())
    assert sorted(setup.task.test_data().ids.tolist()) == sorted(held["ids"])  # real rows
    texts = sorted(t for c in setup.task.client_ids() for t in setup.task.client_data(c).texts)
    assert texts == sorted(r["text"] for r in jsonl_rows(path))
    train_ids = {int(i) for c in setup.task.client_ids() for i in setup.task.client_data(c).ids}
    assert not train_ids & set(held["ids"])  # synthetic ids never name a real row
    summary = run(load_config(cfg), progress=False)
    assert "acc" in summary["final"]


def test_resume_between_stages_gives_the_uninterrupted_run(full: Path, tmp_path: Path) -> None:
    for rounds in (1, 2, 3):  # stop after fine-tuning, then after generation, then finish
        run(
            load_config(make_config(DPSYN, tmp_path, name="staged", rounds=rounds)),
            resume=rounds > 1,
            progress=False,
        )
    staged = tmp_path / "staged"
    for name in ("synthetic_initial.jsonl", "synthetic.jsonl", "votes.json", "profile.json"):
        assert (staged / "artefacts" / name).read_bytes() == (
            full / "artefacts" / name
        ).read_bytes()

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Wall times differ between runs: the round's and each stage's share of it.
        return [
            {k: v for k, v in r.items() if k != "time_s" and not k.startswith("time/")}
            for r in rows
        ]

    assert strip(jsonl_rows(staged / "metrics.jsonl")) == strip(jsonl_rows(full / "metrics.jsonl"))
    assert json.loads((staged / "privacy.json").read_text()) == json.loads(
        (full / "privacy.json").read_text()
    )


def test_epsilon_inf_trains_without_noise(tmp_path: Path) -> None:
    cfg = make_config(DPSYN, tmp_path, name="inf", rounds=1, algo__epsilon_train="inf")
    run(load_config(cfg), progress=False)
    priv = json.loads((tmp_path / "inf" / "privacy.json").read_text())
    sgd = [e for e in priv["entries"] if e["kind"] == "dp-sgd"]
    assert sgd and all(e["sigma"] == 0 for e in sgd)
    assert math.isinf(priv["run"]["epsilon"])


# ----------------------------------------------------------------------------- evaluation


def test_frechet_distance_by_hand() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 3))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    shift = np.array([1.0, -2.0, 0.5])
    assert frechet_distance(a, a + shift) == pytest.approx(float(shift @ shift), rel=1e-6)
    # Same mean, covariances I and 4I in d = 3: Tr(I + 4I - 2·2I) = 3.
    b = rng.normal(size=(200000, 3))
    assert frechet_distance(b, 2 * b) == pytest.approx(3.0, rel=0.01)


def test_logreg_scores_and_a_single_class() -> None:
    x = np.array([[0.0, 1.0], [0.1, 0.9], [1.0, 0.0], [0.9, 0.1]])
    y = np.array([0, 0, 1, 1])
    assert logreg_scores(x, y, x, y) == {"acc": 1.0, "macro_f1": 1.0}
    one = logreg_scores(x[:2], y[:2], x, y)
    assert one["acc"] == 0.5
    assert SyntheticEvalConfig().embedder is None  # the algorithm's embedder by default


@pytest.mark.slow
def test_minilm_is_the_default_embedder_and_embeds() -> None:
    assert DPSynConfig().embedder == "all-minilm-l6-v2"
    if minilm_dir() is None:
        pytest.skip("the offline MiniLM package is not installed")
    emb = text_embedder("all-minilm-l6-v2")(["a wonderful film", "a dreadful film", "tax law"])
    assert emb.shape == (3, 384)
    assert np.linalg.norm(emb, axis=1) == pytest.approx(np.ones(3), abs=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]  # two film reviews are nearer than tax law


def test_joint_codes_of_several_columns_keep_the_most_frequent(tmp_path: Path) -> None:
    from fedfm.tasks.codetext import ControlTextConfig, ControlTextTask

    cfg = load_config(make_config(DPSYN, tmp_path, name="codes"))
    task_cfg = ControlTextConfig(
        dataset="drug_reviews",
        code_columns=["label", "condition"],
        max_codes=4,
        local_test_fraction=0,
    )
    cfg.partition = {"scheme": "iid", "num_clients": 2}
    task = ControlTextTask(task_cfg, cfg)
    codes = task.codes()
    assert len(codes) == 4 and all(c.count(" | ") == 1 for c in codes)
    src = task.src
    # Every kept row's code is its own label and condition; its class label is the code's.
    names = list(src.class_names or [])
    by_id = {
        int(i): (names[int(y)], str(c))
        for i, y, c in zip(src.train["id"], src.train["label"], src.train["condition"], strict=True)
    }
    labels = task.code_labels()
    for cid in task.client_ids():
        data = task.client_data(cid)
        for sid, j, y in zip(
            data.ids.tolist(), task.code_ids(data).tolist(), data.y.tolist(), strict=True
        ):
            assert codes[j] == " | ".join(by_id[sid])
            assert labels[j] == y


def test_hashed_ngram_embeddings_are_unit_vectors_of_shared_ngrams() -> None:
    emb = text_embedder("hashed-ngrams")(["a good film", "a good film", "tax law", ""])
    assert emb.shape == (4, 256)
    assert np.linalg.norm(emb[:3], axis=1) == pytest.approx(np.ones(3), abs=1e-6)
    assert np.array_equal(emb[0], emb[1]) and not emb[3].any()
    assert emb[0] @ emb[1] == pytest.approx(1.0) and emb[0] @ emb[2] < 0.5


def test_a_code_without_allotment_is_logged_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setup = build(load_config(make_config(DPSYN, tmp_path, name="allot")))
    algo = setup.algo
    assert isinstance(algo, DPSyn)
    algo.profile = torch.tensor([-3.0, 40.0], dtype=torch.float64)  # rotten clips to 0
    with caplog.at_level("WARNING", logger="fedfm"):
        metrics = algo._generate()
    assert metrics.pop("time/generate_s") >= 0
    assert 0 <= metrics.pop("truncated") <= 1  # the share of samples cut by the token budget
    assert metrics == {"synthetic": 16, "codes_without_samples": 1}
    assert "rotten" in caplog.text
    rows = _jsonl_text(algo.artefacts.read_bytes("synthetic_initial.jsonl").decode())
    assert {r["code"] for r in rows} == {"fresh"} and len(rows) == 16


def _jsonl_text(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- full fine-tuning


def test_full_fine_tuning_trains_every_weight_and_leaves_the_shared_base(tmp_path: Path) -> None:
    setup = build(load_config(make_config(DPSYN, tmp_path, name="full-ft", algo__finetune="full")))
    runner, algo = setup.client_runner(), setup.algo
    assert isinstance(algo, DPSyn)
    strong = next(c.cid for c in setup.clients() if c.role == "strong")
    pretrained = algo.fm.get_weights()
    assert set(algo.params) == set(pretrained) and "model.embed_tokens.weight" in pretrained
    reply, _ = runner.call(strong, 1, ClientState(), Message("train", {"weights": algo.params}))
    assert set(reply.arrays) == {"weights"}
    sent, got = algo.params, reply.arrays["weights"]
    assert set(got) == set(sent)
    assert all(not torch.equal(got[k], sent[k]) for k in sent)  # every weight changed
    after = algo.fm.get_weights()
    assert all(torch.equal(after[k], pretrained[k]) for k in pretrained)  # base restored
    assert not any(p.requires_grad for p in algo.fm.bundle.model.parameters())
    algo.params = got  # the server's weights survive a checkpoint
    arrays, meta = algo.state_dict()
    again = build(
        load_config(make_config(DPSYN, tmp_path, name="full-ft-2", algo__finetune="full"))
    ).algo
    assert isinstance(again, DPSyn)
    again.load_state_dict(arrays, meta)
    assert all(torch.equal(again.params[k], got[k]) for k in got)


def test_full_fine_tuning_sends_every_weight_and_spends_what_lora_spends(
    full: Path, tmp_path: Path
) -> None:
    summary = run(
        load_config(make_config(DPSYN, tmp_path, name="full-ft", algo__finetune="full")),
        progress=False,
    )
    ft = tmp_path / "full-ft"
    # The same noise, sampling rate and steps: the same mechanisms and ε, client by client.
    lora_priv = json.loads((full / "privacy.json").read_text())
    full_priv = json.loads((ft / "privacy.json").read_text())
    assert full_priv == lora_priv
    assert summary["finish"] == json.loads((full / "summary.json").read_text())["finish"]
    # Bytes: each strong client receives and returns every weight (float32) instead of LoRA.
    setup = build(load_config(make_config(DPSYN, tmp_path, name="probe", algo__finetune="full")))
    assert isinstance(setup.algo, DPSyn)
    weights = sum(t.numel() * t.element_size() for t in setup.algo.params.values())
    strong = sum(c.role == "strong" for c in setup.clients())
    row = jsonl_rows(ft / "metrics.jsonl")[1]
    assert row["bytes_down_arrays"] == row["bytes_up_arrays"] == strong * weights
    lora_row = jsonl_rows(full / "metrics.jsonl")[1]
    assert lora_row["bytes_up_arrays"] < row["bytes_up_arrays"]
    assert (ft / "artefacts" / "synthetic.jsonl").exists()  # generated by the tuned weights
