"""FedSDR reproduction study (ICML 2026, arXiv 2605.18028; METHODS.md section 1): does FedSD
keep more general ability, and is it more than moving less?

FedSD trains on the global model's own rewrites of the clients' answers; FedSDR adds a LoRA-R
trained on the raw answers, aggregated alone. The study compares FedIT, +FedSD, FedSDR and a
matched-drift FedIT (FedIT's lr rescaled once so that its update norm equals +FedSD's), all
scored by likelihood only on the instruction suite: zero-shot label accuracy on domains no
client trains on, the NLL of held-out C4 text (kept ability) and the references' NLL of the
trained domains (fidelity), each difference paired over items (the report's setup has the
grid).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.analyze import REWRITE_KEYS, distribution_analysis, update_cosine_rows
from fedfm.reproduce.framework import (
    Compute,
    Context,
    Job,
    Readout,
    Run,
    RunView,
    Study,
    Unmet,
    preset,
    register,
)
from fedfm.reproduce.stats import NONE, Estimate, mean_of, paired
from fedfm.reproduce.tables import DASH, blocks, marked, num, table

METHODS = ("fedit", "fedsd", "fedsdr", "matched")
LABELS = {
    "base": "base (round 0)",
    "fedit": "FedIT",
    "fedsd": "+FedSD",
    "fedsdr": "FedSDR",
    "matched": "matched-drift FedIT",
}
BASE = "base"  # FedIT's round-0 evaluation: the untrained model
CORPUS = "c4_demo"
PAPER_JS = (0.4074, 0.3611)
PAPER_TFIDF = (0.6362, 0.7064)


@dataclass(frozen=True)
class Grid:
    """A study grid.

    Attributes:
        rounds: Communication rounds.
        steps: Local steps per round of FedIT and +FedSD, and of FedSDR's LoRA-R (raw).
        steps_s: FedSDR's LoRA-S steps per round (on the rewrites), before its LoRA-R steps.
        lr: Local learning rate (AdamW) of every method but the matched-drift control.
        per_domain: Training items per client (one client per trained domain).
        seen_items: Held-out items evaluated per trained domain (fidelity).
        zeroshot_items: Test items per domain no client trains on (kept ability).
        docs: C4 documents scored (their first ``doc_tokens`` tokens).
        doc_tokens: Tokens scored per document.
        domains: The trained domains, one client each.
        zeroshot: The domains no client trains on.
        optimizer: The server optimizer.
        rewrite_tokens: New tokens of each FedSD rewrite.
        task: Fields replacing the task's (e.g. a tiny model in tests).
        label: Which grid it is, for the report's title.
        cache_dir: Folder of the rewrite cache; ``None``: the default.
    """

    rounds: int = 3
    steps: int = 16
    steps_s: int = 16
    lr: float = 1e-3
    per_domain: int = 32
    seen_items: int = 40
    zeroshot_items: int = 200
    docs: int = 200
    doc_tokens: int = 128
    domains: tuple[str, ...] = ("general", "math", "medical")
    zeroshot: tuple[str, ...] = ("movie", "spam")
    optimizer: str = "fedavg"
    rewrite_tokens: int = 192
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = "full grid"
    cache_dir: str | None = None


FULL = Grid()
QUICK = Grid(
    rounds=2, steps=8, steps_s=8, seen_items=24, zeroshot_items=100, docs=100, label="quick grid"
)


def job_config(grid: Grid, method: str, lr: float | None = None) -> dict[str, Any]:
    """The run config of one method (``lr`` replaces the grid's, for the matched control)."""
    cfg = preset("fedsdr")
    cfg.update(rounds=grid.rounds, plots=False, eval_every=grid.rounds)
    cfg["eval_before"] = method == "fedit"  # its round 0 is the untrained base
    task = cfg["task"]
    task["source_options"].update(
        per_domain_train=grid.per_domain,
        per_domain_test=max(grid.seen_items, grid.zeroshot_items),
        domains=[*grid.domains, *grid.zeroshot],
    )
    task.update(
        train_domains=list(grid.domains),
        heldout_domains=list(grid.zeroshot),
        zeroshot_items=grid.zeroshot_items,
        max_eval=grid.seen_items * len(grid.domains),
        choice_mode="loglik",
        choice_norm="none",
        eval_ppl=True,
        likelihood_only=True,
        text_nll={"corpus": CORPUS, "docs": grid.docs, "max_tokens": grid.doc_tokens},
        primary="zeroshot/score",
        eval_batch_size=8,
    )
    task.update(copy.deepcopy(dict(grid.task)))
    cfg["clients"] = {"fraction": 1.0, "min_clients": len(grid.domains)}
    cfg["train"].update(steps=grid.steps, lr=grid.lr if lr is None else lr)
    refine = cfg["algo"]["refinery"]
    refine["decoding"]["max_new_tokens"] = grid.rewrite_tokens
    if grid.cache_dir is not None:
        refine["cache_dir"] = grid.cache_dir
    server = {"name": grid.optimizer}
    if method == "fedsdr":
        cfg["algo"].update(server_opt=server, steps_s=grid.steps_s, steps_r=grid.steps)
        cfg["algo"]["update_cosines"] = True
        return cfg
    cfg["algorithm"] = "fedavg"
    fedsd = {"enabled": method == "fedsd", **refine}
    cfg["algo"] = {"server_opt": server, "update_cosines": True, "fedsd": fedsd}
    return cfg


def matched_lr(grid: Grid, fedit: RunView, fedsd: RunView) -> tuple[float, float]:
    """The matched-drift control's lr and the norm ratio ‖Δ_FedSD‖ / ‖Δ_FedIT‖ it comes from.

    Raises:
        Unmet: A run logged no (or a zero) update norm.
    """
    a, b = fedit.final.get("update_norm"), fedsd.final.get("update_norm")
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a <= 0 or b <= 0:
        raise Unmet(f"FedIT's or +FedSD's update norm is missing ({a}, {b})")
    return grid.lr * b / a, b / a


def jobs(ctx: Context[Grid]) -> list[Job]:
    """FedIT and +FedSD; FedSDR after +FedSD (it reads the cached rewrites); the matched-drift
    control configured from FedIT's and +FedSD's measured update norms; the reference
    lengths (a measurement of the data, for the instrument check)."""
    grid = ctx.grid

    def matched(needs: Mapping[str, RunView]) -> dict[str, Any]:
        lr, _ = matched_lr(grid, needs["fedit"], needs["fedsd"])
        return job_config(grid, "matched", lr=lr)

    return [
        Run("fedit", job_config(grid, "fedit"), group="train"),
        Run("fedsd", job_config(grid, "fedsd"), group="train"),
        Run("fedsdr", job_config(grid, "fedsdr"), needs=("fedsd",), group="fedsdr"),
        Run("matched", matched, needs=("fedit", "fedsd"), group="train"),
        Compute("lengths", measure_lengths, {"config": job_config(grid, "fedit")}),
    ]


# ----------------------------------------------------------------------------- measurements


def _quantiles(values: Sequence[int]) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    return {"n": len(v), "p50": np.median(v), "p90": np.percentile(v, 90), "max": v.max()}


def measure_lengths(inputs: Mapping[str, Path], folder: Path, config: Mapping[str, Any]) -> dict:
    """Token lengths of the references (reference and end-of-turn token) per domain, of the
    training rows and the evaluated items, and the share cut by ``prompt.max_length``."""
    from fedfm.config import load_config
    from fedfm.data.prompt import fit_prompt
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS
    from fedfm.tasks.lm import InstructionTask

    run_cfg = load_config(dict(config))
    _, task_cfg = resolve(run_cfg)
    task = TASKS.get(task_cfg.kind)(task_cfg, run_cfg)
    if not isinstance(task, InstructionTask):
        raise TypeError(f"the study's task is an instruction task, not {type(task).__name__}")
    tok, prompt = task.tokenizer, task.cfg.prompt
    parts = {
        "train": [task.client_data(c).rows for c in task.client_ids()],
        "evaluated": [task.test_data().rows],
        "zero-shot": [task.test_data().heldout],
    }
    out: dict[str, Any] = {"max_length": prompt.max_length}
    for part, sets in parts.items():
        refs: dict[str, list[int]] = {}
        cut: dict[str, list[bool]] = {}
        for rows in (s for s in sets if s is not None):
            for r in rows:
                n_prompt = len(fit_prompt(tok, r["instruction"], r["input"] or "", prompt)[1])
                n = len(tok(r["output"], add_special_tokens=False)["input_ids"]) + 1
                refs.setdefault(r["domain"], []).append(n)
                cut.setdefault(r["domain"], []).append(n_prompt + n > prompt.max_length)
        out[part] = {
            d: {**_quantiles(v), "cut": float(np.mean(cut[d]))} for d, v in sorted(refs.items())
        }
    return out


# ----------------------------------------------------------------------------- reading runs


@dataclass
class Results:
    """The finished runs by method, and the reference-length measurement."""

    runs: dict[str, RunView]
    lengths: dict[str, Any] | None

    def items(self, method: str) -> list[dict[str, Any]]:
        """A method's evaluated items (the base: FedIT's round 0)."""
        if method == BASE:
            return self.runs["fedit"].items(0) if "fedit" in self.runs else []
        return self.runs[method].items() if method in self.runs else []

    def has(self, method: str) -> bool:
        """Whether the method's items are there."""
        return bool(self.items(method))


def read(ctx: Context[Grid]) -> Results:
    """The finished runs and the length measurement."""
    runs = {m: ctx.run(m) for m in METHODS if ctx.run(m).finished}
    return Results(runs, ctx.run("lengths").result)


def _per_token(it: Mapping[str, Any]) -> float:
    n = int(it.get("nll_tokens") or 0)
    return float(it["nll"]) / n if n else math.nan


def kept_acc(items: Sequence[Mapping[str, Any]], zeroshot: Sequence[str]) -> dict[str, dict]:
    """``{domain: {item id: 0/1}}``: the zero-shot label accuracy of each held-out item."""
    out: dict[str, dict[Any, float]] = {d: {} for d in zeroshot}
    for it in items:
        if it.get("zeroshot") and it["domain"] in out and it.get("score") is not None:
            out[it["domain"]][it["id"]] = float(it["score"])
    return out


def text_nll(items: Sequence[Mapping[str, Any]]) -> dict[Any, float]:
    """``{document id: NLL per token}`` of the held-out general text."""
    return {it["id"]: _per_token(it) for it in items if it.get("metric") == "text_nll"}


def fidelity(items: Sequence[Mapping[str, Any]], domains: Sequence[str]) -> dict[str, dict]:
    """``{domain: {item id: NLL per token of its reference}}`` of the trained domains."""
    out: dict[str, dict[Any, float]] = {d: {} for d in domains}
    for it in items:
        if not it.get("zeroshot") and it["domain"] in out and "nll" in it:
            out[it["domain"]][it["id"]] = _per_token(it)
    return out


Measure = Callable[[Results, str, Grid], "dict[str, dict[Any, float]]"]
"""A measure of one method: ``{domain or corpus: {unit: value}}``."""


MEASURES: dict[str, tuple[str, Measure]] = {
    "acc": (
        "zero-shot label accuracy (movie, spam)",
        lambda res, m, grid: kept_acc(res.items(m), grid.zeroshot),
    ),
    "text": ("NLL per token, held-out C4 text", lambda res, m, _: {CORPUS: text_nll(res.items(m))}),
    "fidelity": (
        "reference NLL per token, trained domains",
        lambda res, m, grid: fidelity(res.items(m), grid.domains),
    ),
}


def diff(res: Results, a: str, b: str, measure: str, grid: Grid) -> Estimate:
    """``a − b`` on a measure: paired over units per domain, the mean over domains."""
    if not (res.has(a) and res.has(b)):
        return NONE
    fn = MEASURES[measure][1]
    va, vb = fn(res, a, grid), fn(res, b, grid)
    parts = [paired(va[d], vb.get(d, {})) for d in va]
    parts = [p for p in parts if p.n]
    return parts[0] if len(parts) == 1 else mean_of(parts)


def level(res: Results, m: str, measure: str, grid: Grid) -> dict[str, float]:
    """A method's mean per domain (and ``mean``, over domains) on a measure."""
    if not res.has(m):
        return {}
    got = MEASURES[measure][1](res, m, grid)
    per = {d: float(np.mean(list(v.values()))) for d, v in got.items() if v}
    return {**per, **({"mean": float(np.mean(list(per.values())))} if per else {})}


# ----------------------------------------------------------------------------- readouts


def _scopes(grid: Grid) -> dict[str, str]:
    """What each kind of readout measures, in the grid's numbers."""
    return {
        "kept": "Kept ability is measured offline by substitutes: zero-shot accuracy on"
        f" {' and '.join(grid.zeroshot)} (label tasks no client trains on,"
        f" {grid.zeroshot_items} items each) and the NLL of {grid.docs} held-out C4"
        " documents; the paper's benchmarks (MMLU, BBH, CRASS, DROP) test knowledge and"
        " reasoning that a 135M model barely has, so a substitute can show forgetting of what"
        " the base can do, not a gain on those benchmarks. One seed: the SE covers the items.",
        "fidelity": "Fidelity: the NLL per token of the held-out references of each trained"
        f" domain ({', '.join(grid.domains)}; {grid.seen_items} items each), the mean over"
        " domains. Lower is closer to the clients' tasks.",
        "matched": "Matched-drift FedIT: FedIT at lr × ‖Δ_FedSD‖ / ‖Δ_FedIT‖ (one"
        " proportional rescale of the update norm ‖θ_T − θ_0‖ each run logs); the achieved"
        " ratio is in the update-norm table.",
        "premise": "A premise, not a claim of the paper: the comparisons of kept ability mean"
        " something only if the budget moves the base (FedIT's NLL on general text above the"
        " round-0 base's).",
    }


def readouts(grid: Grid) -> list[Readout[Results]]:
    """The comparisons the study exists for (fixed before the runs)."""

    def est(a: str, b: str, measure: str) -> Callable[[Results], Estimate]:
        return lambda r: diff(r, a, b, measure, grid)

    items, docs, sc = "paired over items, mean over domains", "paired over documents", _scopes(grid)
    rows = (  # name, statistic, the paper, direction, a, b, measure, scope
        ("FedIT − base (round 0), NLL per token of held-out C4 text", docs,
         "the budget moves the base: FedIT's NLL above the base's", +1, "fedit", BASE, "text",
         "premise"),
        ("+FedSD − FedIT, zero-shot label accuracy (movie, spam)", items,
         "+FedSD keeps more general ability (overall 71.21 → 74.54 with FedAvg)", +1, "fedsd",
         "fedit", "acc", "kept"),
        ("+FedSD − FedIT, NLL per token of held-out C4 text", docs,
         "+FedSD keeps more general ability (lower NLL)", -1, "fedsd", "fedit", "text", "kept"),
        ("+FedSD − FedIT, reference NLL of the trained domains (fidelity)", items,
         "the rewrite paradox: rewrites (≈47% not entailing the reference) move the model away"
         " from the clients' references (higher NLL)", +1, "fedsd", "fedit", "fidelity",
         "fidelity"),
        ("FedSDR − +FedSD, reference NLL of the trained domains (fidelity)", items,
         "LoRA-R on the raw answers rectifies: FedSDR closer to the references (lower NLL)", -1,
         "fedsdr", "fedsd", "fidelity", "fidelity"),
        ("+FedSD − matched-drift FedIT, zero-shot label accuracy", items,
         "the gain is the refinery's, not a smaller drift's (+FedSD above)", +1, "fedsd",
         "matched", "acc", "matched"),
        ("+FedSD − matched-drift FedIT, NLL per token of held-out C4 text", docs,
         "the gain is the refinery's (+FedSD lower)", -1, "fedsd", "matched", "text", "matched"),
    )  # fmt: skip
    return [
        *(
            Readout(name, stat, paper, sign, est(a, b, m), scope=sc[scope])
            for name, stat, paper, sign, a, b, m, scope in rows
        ),
        Readout(
            "+FedSD − FedIT on MMLU, BBH, CRASS and DROP",
            DASH,
            "+FedSD above FedIT on each (e.g. CRASS 47.81 → 56.57 with FedAvg)",
            +1,
            lambda r: NONE,
            testable=False,
            scope="The paper's own benchmarks need data and a model size this offline grid"
            " does not have; the readouts above are its substitutes.",
        ),
    ]


# ----------------------------------------------------------------------------- the report


def _methods(res: Results) -> list[str]:
    return [m for m in (BASE, *METHODS) if res.has(m)]


def _row_of(res: Results, m: str) -> dict[str, Any]:
    """The metrics row of a method's evaluation (the base: FedIT's round 0)."""
    if m == BASE:
        return res.runs["fedit"].rounds.get(0, {}) if "fedit" in res.runs else {}
    return res.runs[m].final if m in res.runs else {}


def _instrument_lines(grid: Grid, res: Results) -> list[str]:
    """What the scorer predicted, beside the baselines, and the budgets' fit."""
    lines = [
        "## The instrument first",
        "",
        "Zero-shot label accuracy of each domain no client trains on, beside always answering"
        " its most frequent gold label (majority) and a uniform guess, with the share of items"
        " answered with each label (scored by the summed log-likelihood of label and"
        " end-of-turn token, the labels listed in an order drawn per item;"
        " docs/evaluation.md).",
        "",
    ]
    for d in grid.zeroshot:
        labels = sorted(
            {
                k.rsplit("/", 1)[1]
                for m in _methods(res)
                for k in _row_of(res, m)
                if k.startswith(f"zeroshot/pred/{d}/")
            }
        )
        rows = []
        for m in _methods(res):
            r = _row_of(res, m)
            keys = [f"{k}/{d}" for k in ("acc", "majority", "uniform")]
            keys += [f"pred/{d}/{x}" for x in labels]
            cells = [num(r.get(f"zeroshot/{k}")) for k in keys]
            rows.append([LABELS[m], *cells, f"{r.get(f'zeroshot/n/{d}', 0):.0f}"])
        header = ["model", f"acc {d}", "majority", "uniform", *(f"answered {x}" for x in labels)]
        lines += [f"**{d}**", "", *table([*header, "items"], rows), ""]
    seen = [d for d in grid.domains if any(f"pred/{d}/" in k for k in _row_of(res, BASE))]
    if seen:
        rows = [
            [
                LABELS[m],
                *(f"{num(r.get(f'acc/{d}'))} (maj. {num(r.get(f'majority/{d}'))})" for d in seen),
            ]
            for m in _methods(res)
            for r in [_row_of(res, m)]
        ]
        lines += [
            "The trained classification domains, for comparison (accuracy and majority"
            " baseline; not a readout):",
            "",
            *table(["model", *seen], rows),
            "",
        ]
    lines += _length_lines(grid, res)
    return lines


def _length_lines(grid: Grid, res: Results) -> list[str]:
    lines: list[str] = []
    if res.lengths:
        m = int(res.lengths["max_length"])
        rows = [
            [part, d, *(f"{v[k]:.0f}" for k in ("n", "p50", "p90", "max")), num(v["cut"])]
            for part in ("train", "evaluated")
            for d, v in res.lengths.get(part, {}).items()
        ]
        lines += [
            f"References' token lengths (SmolLM2 tokens of the reference and its end-of-turn"
            f" token) against the {m}-token budget of prompt and reference in training and in"
            " the NLL (`task.prompt.max_length`); *cut*: share of rows whose reference is cut"
            " to fit.",
            "",
            *table("rows | domain | n | p50 | p90 | max | cut", rows),
            "",
        ]
    docs = res.items(BASE) and [it for it in res.items(BASE) if it.get("metric") == "text_nll"]
    if docs:
        toks = [int(it["nll_tokens"]) for it in docs]
        full = sum(t == grid.doc_tokens - 1 for t in toks)
        lines += [
            f"Held-out general text: {len(docs)} C4 documents (the first of LLaMA-Factory's"
            f" `c4_demo.jsonl`), each scored on its first {grid.doc_tokens} tokens (the first"
            f" token is not predicted): {sum(toks):,} tokens, {full} documents long enough to"
            f" fill the window, {np.mean(toks):.0f} scored tokens on average.",
            "",
        ]
    return lines


def _levels_table(grid: Grid, res: Results) -> list[str]:
    rows = []
    for m in _methods(res):
        acc, text, fid = (level(res, m, k, grid) for k in ("acc", "text", "fidelity"))
        cells = [num(acc.get(d)) for d in [*grid.zeroshot, "mean"]] + [num(text.get(CORPUS))]
        rows.append([LABELS[m], *cells, *(num(fid.get(d)) for d in [*grid.domains, "mean"])])
    header = ["model", *(f"acc {d}" for d in grid.zeroshot), "acc mean", "C4 NLL/token"]
    return table([*header, *(f"ref. NLL {d}" for d in grid.domains), "ref. NLL mean"], rows)


PAIRS: tuple[tuple[str, str], ...] = (
    ("fedit", BASE),
    ("fedsd", BASE),
    ("fedsd", "fedit"),
    ("fedsdr", "fedit"),
)
PAIRS += (("fedsdr", "fedsd"), ("matched", "fedit"), ("fedsd", "matched"))


def _diff_table(grid: Grid, res: Results) -> list[str]:
    rows = []
    for a, b in PAIRS:
        if res.has(a) and res.has(b):
            cells = [marked(diff(res, a, b, k, grid)) for k in MEASURES]
            rows.append([f"{LABELS[a]} − {LABELS[b]}", *cells])
    header = ["difference", *(MEASURES[k][0] for k in MEASURES)]
    return table(header, rows)


def _domain_table(grid: Grid, res: Results, measure: str, keys: Sequence[str]) -> list[str]:
    fn = MEASURES[measure][1]
    rows = []
    for a, b in PAIRS:
        if res.has(a) and res.has(b):
            va, vb = fn(res, a, grid), fn(res, b, grid)
            cells = [marked(paired(va.get(d, {}), vb.get(d, {}))) for d in keys]
            rows.append([f"{LABELS[a]} − {LABELS[b]}", *cells])
    return table(["difference", *keys], rows)


def _norm_lines(grid: Grid, res: Results) -> list[str]:
    rounds = range(1, grid.rounds + 1)
    rows = []
    for m in METHODS:
        if m in res.runs:
            r = res.runs[m]
            lr = float(r.config.get("train", {}).get("lr", math.nan))
            cells = [num(r.rounds.get(k, {}).get("update_norm"), 4) for k in rounds]
            cells += [num(r.rounds.get(k, {}).get("train_loss"), 3) for k in rounds]
            rows.append([LABELS[m], f"{lr:.3g}", *cells])
    header = ["method", "local lr", *(f"‖θ_{k} − θ_0‖" for k in rounds)]
    header += [f"train loss r{k}" for k in rounds]
    lines = ["## Update norms and the matched-drift control", "", *table(header, rows), ""]
    if {"fedit", "fedsd"} <= set(res.runs):
        try:
            lr, ratio = matched_lr(grid, res.runs["fedit"], res.runs["fedsd"])
        except Unmet as e:
            return [*lines, f"The control could not be configured: {e}.", ""]
        target = float(res.runs["fedsd"].final["update_norm"])
        got = res.runs.get("matched")
        norm = float(got.final["update_norm"]) if got and "update_norm" in got.final else None
        achieved = "it has not run" if norm is None else f"its update norm is {norm:.4f}, "
        achieved += "" if norm is None else f"{norm / target:.3f}× +FedSD's"
        lines += [
            f"The rule (one proportional rescale): the control's lr = {grid.lr:g} × ‖Δ_FedSD‖ /"
            f" ‖Δ_FedIT‖ = {grid.lr:g} × {ratio:.4f} = {lr:.4g}; {achieved}. The norm is over"
            " the aggregated adapter's tensors (LoRA A and B; FedSDR: LoRA-R alone).",
            "",
        ]
    return lines


def _rewrite_lines(res: Results, grid: Grid) -> list[str]:
    lines = ["## FedSD's rewrites and their fallbacks", ""]
    for m in ("fedsd", "fedsdr"):
        zero = res.runs[m].rounds.get(0, {}) if m in res.runs else {}
        if "fedsd/rows" not in zero:
            continue
        fall = "fedsd/fallback_"
        reasons = [k.removeprefix(fall) for k, _, _ in REWRITE_KEYS if k.startswith(fall)]
        rows = []
        for d in [*grid.domains, None]:
            sfx = f"/{d}" if d else ""
            n = float(zero.get(f"fedsd/rows{sfx}", 0))
            shares = [f"fedsd/kept_share{sfx}", *(f"{fall}{x}{sfx}" for x in reasons)]
            cells = [f"{n * float(zero.get(k, 0)):.0f}" for k in shares]
            rows.append(
                [d or "all", f"{n:.0f}", *cells, num(zero.get(f"fedsd/length_ratio{sfx}"), 2)]
            )
        cached = int(zero.get("fedsd/cached_clients", 0))
        lines += [
            f"`{m}` (round 0; {cached} of {len(grid.domains)} clients read the rewrite cache):"
            f" counts of rows, {grid.rewrite_tokens} new tokens per rewrite.",
            "",
            *table(
                ["domain", "rows", "kept", *(f"fallback {x}" for x in reasons), "length ratio"],
                rows,
            ),
            "",
        ]
        if m == "fedsd":
            stats = [[label, num(float(zero[k]), dg)] for k, label, dg in REWRITE_KEYS if k in zero]
            lines += [*table(["statistic", "value"], stats), ""]
    if len(lines) == 2:
        return [*lines, "No run logged rewrite statistics.", ""]
    lines += [
        "A fallback row trains on its raw reference, so +FedSD differs from FedIT only on the"
        " kept rows. *truncated*: the rewrite reached its token limit without ending (training"
        " would teach the model to stop mid-answer); *long_prompt*: the rewrite prompt with the"
        " whole reference exceeds the teacher's budget (never cut). The paper: about 47% of"
        " rewrites do not entail the reference (entailment is not measured here).",
        "",
    ]
    return lines


def _analysis_lines(ctx: Context[Grid], res: Results) -> list[str]:
    grid = ctx.grid
    lines = ["## Answer distributions, update cosines and uplink bytes", ""]
    if "fedsd" in res.runs:
        dist = distribution_analysis(ctx.out / "fedsd", job_config(grid, "fedsd"))
        if "js_distilled" in dist:
            rows = [
                [name, num(dist[f"{k}_raw"], 4), num(dist[f"{k}_distilled"], 4), f"{p[0]} → {p[1]}"]
                for name, k, p in (
                    ("JS divergence between clients (bits)", "js", PAPER_JS),
                    ("TF-IDF cosine between clients", "tfidf", PAPER_TFIDF),
                )
            ]
            lines += [*table(["measure", "raw", "distilled", "paper raw → distilled"], rows), ""]
    rounds = range(1, grid.rounds + 1)
    rows = []
    for m in METHODS:
        if m in res.runs:
            r = res.runs[m]
            cos = {k: (a, b) for k, a, b in update_cosine_rows(r.metrics)}
            up = sorted({int(x.get("bytes_up_arrays", 0)) for x in r.metrics if int(x["round"])})
            cells = [f"{cos[k][0]:.3f} / {cos[k][1]:.3f}" if k in cos else DASH for k in rounds]
            rows.append([LABELS[m], *cells, ", ".join(f"{u:,}" for u in up)])
    lines += [
        "Mean / minimum pairwise cosine of the clients' updates per round (FedSDR: LoRA-R),"
        " computed by the server from the uploads (`algo.update_cosines`), and the uplink"
        " tensor bytes per round from the audit ledger (FedSDR uploads FedIT's bytes).",
        "",
        *table(["method", *(f"round {k}" for k in rounds), "uplink array bytes / round"], rows),
        "",
    ]
    return lines


def _setup_lines(ctx: Context[Grid], res: Results) -> list[str]:
    from fedfm.config import load_config
    from fedfm.engine import resolve

    grid = ctx.grid
    run_cfg = load_config(job_config(grid, "fedsdr"))
    t, tr = resolve(run_cfg)[1].model_dump(), run_cfg.train.model_dump()  # defaults filled in
    return [
        "## Setup",
        "",
        f"- Model: {t['model']} (bfloat16 autocast {t.get('autocast_bf16')}), LoRA r"
        f"={t['lora']['r']} on {', '.join(t['lora']['target_modules'])}; {len(grid.domains)}"
        f" clients, one trained domain each ({', '.join(grid.domains)}), {grid.per_domain}"
        f" training items each; every client every round; server optimizer {grid.optimizer}.",
        f"- {grid.rounds} rounds of {grid.steps} local steps (batch {tr['batch_size']},"
        f" {tr['optimizer']}, lr {grid.lr:g}) for FedIT and +FedSD; FedSDR {grid.steps_s}"
        f" LoRA-S steps on the rewrites, then {grid.steps} LoRA-R steps on the raw answers,"
        f" per round. The base is FedIT's round-0 evaluation (B = 0: the untrained model).",
        f"- Evaluation by likelihood only (nothing generated): {grid.zeroshot_items} test items"
        f" of each of {', '.join(grid.zeroshot)} (no client trains on them), {grid.docs} C4"
        f" documents, {grid.seen_items} held-out items of each trained domain.",
        f"- FedSD rewrites: SDFT's prompt, greedy, {grid.rewrite_tokens} new tokens, generated"
        " once (round 0 of `fedsd`) and read from the cache by `fedsdr`.",
        "",
    ]


def _limits_lines(grid: Grid) -> list[str]:
    return [
        "## What the paper's setting has that this one does not",
        "",
        "- **Model and benchmarks**: the paper fine-tunes 7B-class models and scores MMLU,"
        " BBH, CRASS and DROP; here a 135M model is scored on substitutes it can do at all"
        " (two label tasks, C4 text). A 135M base is near chance on such benchmarks, so kept"
        " ability here is about not forgetting what the base has (label preferences, web-text"
        " fluency), not about reasoning.",
        "- **Data and clients**: the paper's clients hold thousands of finance, medical,"
        f" maths and code instructions; here {len(grid.domains)} clients hold"
        f" {grid.per_domain} items each of offline stand-ins, for {grid.rounds} rounds.",
        "- **Seeds**: one seed; every SE is over items (or documents) only. The spread over"
        " seeds, partitions and rewrite draws is not measured, so a resolved difference says"
        " the items can tell these two models apart, not that the methods differ in general.",
        "- **What the grid can resolve**: accuracy differences of about 2 SE of the paired"
        f" per-item differences on {grid.zeroshot_items} items per domain (the SEs above), and"
        " small NLL differences on the same documents and references; it cannot speak to the"
        " paper's benchmark gains, to other server optimizers, or to larger drift.",
        "",
    ]


def body(ctx: Context[Grid], res: Results) -> list[str]:
    """Setup, the instrument, kept ability and fidelity, update norms, rewrites, analyses."""
    grid = ctx.grid
    lines = [
        "FedSDR (ICML 2026, arXiv 2605.18028; METHODS.md section 1): FedSD rewrites every"
        " client's answers with the global model before round 1; FedSDR trains LoRA-S on the"
        " rewrites and LoRA-R on the raw answers, and aggregates LoRA-R alone.",
        "",
        *_setup_lines(ctx, res),
        *_instrument_lines(grid, res),
        *blocks(
            "## Kept ability and fidelity",
            "Means over items per domain (accuracy: higher is better; NLL per token, natural"
            " log: lower is better); *mean* weighs every domain the same.",
            _levels_table(grid, res),
            "Paired differences (mean ± SE; `*`: more than 2 SE from zero), over items per"
            " domain then the mean over domains, over documents for C4:",
            _diff_table(grid, res),
            "Per domain, zero-shot accuracy:",
            _domain_table(grid, res, "acc", grid.zeroshot),
            "Per domain, reference NLL per token (fidelity):",
            _domain_table(grid, res, "fidelity", grid.domains),
        ),
        *_norm_lines(grid, res),
        *_rewrite_lines(res, grid),
        *_analysis_lines(ctx, res),
        *_limits_lines(grid),
    ]
    missing = [m for m in METHODS if m not in res.runs]
    if missing:
        lines += blocks(
            "## Runs not finished",
            f"{', '.join(f'`{m}`' for m in missing)}: their rows above are empty. `{ctx.command}`"
            " finishes them (finished runs are skipped, an unfinished one resumes from its last"
            " checkpoint) and rewrites this report.",
        )
    return lines


STUDY = register(
    Study(
        name="fedsdr",
        summary="FedSDR: kept ability and fidelity of FedIT, +FedSD, FedSDR, matched-drift FedIT",
        full=FULL,
        quick=QUICK,
        jobs=jobs,
        read=read,
        readouts=readouts,
        title=lambda ctx: f"FedSDR reproduction ({ctx.grid.label})",
        body=body,
        reports=("fedsdr.md", None),
        later="the matched-drift control, once FedIT and +FedSD have measured their update norms",
    )
)
