"""The dpsyn study: generators that stop after generation, offline voting equal to the
algorithm's, its four selections, the two-way statistics and the report, on a tiny grid."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedfm.algorithms.dpsyn import DPSynConfig, select
from fedfm.config import load_config
from fedfm.core.federation import derive_seed
from fedfm.core.privacy import analytic_gaussian_sigma
from fedfm.reproduce import STUDIES, load_studies
from fedfm.reproduce import dpsyn as study
from fedfm.reproduce.dpsyn import FULL, QUICK, Grid
from fedfm.reproduce.framework import RunView, open_study, run_study
from fedfm.runtime import run
from helpers.runfiles import jsonl_rows

TINY = Grid(
    clients=4,
    rows=30,
    strong=(1, 2),
    train_rounds=1,
    steps=2,
    batch_size=8,
    lr=1e-2,
    pool=16,
    size=8,
    max_new_tokens=6,
    max_length=48,
    max_prompt_length=24,
    prompt_template="Write a {code} review.",
    probe_templates=("Write a {code} review.",),
    probe_samples=2,
    k=2,
    seeds=3,
    test_rows=30,
    bootstrap=50,
    task={
        "lm": "tiny-llama",
        "lm_args": {"vocab": "small", "hidden": 32, "layers": 1, "heads": 2, "seed": 31},
        "lora": {"r": 4, "alpha": 8},
        "autocast_bf16": False,
    },
    algo={"embedder": "hashed-ngrams", "generation": {"batch_size": 8}},
    dp_finetune={
        "train": {"batch_size": 8, "optimizer": "sgd", "momentum": 0.9, "lr": 0.1},
        "task": {"lora": {"r": 1, "alpha": 2, "freeze_a": True, "target_modules": ["v_proj"]}},
    },
    label="test grid",
    gated=False,
)
PILOT_NAMES = [
    "pilot-strong2",
    "pilot-strong1",
    "embed",
    "vote-pilot-strong2",
    "vote-pilot-strong1",
    "pilot",
]
NAMES = [
    *PILOT_NAMES,
    "strong2",
    "strong1",
    "base",
    "prompts",
    "vote-strong2",
    "vote-strong1",
    "vote-base",
]


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    """The tiny grid run twice: (study folder, report, jobs run by each invocation)."""
    tmp = tmp_path_factory.mktemp("dpsyn-study")
    out, report = tmp / "runs", tmp / "report.md"
    ctx = open_study(study.STUDY, out, grid=TINY, command="test --pilot", workers=1, pilot=True)
    run_study(study.STUDY, ctx, tmp / "pilot.md")
    ran = [ctx.record.invocations[-1]["ran"]]
    for _ in range(2):
        ctx = open_study(study.STUDY, out, grid=TINY, command="test", workers=1)
        run_study(study.STUDY, ctx, report)
        ran.append(ctx.record.invocations[-1]["ran"])
    return out, report, ran


def test_the_grid_runs_through_the_framework_and_a_second_call_runs_nothing(done: Any) -> None:
    out, report, ran = done
    assert [j.name for j in study.jobs(open_study(study.STUDY, out, grid=TINY))] == NAMES
    assert ran == [len(PILOT_NAMES), len(NAMES) - len(PILOT_NAMES), 0]
    record = json.loads((out / "study.json").read_text())
    assert {n: record["jobs"][n]["status"] for n in NAMES} == dict.fromkeys(NAMES, "done")
    assert "did not finish" not in report.read_text()
    probe = json.loads((out / "prompts" / "result.json").read_text())["result"]
    tried = probe["templates"]["Write a {code} review."]
    assert tried["prompt_whole"] and tried["on_code"]["n"] == 2 * TINY.probe_samples
    assert "`Write a {code} review.`" in report.read_text()
    main = RunView(out / "strong1").config  # the main grid's DP-SGD, not the pilot's
    assert main["train"]["optimizer"] == "sgd" and main["task"]["lora"]["freeze_a"]
    assert "Signal check (main grid): the first-round update norm of 1 strong over 2" in (
        report.read_text()
    )


def test_each_generator_stops_once_its_pool_is_generated_and_saved(done: Any) -> None:
    out, _, _ = done
    for strong in TINY.generators:
        folder = out / study.pool_name(strong)
        rounds = TINY.train_rounds if strong else 0
        rows = jsonl_rows(folder / "metrics.jsonl")
        assert [r["round"] for r in rows] == list(range(rounds + 2))  # profile .. generation
        pool = jsonl_rows(folder / "artefacts" / "synthetic_initial.jsonl")
        profile = json.loads((folder / "artefacts" / "profile.json").read_text())
        assert len(pool) == sum(profile["allotment"]) and abs(len(pool) - TINY.pool) <= 1
        assert all(isinstance(r["truncated"], bool) for r in pool)
        assert rows[-1]["truncated"] == pytest.approx(np.mean([r["truncated"] for r in pool]))
        assert not (folder / "artefacts" / "synthetic.jsonl").exists()
        assert not (folder / "artefacts" / "votes.json").exists()
        assert {a["kind"] for a in jsonl_rows(folder / "audit.jsonl")} <= {"profile", "train"}
        ledger = json.loads((folder / "privacy.json").read_text())
        assert not any("vote" in m for m in ledger["mechanisms"])
        assert json.loads((folder / "summary.json").read_text())["rounds"] == rounds + 1
        norms = [r.get("update_norm") for r in rows[1 : rounds + 1]]
        assert all(n is not None and n > 0 for n in norms)  # DP-SGD moved the adapter


def test_offline_voting_is_the_algorithms_vote_round(tmp_path: Path) -> None:
    """The study's functions, given the run's seeded noise, give the run's votes and set."""
    cfg = study.generator_config(TINY, 1)
    cfg.update(name="whole", out_dir=str(tmp_path), rounds=TINY.train_rounds + 2)
    cfg["privacy"]["noise"] = "seeded"
    run(load_config(cfg), progress=False)
    folder = tmp_path / "whole"
    emb = study.embed_real({}, tmp_path / "emb", cfg)
    assert emb["train_rows"] == TINY.clients * TINY.rows
    arrays = dict(np.load(tmp_path / "emb" / study.EMBEDDINGS))
    pool = study._read_pool(folder)
    from fedfm.models.encoders import text_embedder

    pool_emb = text_embedder("hashed-ngrams")([r["text"] for r in pool.rows])
    weak = study.voters(TINY, 1)
    clean = study.clean_votes(arrays, pool_emb, pool.codes, TINY.k, weak)
    sigma = analytic_gaussian_sigma(float(cfg["algo"]["epsilon_vote"]), cfg["privacy"]["delta"])
    vote_round = TINY.train_rounds + 2
    seeds = {c: derive_seed(TINY.seed, vote_round, c, "vote-noise") for c in weak}
    total = study.noisy_total(clean, sigma, seeds, TINY.threshold)
    saved = json.loads((folder / "artefacts" / "votes.json").read_text())
    assert total.tolist() == pytest.approx(saved["clipped"])
    rng = np.random.default_rng(derive_seed(TINY.seed, "resample"))
    kept = study.selections(total, pool.codes, pool.allotment, TINY.size, rng, "votes")
    final = jsonl_rows(folder / "artefacts" / "synthetic.jsonl")
    assert kept == [r["source_id"] for r in final]


