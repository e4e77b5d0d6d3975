"""FedSDR and FedSD on a tiny Llama: the rewrite filter, the stages, the selective upload,
resume, the rewrite cache, and the comparisons across runs."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedfm.algorithms.fedsdr import FedSDR, R, S, train_stage
from fedfm.algorithms.rewrite import (
    REWRITE_SYSTEM,
    REWRITE_TEMPLATE,
    RewriteCache,
    cache_key,
    fallback_reason,
    reasoning_words,
    refine_rows,
    rewrite_prompts,
    summarise_rewrites,
    teacher_digest,
)
from fedfm.config import load_config
from fedfm.engine import build, resolve
from fedfm.errors import ConfigError
from fedfm.eval.compare import (
    js_divergence,
    read_items,
    tfidf_cosine,
    update_cosines,
    win_rate,
    win_rate_runs,
    win_rate_table,
)
from fedfm.fm import FoundationModel
from fedfm.models.generation import GenerationConfig, Reply
from fedfm.runtime import run as run_experiment
from helpers.bases import FEDSDR, fedsdr_algo
from helpers.config import make_config


def _echo_teacher(monkeypatch: pytest.MonkeyPatch, calls: list[int] | None = None) -> None:
    """A teacher that restates the reference with filler words (the tiny model's own rewrites
    are empty): rewrites are kept, so the distilled set differs from the raw one."""

    def generate(self: FoundationModel, prompts: Sequence[str], adapters: Any, **kw: Any) -> list:
        if calls is not None:
            calls.append(len(prompts))
        refs = [
            re.search(r"### Reference Answer:\n(.*?)\n\n### Response:", str(p), re.S)
            for p in prompts
        ]
        return [Reply(f"Well, basically {m.group(1) if m else ''}", False) for m in refs]

    monkeypatch.setattr(FoundationModel, "generate_replies", generate)


def _rows(run: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / name).read_text().splitlines()]


def _metrics(run: Path) -> list[dict[str, Any]]:
    rows = _rows(run, "metrics.jsonl")
    for r in rows:
        r.pop("time_s")
    return rows


def _client_states(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    latest = run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()
    meta = json.loads((latest / "meta.json").read_text())["clients"]
    return load_file(str(latest / "clients.safetensors")), meta


# ----------------------------------------------------------------------------- the filter


MATH = {"id": 1, "metric": "gsm8k", "output": "2 + 3 = 5\n#### 5", "answer": "5", "choices": []}
MOVIE = {
    "id": 2,
    "metric": "choice",
    "output": "positive",
    "answer": "positive",
    "choices": ["negative", "positive"],
}
FREE = {"id": 3, "metric": "rouge", "output": "Paris is the capital.", "answer": "", "choices": []}


@pytest.mark.parametrize(
    ("text", "row", "reason"),
    [
        ("", FREE, "empty"),
        ("   \n", MATH, "empty"),
        ("As the Reference Answer shows, Paris.", FREE, "leak"),
        ("Here is my response: Paris.", FREE, "leak"),
        ("Now it's your turn to answer.", FREE, "leak"),
        ("Your turn! Paris.", FREE, "leak"),
        ("I wrote your own response below.", FREE, "leak"),
        ("Adding two and three gives 6.\n#### 6", MATH, "number"),
        ("Two plus three is five, so the answer is 5.", MATH, None),
        ("3 apples and 2 more: #### 5", MATH, None),
        ("The critic disliked it: negative.", MOVIE, "label"),
        ("Nothing to say.", MOVIE, "label"),  # names no label at all
        ("Positive: the critic loved it.", MOVIE, None),
        ("The capital of France is Paris.", FREE, None),
    ],
)
def test_rewrite_filter_by_hand(text: str, row: dict[str, Any], reason: str | None) -> None:
    assert fallback_reason(text, row) == reason


def test_a_rewrite_cut_by_its_token_limit_falls_back() -> None:
    # Kept as a finished text, refused as one that ran into max_new_tokens.
    assert fallback_reason("3 apples and 2 more: #### 5", MATH) is None
    assert fallback_reason("3 apples and 2 more: #### 5", MATH, truncated=True) == "truncated"
    assert fallback_reason("", MATH, truncated=True) == "empty"


JANET = {
    "id": 7,
    "domain": "math",
    "metric": "gsm8k",
    "output": "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
    "She makes 9 * 2 = $18 every day at the farmer’s market.\n#### 18",
    "answer": "18",
    "choices": [],
}
# Its reasoning words: janet sells 16 3 4 9 duck eggs a day she makes 9 2 18 every day at the
# farmer s market (22; the "#### 18" line is not reasoning); at a share of 0.5 a rewrite keeps
# its chain of thought with at least 11.


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("#### 18", "reasoning"),  # the number alone
        ("The answer is 18.", "reasoning"),  # 4 words
        ("She sells 9 eggs and makes $18.\n#### 18", "reasoning"),  # 8 words
        # 18 words: janet has 16 3 4 9 eggs left each day at 2 each she makes 9 2 18 (18 ≥ 11)
        ("Janet has 16 - 3 - 4 = 9 eggs left each day. At $2 each she makes 9 * 2 = $18.\n"
         "#### 18", None),
        # the number check comes first: a long rewrite with the wrong number
        ("Janet has 16 - 3 - 4 = 9 eggs left each day. At $2 each she makes 9 * 3 = $27.\n"
         "#### 27", "number"),
    ],
)  # fmt: skip
def test_math_rewrites_keep_their_reasoning_by_hand(text: str, reason: str | None) -> None:
    """The acceptance rule of ours (``algo.fedsd.keep_reasoning``): a GSM8K rewrite with the
    right number but without the reference's chain of thought falls back; off, it is kept."""
    assert len(reasoning_words(JANET["output"])) == 22
    assert fallback_reason(text, JANET, keep_reasoning=0.5) == reason
    assert fallback_reason(text, JANET) == (None if reason == "reasoning" else reason)
    # GSM8K's calculator annotations restate a step and are not counted
    assert reasoning_words("48/2 = <<48/2=24>>24 clips\n#### 24") == ["48", "2", "24", "clips"]
    # only maths has a reasoning check
    assert fallback_reason("Paris.", FREE, keep_reasoning=5.0) is None