def test_the_four_selections_keep_each_codes_share() -> None:
    codes = np.array([0] * 6 + [1] * 4)
    votes = np.array([0.0, 0.0, 9.0, 1.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0])
    allotment, size = [6, 4], 5  # code 0 keeps round(3) = 3, code 1 round(2) = 2
    for kind in ("votes", "uniform", "top", "subset"):
        kept = study.selections(votes, codes, allotment, size, np.random.default_rng(0), kind)
        assert [int(codes[i]) for i in kept].count(0) == 3 and len(kept) == 5
    top = study.selections(votes, codes, allotment, size, np.random.default_rng(0), "top")
    assert top == [0, 2, 3, 6, 7]  # the most votes of each code, ties to the lower index
    for s in range(20):
        sub = study.selections(None, codes, allotment, size, np.random.default_rng(s), "subset")
        assert len(set(sub)) == 5  # without replacement
        by = study.selections(votes, codes, allotment, size, np.random.default_rng(s), "votes")
        assert set(by) <= {2, 3, 7}  # only voted samples
    # A uniform draw with replacement is the algorithm's draw given equal votes.
    cfg = DPSynConfig(num_samples=10, resample_size=size)
    rng = np.random.default_rng(7)
    mine = study.selections(None, codes, allotment, size, rng, "uniform")
    assert mine == select(np.zeros(10), codes, allotment, cfg, seed=7)[0]