def test_refine_rows_counts_the_reasoning_fallbacks() -> None:
    texts: list[Reply | str | None] = [
        "The answer is 18.",
        "Janet has 16 - 3 - 4 = 9 eggs left each day. At $2 each she makes 9 * 2 = $18.",
    ]
    rows = [JANET, {**JANET, "id": 8}]
    kept, stats = refine_rows(rows, texts, keep_reasoning=0.5)
    assert kept == {"8": texts[1]} and stats.fallbacks["reasoning"] == 1
    # both kept the answer: the rule is about the reasoning, not the number
    assert stats.total("checked") == stats.total("answer_kept") == 2
    pooled = summarise_rewrites([stats.meta()])
    assert pooled["fallback_reasoning/math"] == pooled["kept_share/math"] == 0.5
    assert refine_rows(rows, texts)[1].fallbacks["reasoning"] == 0  # off: the paper's filter


def test_refine_rows_statistics_by_hand() -> None:
    rows = [
        {**MATH, "domain": "math"},
        {**MOVIE, "domain": "movie"},
        {**FREE, "domain": "general"},
        {**FREE, "id": 4, "domain": "general"},
        {**FREE, "id": 5, "domain": "general"},
        {**MATH, "id": 6, "domain": "math"},
    ]
    texts: list[Reply | str | None] = [
        "Well, 2 + 3 = 5. #### 5",  # kept: 5 words vs 4 ("well 2 3 5 5" / "2 3 5 5")
        "negative",  # label
        "Really, Paris is just the capital.",  # kept: 6 words vs 4
        "",  # empty
        Reply("Paris is the", truncated=True),  # cut by the token limit
        None,  # its prompt did not fit the teacher's budget
    ]
    kept, stats = refine_rows(rows, texts)
    assert kept == {"1": texts[0], "3": texts[2]}
    assert (stats.n, stats.kept) == (6, 2)
    assert stats.fallbacks == {
        **{"empty": 1, "truncated": 1, "leak": 0, "number": 0, "label": 1},
        **{"long_prompt": 1, "reasoning": 0},
    }
    total = {k: stats.total(k) for k in ("checked", "answer_kept")}
    assert total == {"checked": 2, "answer_kept": 1}  # maths kept its number, movie did not
    # A ratio of sums, not a mean of per-row ratios: (5 + 6) / (4 + 4).
    assert stats.rates()["length_ratio"] == pytest.approx(11 / 8)
    assert stats.rates()["filler_distilled"] == pytest.approx(3 / 11)  # well, really, just
    assert stats.rates()["filler_raw"] == 0.0
    assert stats.counts["general"]["fallback_truncated"] == 1
    other = {**stats.meta(), "cached": True}
    pooled = summarise_rewrites([stats.meta(), other])
    assert pooled["rows"] == 12 and pooled["kept_share"] == pytest.approx(4 / 12)
    assert pooled["fallback_long_prompt"] == pooled["fallback_truncated"] == pytest.approx(2 / 12)
    assert pooled["length_ratio"] == pytest.approx(11 / 8)
    # Per domain: maths kept 1 of 2 (the other's prompt was too long), general 1 of 3.
    assert pooled["kept_share/math"] == 0.5 and pooled["fallback_long_prompt/math"] == 0.5
    assert pooled["kept_share/general"] == pytest.approx(1 / 3)
    assert pooled["length_ratio/general"] == pytest.approx(6 / 4)
    assert pooled["answer_kept/movie"] == 0.0 and pooled["cached_clients"] == 1.0


def test_rewrite_prompts_are_whole_or_fall_back() -> None:
    fm = FoundationModel("tiny-llama", args=FEDSDR["task"]["model_args"])
    short = {"id": 0, "instruction": "Say it.", "input": "", "output": "word " * 20}
    long = {"id": 1, "instruction": "Say it.", "input": "", "output": "word " * 400}
    whole, n = fm.full_prompt(
        REWRITE_TEMPLATE,
        {"instruction": "Say it.", "reference": long["output"]},
        system=REWRITE_SYSTEM,
    )
    prompts = rewrite_prompts(fm, [short, long], budget=n - 1)
    assert prompts[1] is None  # one token over: no rewrite, never a reference cut in two
    assert prompts[0] is not None and short["output"] in prompts[0]
    assert prompts[0].endswith("### Response:\n<|im_end|>\n<|im_start|>assistant\n")
    assert rewrite_prompts(fm, [long], budget=n) == [whole]
    assert REWRITE_TEMPLATE.endswith("### Response:\n")


def test_the_refinery_counts_cut_rewrites_and_long_prompts(tmp_path: Path) -> None:
    # The tiny model never emits its end-of-turn token in 2 tokens: every rewrite is cut.
    algo = fedsdr_algo(tmp_path / "cache")
    algo["fedsd"] |= {"decoding": {"max_new_tokens": 2}, "max_prompt_length": 300}
    run_experiment(
        load_config(
            make_config(FEDSDR, tmp_path, name="cut", algorithm="fedsdr", algo=algo, rounds=1)
        ),
        progress=False,
    )
    first = _metrics(tmp_path / "cut")[0]
    assert first["fedsd/kept_share"] == 0.0
    reasons = ("truncated", "long_prompt", "empty")
    assert sum(first[f"fedsd/fallback_{r}"] for r in reasons) == pytest.approx(1.0)
    # With the tiny test tokenizer, every worked maths solution makes a prompt beyond 300
    # tokens (417 to 663), one Alpaca answer of four does (713), no movie label does.
    assert first["fedsd/fallback_long_prompt/math"] == 1.0
    assert first["fedsd/fallback_long_prompt/general"] == 0.25
    assert first["fedsd/fallback_long_prompt/movie"] == 0.0
    assert first["fedsd/fallback_truncated/movie"] + first["fedsd/fallback_empty/movie"] == 1.0


# ----------------------------------------------------------------------------- the stages


def test_each_stage_trains_only_its_adapter_with_both_active(tmp_path: Path) -> None:
    setup = build(
        load_config(
            make_config(
                FEDSDR,
                tmp_path,
                name="stages",
                algorithm="fedsdr",
                algo=fedsdr_algo(tmp_path / "cache"),
            )
        )
    )
    algo, task = setup.algo, setup.task
    assert isinstance(algo, FedSDR)
    fm = algo.fm
    fm.load_adapter(S, None, seed=1)
    seen: list[tuple[list[str], list[str]]] = []
    loss = task.loss

    def spy(model: Any, batch: Any) -> Any:
        seen.append((sorted(fm.active), fm.trainable))
        return loss(model, batch)

    task.loss = spy  # type: ignore[method-assign]
    cfg = setup.cfg.train
    data = task.client_data(task.client_ids()[0])
    for stage, other in ((S, R), (R, S)):
        before = {a: fm.get_adapter(a) for a in (R, S)}
        train_stage(fm, stage, task.batches(data, 4, 0), task, cfg, 3)
        after = {a: fm.get_adapter(a) for a in (R, S)}
        assert any(not torch.equal(before[stage][k], after[stage][k]) for k in after[stage])
        assert all(torch.equal(before[other][k], after[other][k]) for k in after[other])
    assert seen == [(sorted([R, S]), [S])] * 3 + [(sorted([R, S]), [R])] * 3


# ----------------------------------------------------------------------------- selective upload