def test_readouts_pair_the_saved_predictions_over_seeds_and_rows(done: Any) -> None:
    out, report, _ = done
    res = study.read(open_study(study.STUDY, out, grid=TINY))
    assert set(res.votes) == set(TINY.generators) and res.y is not None
    preds = np.load(out / "vote-strong1" / study.PREDICTIONS)
    a, b = preds["votes/1"], preds["uniform"]
    assert a.shape == (TINY.seeds, TINY.test_rows)
    d = (a == res.y).astype(float) - (b == res.y).astype(float)
    est = study.acc_diff(res, (1, "votes/1"), (1, "uniform"))
    assert est.mean == pytest.approx(d.mean()) and est.n == d.size
    want = math.sqrt(d.mean(1).var(ddof=1) / TINY.seeds + d.mean(0).var(ddof=1) / d.shape[1])
    assert est.se == pytest.approx(want)
    text = report.read_text()
    first = text.index("## Readouts")
    assert text.index("## Setup") > first  # the report opens with its readouts
    readouts = study.readouts(TINY)
    assert len(readouts) == 1 + 2 * len(TINY.epsilon_votes) + 1 + len(TINY.epsilon_votes)
    line = next(x for x in text.splitlines() if x.startswith("| R3 |"))
    assert est.fmt(signed=True) in line
    sel = res.votes[1]["selections"]
    assert len(sel["subset"]["distinct"]) == TINY.seeds
    assert all(n == TINY.size for n in sel["subset"]["distinct"])
    assert all(n <= TINY.size for n in sel["uniform"]["distinct"])


def test_the_claim_is_untestable_when_the_premise_fails(done: Any) -> None:
    out, _, _ = done
    res = study.read(open_study(study.STUDY, out, grid=TINY))
    rs = study.readouts(TINY)
    premise, claim = rs[1 + 2 * len(TINY.epsilon_votes)], rs[-1]
    for each in rs[2 * len(TINY.epsilon_votes) + 2 :]:  # every claim names the premise's row
        assert f"(R{2 * len(TINY.epsilon_votes) + 2})" in str(each.scope)
    holds = study.verdict(premise.value(res), +1) == study.IN_DIRECTION
    _, word = claim.judge(res)
    assert (word == "cannot be tested by this grid") == (not holds)
    fake = study.Results(TINY, y=np.array([0, 1, 0, 1]))
    fake.preds = {
        1: {"subset": np.array([[0, 1, 0, 1], [0, 1, 0, 0]]), "votes/1": np.ones((2, 4))},
        2: {"subset": np.array([[1, 0, 1, 0], [1, 0, 1, 1]])},  # many strong: worse
    }
    assert claim.judge(fake)[1] == "cannot be tested by this grid"
    fake.preds[2]["subset"], fake.preds[1]["subset"] = (
        fake.preds[1]["subset"],
        fake.preds[2]["subset"],
    )
    assert claim.judge(fake)[1] != "cannot be tested by this grid"