def test_only_lora_r_leaves_and_uplink_equals_fedit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm.core.audit import AuditLedger

    _echo_teacher(monkeypatch)
    sent: list[dict[str, torch.Tensor]] = []
    record = AuditLedger.record

    def spy(
        self: AuditLedger, rnd: int, client: str, direction: str, msg: Any, coded: Any = None
    ) -> int:
        if direction == "up":
            sent.extend(msg.arrays.values())
        return record(self, rnd, client, direction, msg, coded)

    monkeypatch.setattr(AuditLedger, "record", spy)
    run_experiment(
        load_config(
            make_config(
                FEDSDR,
                tmp_path,
                name="sdr",
                algorithm="fedsdr",
                algo=fedsdr_algo(tmp_path / "cache"),
            )
        ),
        progress=False,
    )
    sdr_sent, sent[:] = list(sent), []
    run_experiment(
        load_config(make_config(FEDSDR, tmp_path, name="fedit", algorithm="fedavg", algo={})),
        progress=False,
    )

    sdr, fedit = tmp_path / "sdr", tmp_path / "fedit"
    audit = [
        a for a in _rows(sdr, "audit.jsonl") if a["direction"] == "up" and a["type"] == "arrays"
    ]
    assert {a["field"] for a in audit} == {"params"} and {a["kind"] for a in audit} == {"train"}
    # Per round, exactly FedIT's uplink tensor bytes (round 0: statistics only, no tensor).
    up_sdr = [r["bytes_up_arrays"] for r in _metrics(sdr)]
    up_fedit = [r["bytes_up_arrays"] for r in _metrics(fedit)]
    assert up_sdr == up_fedit and up_sdr[0] == 0 and up_sdr[1] > 0
    # No tensor of any client's LoRA-S was ever sent; each client keeps its own.
    states, _ = _client_states(sdr)
    lora_s = {k: v for k, v in states.items() if "::lora_s/" in k}
    assert len(lora_s) == 3 * len(sdr_sent[0])
    assert all(float(v.abs().sum()) > 0 for k, v in lora_s.items() if "lora_B" in k)
    for v in lora_s.values():
        assert not any(torch.equal(v, u) for arrays in sdr_sent for u in arrays.values())
    # Both runs kept their items: the head-to-head of the two runs on the same items.
    w = win_rate_runs(sdr, fedit)
    assert w["n"] == len(read_items(fedit)) and w["wins"] + w["ties"] + w["losses"] == w["n"]
    assert win_rate_table([fedit, sdr]) is not None
    from fedfm.report import compare

    assert f"| {sdr.name} | {fedit.name} | {w['wins']:.0f} |" in compare([fedit, sdr])


@pytest.mark.parametrize("opt", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_fedsdr_runs_with_every_server_optimizer(tmp_path: Path, opt: str) -> None:
    algo = {**fedsdr_algo(tmp_path / "cache", server_opt={"name": opt, "lr": 0.01}, prox_mu=0.1)}
    algo.update(steps_s=1, steps_r=1)
    run_experiment(
        load_config(
            make_config(FEDSDR, tmp_path, name=opt, algorithm="fedsdr", algo=algo, rounds=1)
        ),
        progress=False,
    )
    rows = _metrics(tmp_path / opt)
    assert (
        rows[-1]["clients"] == 3
        and rows[-1]["failed"] == 0
        and math.isfinite(rows[-1]["train_loss"])
    )


# ----------------------------------------------------------------------------- resume


def test_resume_restores_lora_s_and_the_distilled_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _echo_teacher(monkeypatch)
    algo = fedsdr_algo(tmp_path / "cache")
    algo["fedsd"]["cache"] = False
    run_experiment(
        load_config(
            make_config(FEDSDR, tmp_path, name="straight", algorithm="fedsdr", algo=algo, rounds=3)
        ),
        progress=False,
    )

    round_ = FedSDR.round

    def dies_in_round_2(self: FedSDR, fed: Any) -> dict[str, float]:
        if fed.rnd == 2:
            raise KeyboardInterrupt
        return round_(self, fed)

    monkeypatch.setattr(FedSDR, "round", dies_in_round_2)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(
            load_config(
                make_config(
                    FEDSDR, tmp_path, name="killed", algorithm="fedsdr", algo=algo, rounds=3
                )
            ),
            progress=False,
        )
    states, meta = _client_states(tmp_path / "killed")
    assert {k.split("::")[1].split("/")[0] for k in states} == {"lora_s"}
    outputs = {c: m["fedsd"]["outputs"] for c, m in meta.items()}
    assert all(
        o and all(t.startswith("Well, basically") for t in o.values()) for o in outputs.values()
    )

    monkeypatch.setattr(FedSDR, "round", round_)

    def no_teacher(*args: Any, **kw: Any) -> list[str]:
        raise AssertionError("the refinery ran again on resume")

    monkeypatch.setattr(FoundationModel, "generate_replies", no_teacher)
    run_experiment(
        load_config(
            make_config(FEDSDR, tmp_path, name="killed", algorithm="fedsdr", algo=algo, rounds=3)
        ),
        resume=True,
        progress=False,
    )
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "straight")


# ----------------------------------------------------------------------------- FedSD and its cache


def test_fedsd_on_fedavg_family_trains_on_rewrites_and_hits_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    _echo_teacher(monkeypatch, calls)
    cache = str(tmp_path / "cache")
    fedsd = {"enabled": True, "decoding": {"max_new_tokens": 8}, "cache_dir": cache}
    run_experiment(
        load_config(
            make_config(
                FEDSDR, tmp_path, name="a", algorithm="fedavg", algo={"fedsd": fedsd}, rounds=1
            )
        ),
        progress=False,
    )
    assert len(calls) == 3  # one generation per client
    first = _metrics(tmp_path / "a")[0]
    assert first["fedsd/cached_clients"] == 0 and first["fedsd/kept_share"] > 0.5
    assert first["bytes_up_arrays"] == 0  # only statistics leave the clients
    stats = json.loads((tmp_path / "a" / "artefacts" / "fedsd" / "rewrite_stats.json").read_text())
    assert set(stats["clients"]) == {"0", "1", "2"}
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3

    # Another run with the same model, data and decoding (other optimizer, FedProx, SCAFFOLD,
    # or FedSDR) pays nothing: every client's rewrites come from the cache.
    for name, algorithm, extra in [
        ("b", "fedprox", {"mu": 0.1}),
        ("c", "scaffold", {}),
        ("d", "fedsdr", None),
    ]:
        algo = {"fedsd": fedsd, **extra} if extra is not None else fedsdr_algo(tmp_path / "cache")
        run_experiment(
            load_config(
                make_config(FEDSDR, tmp_path, name=name, algorithm=algorithm, algo=algo, rounds=1)
            ),
            progress=False,
        )
        rows = _metrics(tmp_path / name)
        assert rows[0]["fedsd/cached_clients"] == 3 and rows[-1]["failed"] == 0, name
    assert len(calls) == 3

    # FedSD trains on the rewrites: with them disabled the same run learns something else.
    run_experiment(
        load_config(
            make_config(FEDSDR, tmp_path, name="raw", algorithm="fedavg", algo={}, rounds=1)
        ),
        progress=False,
    )
    assert (
        _metrics(tmp_path / "raw")[-1]["train_loss"] != _metrics(tmp_path / "a")[-1]["train_loss"]
    )


def test_cache_key_and_atomic_files(tmp_path: Path) -> None:
    fm = FoundationModel("tiny-llama", args=FEDSDR["task"]["model_args"])
    rows = [{"id": 1, "instruction": "a", "input": "", "output": "b"}]
    greedy = GenerationConfig()
    key = cache_key(fm, rows, greedy, "base", seed=1)
    assert key == cache_key(fm, rows, greedy, "base", seed=2)  # greedy ignores the seed
    sampled = GenerationConfig(do_sample=True)
    assert cache_key(fm, rows, sampled, "base", 1) != cache_key(fm, rows, sampled, "base", 2)
    assert key != cache_key(fm, rows, GenerationConfig(max_new_tokens=9), "base", 1)
    assert key != cache_key(fm, [{**rows[0], "output": "c"}], greedy, "base", 1)
    assert key != cache_key(fm, rows, greedy, "abc", 1)
    assert key != cache_key(fm, rows, greedy, "base", 1, prompt_budget=100)
    cache = RewriteCache(tmp_path / "cache")
    assert cache.get(key) is None
    replies = [Reply("x", False), None, Reply("y", True)]
    cache.put(key, replies)
    assert cache.get(key) == replies
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{key}.json"]  # no temp file left
    cache.path(key).write_text("{torn")
    assert cache.get(key) is None
    zero = {"a.lora_A.weight": torch.ones(2, 2), "a.lora_B.weight": torch.zeros(2, 2)}
    assert teacher_digest(zero) == "base"
    assert teacher_digest({**zero, "a.lora_B.weight": torch.ones(2, 2)}) != "base"


# ----------------------------------------------------------------------------- config errors


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algo\.steps_s"):
        resolve(
            load_config(
                make_config(FEDSDR, tmp_path, name="x", algorithm="fedsdr", algo={"steps_s": 0})
            )
        )
    with pytest.raises(ConfigError, match=r"algo\.steps_r"):
        resolve(
            load_config(
                make_config(FEDSDR, tmp_path, name="x", algorithm="fedsdr", algo={"steps_r": 0})
            )
        )
    bad = {"fedsd": {"keep_reasoning": 0}}
    with pytest.raises(ConfigError, match=r"algo\.fedsd\.keep_reasoning"):
        resolve(load_config(make_config(FEDSDR, tmp_path, name="x", algorithm="fedsdr", algo=bad)))
    tabular = {"name": "t", "algorithm": "fedsdr", "task": {"kind": "tabular"}}
    with pytest.raises(ConfigError, match=r"task\.kind"):
        resolve(load_config(tabular))
    tabular = {**tabular, "algorithm": "fedavg", "algo": {"fedsd": {"enabled": True}}}
    with pytest.raises(ConfigError, match=r"algo\.fedsd\.enabled"):
        resolve(load_config(tabular))