def test_the_pilot_runs_first_without_dp_and_opens_the_report(done: Any) -> None:
    out, _, _ = done
    pilot_page = (out.parent / "pilot.md").read_text()
    assert "The main grid has not run" in pilot_page
    assert pilot_page.index("## The premise pilot (R1)") < pilot_page.index("## Setup")
    for s in TINY.strong:
        cfg = json.loads(json.dumps(study.pilot_config(TINY, s)))
        assert cfg["algo"]["epsilon_train"] == "inf"
        saved = study.RunView(out / study.pilot_name(s)).config
        assert saved["algo"]["epsilon_train"] == "inf"  # the run that ran: no clipping, no noise
    got = json.loads((out / "pilot" / "result.json").read_text())["result"]
    y = np.load(out / "embed" / study.EMBEDDINGS)["test/y"]
    few, many = (
        np.load(out / f"vote-pilot-strong{s}" / study.PREDICTIONS)["subset"] for s in (1, 2)
    )
    w = len(y) / (2 * np.bincount(y)[y])  # N / (C · n_c)
    d = ((many == y) - (few == y).astype(float)) * w
    assert got["difference"]["mean"] == pytest.approx(d.mean())
    assert got["mde"] == pytest.approx(2 * got["difference"]["se"])
    res = study.read(open_study(study.STUDY, out, grid=TINY))
    first = study.readouts(TINY)[0]
    assert first.value(res).mean == pytest.approx(d.mean())


def test_the_main_generators_wait_for_the_pilot_to_hold() -> None:
    class View:
        def __init__(self, result: Any) -> None:
            self.result = result

    gated = Grid(**{**vars(TINY), "gated": True})
    fails = {"holds": False, "difference": {"mean": -0.01, "se": 0.02, "n": 10}}
    with pytest.raises(study.Unmet, match="cannot be tested at this scale"):
        study._pilot_holds(gated, 1, {study.PILOT: View(fails)})  # type: ignore[dict-item]
    with pytest.raises(study.Unmet):
        study._pilot_holds(gated, 1, {study.PILOT: View(None)})  # type: ignore[dict-item]
    holds = {**fails, "holds": True}
    cfg = study._pilot_holds(gated, 1, {study.PILOT: View(holds)})  # type: ignore[dict-item]
    assert cfg == study.main_config(gated, 1)


def test_privacy_composes_the_runs_ledger_with_the_offline_vote(done: Any) -> None:
    out, _, _ = done
    res = study.read(open_study(study.STUDY, out, grid=TINY))
    run_ledger = json.loads((out / "strong1" / "privacy.json").read_text())
    for eps, p in res.votes[1]["privacy"].items():
        assert (
            p["mechanisms"]["dp-sgd:train"]
            == run_ledger["mechanisms"]["dp-sgd:train"]["epsilon_max"]
        )
        assert p["weak"] > p["mechanisms"]["analytic-gaussian:profile"]  # profile + vote
        assert p["mechanisms"]["analytic-gaussian:vote"] == pytest.approx(float(eps), rel=0.3)
        assert p["strong"] == pytest.approx(run_ledger["run"]["epsilon"])  # strong never vote


def test_every_generator_of_the_default_grids_is_a_valid_config() -> None:
    for grid in (QUICK, FULL):
        for strong in grid.generators:
            cfg = load_config(study.generator_config(grid, strong))
            assert cfg.rounds == (grid.train_rounds if strong else 0) + 1
            assert cfg.algo["num_samples"] == grid.pool > grid.size
        assert len(study.voters(grid, grid.few)) == grid.clients - grid.few
        assert len(study.voters(grid, 0)) == grid.clients - grid.few  # base: the same voters
        for strong in grid.strong:  # the main grid's DP-SGD; the pilot keeps the earlier one
            main = load_config(study.main_config(grid, strong))
            assert (main.train.optimizer, main.train.momentum, main.train.batch_size) == (
                "sgd",
                0.9,
                64,
            )
            assert main.task["lora"]["freeze_a"] and main.task["lora"]["r"] == 1
            pilot = load_config(study.pilot_config(grid, strong))
            assert (pilot.train.optimizer, pilot.train.batch_size) == ("adamw", grid.batch_size)
        assert study.main_config(grid, 0) == study.generator_config(grid, 0)


def test_the_study_is_registered() -> None:
    load_studies()
    assert STUDIES.get("dpsyn") is study.STUDY