# ----------------------------------------------------------------------------- comparisons


def test_win_rate_and_its_standard_error_by_hand() -> None:
    a = [{"id": i, "domain": "d", "score": s} for i, s in enumerate([1.0, 0.5, 0.0, 1.0])]
    b = [{"id": i, "domain": "d", "score": s} for i, s in enumerate([0.0, 0.5, 1.0, 0.0])]
    w = win_rate(a, b)
    assert (w["wins"], w["ties"], w["losses"]) == (2, 1, 1)
    assert w["win_rate"] == pytest.approx(2.5 / 4)  # ties count half
    outcomes = torch.tensor([1.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    assert w["se"] == pytest.approx(float(outcomes.std() / 2))


def test_answer_distribution_measures_by_hand() -> None:
    same = {"a": ["red fox"], "b": ["red fox"]}
    apart = {"a": ["red fox"], "b": ["blue whale"]}
    assert js_divergence(same) == pytest.approx(0.0)
    assert js_divergence(apart) == pytest.approx(1.0)  # disjoint: 1 bit
    # p = (1/2, 1/2, 0), q = (1/2, 0, 1/2): JS = 1/2 bit
    assert js_divergence({"a": ["x y"], "b": ["x z"]}) == pytest.approx(0.5)
    assert tfidf_cosine(same) == pytest.approx(1.0)
    assert tfidf_cosine(apart) == pytest.approx(0.0)
    mid = tfidf_cosine({"a": ["x y"], "b": ["x z"]})
    assert 0.0 < mid < 1.0
    ups = {"a": {"w": torch.tensor([1.0, 0.0])}, "b": {"w": torch.tensor([1.0, 1.0])}}
    cos = update_cosines(ups)
    assert cos["a|b"] == pytest.approx(1 / math.sqrt(2)) and cos["mean"] == cos["a|b"]


# ----------------------------------------------------------------------------- the study


def test_the_study_runs_and_reports_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from fedfm.reproduce import fedsdr as study
    from fedfm.reproduce.framework import RunView, open_study, run_jobs, run_study

    _echo_teacher(monkeypatch)
    tiny = {
        "model": "tiny-llama",
        "model_args": FEDSDR["task"]["model_args"],
        "autocast_bf16": False,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "prompt": {"max_length": 160, "max_prompt_length": 128},
    }
    grid = dataclasses.replace(
        study.QUICK,
        rounds=2,
        steps=1,
        steps_s=1,
        per_domain=3,
        seen_items=2,
        zeroshot_items=3,
        docs=3,
        doc_tokens=16,
        domains=("math", "medical", "qtype"),
        heldout=("general",),
        gated=False,  # the tiny model forgets nothing worth the name: run the whole grid
        task=tiny,
        cache_dir=str(tmp_path / "cache"),
    )
    runs = tmp_path / "fedsdr-quick"
    # The pilot alone first: FedIT (its round 0 the base) and the lengths, its page says so.
    ctx = open_study(study.STUDY, runs, quick=True, grid=grid, command="pilot", pilot=True)
    pilot_page = run_study(study.STUDY, ctx, tmp_path / "pilot.md").read_text()
    assert ctx.record.invocations[-1]["ran"] == 2 and set(ctx.record.jobs) == {"fedit", "lengths"}
    assert "The main grid has not run" in pilot_page
    assert pilot_page.index("## The premise pilot") < pilot_page.index("## Setup")
    ctx = open_study(study.STUDY, runs, quick=True, grid=grid, command="cmd")
    report = run_study(study.STUDY, ctx, tmp_path / "r.md")
    record = json.loads((runs / "study.json").read_text())
    assert set(record["jobs"]) == {*study.METHODS, "lengths", study.PERSONAL}
    assert {j["status"] for j in record["jobs"].values()} == {"done"}
    assert record["jobs"]["matched"]["needs"] == ["fedit", "fedsd"]
    text = report.read_text()
    assert text.index("## Readouts") < text.index("## Setup") and "did not finish" not in text
    # What the runs computed in, from their summaries (autocast off: float32).
    assert "these runs computed in float32)" in text
    views = {m: RunView(runs / m) for m in study.METHODS}
    # Every run logs its update norm; the control's lr is FedIT's rescaled by the norm ratio.
    norms = {m: float(v.final["update_norm"]) for m, v in views.items()}
    assert all(n > 0 for n in norms.values())
    lr = float(views["matched"].config["train"]["lr"])
    assert lr == pytest.approx(grid.lr * norms["fedsd"] / norms["fedit"])
    assert f"{norms['matched'] / norms['fedsd']:.3f}× +FedSD's" in text
    # Nothing was generated at evaluation: general and maths items carry only their NLL.
    items = views["fedsd"].items()
    general = [it for it in items if it["domain"] == "general"]
    assert general and all(it["score"] is None and it["nll_tokens"] > 0 for it in general)
    assert not any(k.startswith("truncated") for k in views["fedsd"].final)
    # The readouts' numbers, by hand from the items: +FedSD − FedIT on zero-shot balanced
    # accuracy, each domain's mean per-class recall (the test sets hold each label equally).
    res = study.read(ctx)
    per = []
    for d in grid.zeroshot:
        rows = {m: [it for it in views[m].items() if it["domain"] == d] for m in ("fedsd", "fedit")}
        refs = [it["reference"] for it in rows["fedit"]]
        assert len(set(refs)) == 2 and refs.count(refs[0]) in (1, 2)  # 3 items: 2 and 1

        def recall(its: list[dict[str, Any]]) -> float:
            labels = sorted({it["reference"] for it in its})
            hit = [[it["score"] for it in its if it["reference"] == c] for c in labels]
            return sum(sum(h) / len(h) for h in hit) / len(hit)

        per.append(recall(rows["fedsd"]) - recall(rows["fedit"]))
        labels = [it["reference"] for it in rows["fedsd"]]
        answers = [it["label"] for it in rows["fedsd"]]
        assert study.class_scores(views["fedsd"].items(), d)["bacc"] == pytest.approx(
            recall(rows["fedsd"])
        ) and study.balanced_accuracy(labels, answers) == pytest.approx(recall(rows["fedsd"]))
    got = study.diff(res, "fedsd", "fedit", "bacc", grid)
    assert got.mean == pytest.approx(sum(per) / len(per)) and got.n == 2 * grid.zeroshot_items
    r5 = next(x for x in text.splitlines() if x.startswith("| R5 |"))
    assert got.fmt(3, signed=True) in r5 and "balanced accuracy" in r5
    # The pilot's held-out instruction NLL: general items, never trained, scored by NLL only.
    held = study.diff(res, "fedit", study.BASE, "heldout", grid)
    assert held.n == grid.zeroshot_items and math.isfinite(held.mean)
    # C4 per document: the base is FedIT's round 0, paired over the same documents.
    c4 = study.diff(res, "fedit", study.BASE, "text", grid)
    assert c4.n == grid.docs and math.isfinite(c4.mean)
    r1 = next(x for x in text.splitlines() if x.startswith("| R1 |"))
    assert c4.fmt(3, signed=True) in r1
    holds = study.pilot_holds(grid, views["fedit"])
    assert text.count("**cannot be tested by this grid") == (1 if holds else 13)
    # C4's top-1 token accuracy per document, beside its NLL (the pilot's fourth readout).
    top1 = study.diff(res, "fedit", study.BASE, "top1", grid)
    assert top1.n == grid.docs and "| R4 | pilot: FedIT − base, top-1 token accuracy" in text
    docs = [it for it in views["fedit"].items() if it.get("metric") == "text_nll"]
    want = sum(it["top1"] for it in docs) / sum(it["nll_tokens"] for it in docs)
    assert views["fedit"].final["text_top1/c4_demo"] == pytest.approx(want)
    # FedSDR scored as R + S: every client's own LoRA-S with the global LoRA-R, from the
    # final checkpoint, on its own domain's seen items and on every held-out unit.
    assert sorted(res.personal) == ["0", "1", "2"]
    own = set()
    for its in res.personal.values():
        seen = {it["domain"] for it in its if not it["zeroshot"]}
        assert len(seen) == 1 and len([it for it in its if not it["zeroshot"]]) == 2
        own |= seen
        assert sum(it.get("metric") == "text_nll" for it in its) == grid.docs
        assert sum(it["domain"] in grid.zeroshot for it in its) == 2 * grid.zeroshot_items
    assert own == set(grid.domains)
    # A held-out unit's personal value is the mean over the clients' models, by hand.
    doc = docs[0]["id"]
    by_client = [
        next(it["nll"] / it["nll_tokens"] for it in its if it["id"] == doc)
        for its in res.personal.values()
    ]
    assert study.values(res, study.PERSONAL, "text", grid)[study.CORPUS][doc] == pytest.approx(
        sum(by_client) / 3
    )
    # LoRA-S changes the model: R + S is not R on the documents.
    r_alone = study.values(res, "fedsdr", "text", grid)[study.CORPUS]
    assert any(abs(v - r_alone[doc]) > 1e-7 for v in by_client)
    rs = study.diff(res, study.PERSONAL, "fedit", "bacc", grid)
    assert rs.n == 2 * grid.zeroshot_items
    line = next(x for x in text.splitlines() if "| FedSDR R + S (personal) − FedIT, zero" in x)
    assert rs.fmt(3, signed=True) in line and "FedSDR R + S (personal) |" in text
    fid = study.diff(res, study.PERSONAL, "fedsd", "fidelity", grid)
    assert fid.n == grid.seen_items * len(grid.domains)
    # The instrument: label histograms with their baselines, reference lengths, fallbacks.
    assert "| base (round 0) |" in text and "answered ham" in text and "majority" in text
    assert "| train | math |" in text and "fallback truncated" in text
    zero = views["fedsd"].rounds[0]
    n = zero["fedsd/rows"]
    assert f"| all | {n:.0f} | {n * zero['fedsd/kept_share']:.0f} |" in text
    # A second call finds every job done and runs nothing.
    again = open_study(study.STUDY, runs, quick=True, grid=grid, command="cmd")
    run_jobs(study.STUDY, again)
    assert again.record.invocations[-1]["ran"] == 0 and not again.failed
    # Gated, a pilot without forgetting holds the main runs back.
    monkeypatch.setattr(study, "pilot_holds", lambda *_: False)
    with pytest.raises(study.Unmet, match="no forgetting"):
        study._after_pilot(
            dataclasses.replace(grid, gated=True), "fedsd", {"fedit": views["fedit"]}
        )


def test_the_pilots_config_does_not_depend_on_the_main_grids_options() -> None:
    """FedIT (the pilot) and the control run without the rewrite acceptance rule; +FedSD and
    FedSDR get it, so a pilot run stays valid whatever the main grid's rule is."""
    import dataclasses

    from fedfm.reproduce import fedsdr as study

    off = dataclasses.replace(study.FULL, keep_reasoning=None)
    for method in ("fedit", "matched"):
        assert study.job_config(study.FULL, method) == study.job_config(off, method)
        assert "keep_reasoning" not in study.job_config(study.FULL, method)["algo"]["fedsd"]
    assert study.job_config(study.FULL, "fedsd")["algo"]["fedsd"]["keep_reasoning"] == 0.5
    assert study.job_config(study.FULL, "fedsdr")["algo"]["fedsd"]["keep_reasoning"] == 0.5
    assert "keep_reasoning" not in study.job_config(off, "fedsdr")["algo"]["fedsd"]


def test_fedsd_has_one_key_and_fedsdr_reads_its_old_name(tmp_path: Path) -> None:
    """FedSDR and the FedAvg family take FedSD's settings under ``algo.fedsd``; FedSDR's old
    key ``algo.refinery`` is read as the same settings; both at once, or FedSD off, is refused."""
    fedsd = {"decoding": {"max_new_tokens": 8}, "cache_dir": str(tmp_path / "cache")}

    def algo_of(algorithm: str, algo: dict[str, Any]) -> Any:
        cfg = make_config(FEDSDR, tmp_path, name="k", algorithm=algorithm, algo=algo, rounds=1)
        return resolve(load_config(cfg))[0]

    new = algo_of("fedsdr", {"fedsd": fedsd})
    old = algo_of("fedsdr", {"refinery": fedsd})
    assert new == old and new.fedsd.enabled and new.fedsd.decoding.max_new_tokens == 8
    same = algo_of("fedavg", {"fedsd": {**fedsd, "enabled": True}}).fedsd
    assert same.model_dump() == new.fedsd.model_dump()
    assert not algo_of("fedavg", {}).fedsd.enabled
    for bad in ({"fedsd": fedsd, "refinery": fedsd}, {"fedsd": {**fedsd, "enabled": False}}):
        with pytest.raises(ConfigError, match="algo"):
            algo_of("fedsdr", bad)
    with pytest.raises(ConfigError, match="algo"):
        algo_of("fedavg", {"refinery": fedsd})  # the old name is FedSDR's only


def test_the_commands_that_finish_the_study_follow_its_parts() -> None:
    """One command per part still to run, in the order the parts must run."""
    from fedfm.reproduce import fedsdr as study
    from fedfm.reproduce.framework import open_study

    assert study.finish_commands(["matched", study.PERSONAL]) == (
        "`fedfm reproduce fedsdr --part fedsdr`, then `fedfm reproduce fedsdr --part personal`"
    )
    assert study.finish_commands(["fedit"]) == "`fedfm reproduce fedsdr --pilot`"
    # Every job is in one of the parts, and needs only jobs of its part or an earlier one.
    jobs = study.jobs(open_study(study.STUDY, Path("unused"), quick=True))
    order = {j.name: study.PARTS.index(j.part) for j in jobs}  # ValueError: a job outside PARTS
    assert {j.part for j in jobs} == set(study.PARTS)
    assert all(order[n] <= order[j.name] for j in jobs for n in j.needs)
