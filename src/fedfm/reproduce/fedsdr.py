"""FedSDR reproduction study: base vs base + FedSD vs FedSDR for each server optimizer.

``fedfm reproduce fedsdr`` runs, on the multi-domain instruction suite with one domain per
client (the paper's finance / medical / maths clients; here ``general``, ``math``, ``medical``
and ``qtype``) and the real SmolLM2-135M-Instruct, for each server optimizer of the paper
(FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad):

* **base**: FedIT's single LoRA trained on the raw answers;
* **+FedSD**: the same, trained on the round-0 rewrites (``algo.fedsd.enabled``);
* **FedSDR**: dual-stream LoRA, only LoRA-R aggregated;

and writes a markdown report: per-domain held-out scores and the overall score (mean over
domains), each method's difference from its base with the standard error of the paired
per-item differences, the head-to-head win rate over the base (ties half) with its SE, the
rewrite statistics (kept share, fallbacks by reason, answer-keeping share, length ratio,
filler-word rates), and the JS divergence / TF-IDF cosine between clients' answer
distributions, raw vs distilled, and the pairwise cosines of clients' updates (every run logs
them, ``algo.update_cosines``), beside the paper's figures. ``--quick`` runs FedAvg and
FedAdam, 2 rounds of 6 + 6 steps, 32 items per domain (:data:`QUICK`); the full grid
(:data:`FULL`: six optimizers, 3 rounds of 6 + 6 steps, 32 items per domain). Either writes
``docs/fedsdr.md``, titled by its grid.

Budgets (ours): FedSDR takes ``steps_s`` + ``steps_r`` local steps per round; base and +FedSD
take the same total (``2 × steps``), so every method spends the same local compute. The
rewrites are generated once (round 0 of the first run) and read from the rewrite cache by
every other run. FedProx uses μ = 0.01 (on LoRA-R for FedSDR). Classification items
(medical, qtype) are scored by log-likelihood of the label (generation by a 135M model is
too noisy), free text by ROUGE-L, maths by the final number.

Statistics (ours): all methods are evaluated on the same held-out items, so a difference is
paired by item: per domain, the mean and SE (sd / √n) of the per-item score differences; the
overall difference is the mean over domains, its SE √(Σ_d SE_d²) / D. One seed: the SE says
what the item count can resolve, not the spread over seeds or partitions.

Resumable: a finished run of the same config is skipped, an unfinished one resumed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedfm.analyze import REWRITE_KEYS, distribution_analysis
from fedfm.core.runfolder import read_jsonl
from fedfm.reproduce import STUDIES

METHODS = ("base", "fedsd", "fedsdr")
LABELS = {"base": "base", "fedsd": "+FedSD", "fedsdr": "FedSDR"}
OPTIMIZERS = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad")
SERVER_LR = {"fedadam": 0.001, "fedyogi": 0.001, "fedadagrad": 0.01}  # OpenFedLLM-style
PROX_MU = 0.01
PAPER = {  # overall score base -> +FedSD and win rate of +FedSD over base (paper's table)
    "fedavg": (71.21, 74.54, 56.14),
    "fedavgm": (68.18, 73.34, 60.30),
    "fedprox": (70.93, 74.96, 56.12),
    "fedyogi": (69.17, 73.56, 60.37),
    "fedadam": (71.03, 74.93, 57.82),
    "fedadagrad": (71.87, 75.13, 56.78),
}
PAPER_JS = (0.4074, 0.3611)
PAPER_TFIDF = (0.6362, 0.7064)


@dataclass(frozen=True)
class Grid:
    """A study grid.

    Attributes:
        optimizers: Server optimizers (``fedprox`` is FedAvg with the proximal term).
        rounds: Communication rounds.
        steps: Local steps per FedSDR stage (base and +FedSD take twice as many).
        per_domain: Training and held-out items per domain.
        domains: One client per domain.
        task: Fields replacing the preset's ``task`` section (e.g. a tiny model in tests).
        label: Which grid it is, for the report's title.
        cache_dir: Folder of the rewrite cache; ``None``: the default.
        threads: Torch threads of each run.
        rewrite_tokens: New tokens of each rewrite.
        eval_before: Evaluate the untrained model (round 0 of the first run).
        eval_per_domain: Held-out items evaluated per domain (the first ones of the test
            split); ``None``: all ``per_domain``.
    """

    optimizers: tuple[str, ...]
    rounds: int
    steps: int
    per_domain: int
    domains: tuple[str, ...] = ("general", "math", "medical", "qtype")
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = "full grid"
    cache_dir: str | None = None
    threads: int = 2
    rewrite_tokens: int = 128
    eval_before: bool = True
    eval_per_domain: int | None = None


# The quick size (FedAvg and FedAdam, 4 domains x 32 items, 2 rounds, 6 steps per
# stage). Measured on SmolLM2 with one thread on 2 cores at load 2-3: ~3.3 s per training
# step, ~2.5 min per held-out evaluation of 128 items at 96 new tokens, ~25 s per 16
# rewrites; at load 5-6 steps take twice as long. To finish six runs in about an hour there,
# 16 of the 32 held-out items per domain are evaluated, with 64 new tokens (not 96), and the
# untrained model is not; training data, steps and rewrites keep the size.
QUICK = Grid(
    ("fedavg", "fedadam"),
    rounds=2,
    steps=6,
    per_domain=32,
    task={"max_new_tokens": 64},
    rewrite_tokens=128,
    label="quick grid",
    threads=1,  # on shared cores a second thread mostly waits for the first
    eval_before=False,
    eval_per_domain=16,
)
FULL = Grid(OPTIMIZERS, rounds=3, steps=6, per_domain=32)


def _preset(name: str) -> dict[str, Any]:
    from fedfm.config import preset_dir

    data = yaml.safe_load((preset_dir() / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def job_config(grid: Grid, opt: str, method: str, out: Path) -> dict[str, Any]:
    """The run config of one (optimizer, method) cell."""
    cfg = copy.deepcopy(_preset("fedsdr"))
    cfg.update(name=f"{opt}-{method}", out_dir=str(out), rounds=grid.rounds, plots=False)
    cfg.update(
        eval_every=grid.rounds,
        threads=grid.threads,
        eval_before=grid.eval_before and (opt, method) == (grid.optimizers[0], "base"),
    )
    cfg["task"]["source_options"].update(
        per_domain_train=grid.per_domain,
        per_domain_test=grid.per_domain,
        domains=list(grid.domains),
    )
    cfg["task"]["max_eval"] = (grid.eval_per_domain or grid.per_domain) * len(grid.domains)
    cfg["clients"] = {"fraction": 1.0, "min_clients": len(grid.domains)}
    cfg["task"].update(copy.deepcopy(dict(grid.task)))
    server: dict[str, Any] = {"name": "fedavg" if opt == "fedprox" else opt}
    if opt in SERVER_LR:
        server["lr"] = SERVER_LR[opt]
    refine = cfg["algo"]["refinery"]
    refine["decoding"]["max_new_tokens"] = grid.rewrite_tokens
    if grid.cache_dir is not None:
        refine["cache_dir"] = grid.cache_dir
    cfg["train"]["steps"] = 2 * grid.steps
    if method == "fedsdr":
        cfg["algo"].update(
            server_opt=server, steps_s=grid.steps, steps_r=grid.steps, update_cosines=True
        )
        if opt == "fedprox":
            cfg["algo"]["prox_mu"] = PROX_MU
        return cfg
    cfg["algorithm"] = "fedprox" if opt == "fedprox" else "fedavg"
    algo: dict[str, Any] = {"server_opt": server, "update_cosines": True}
    algo["fedsd"] = {"enabled": method == "fedsd", **refine}
    if opt == "fedprox":
        algo["mu"] = PROX_MU
    cfg["algo"] = algo
    return cfg


def run_grid(grid: Grid, out: Path) -> tuple[dict[str, str], float]:
    """Runs the grid's missing runs; returns (errors by run, wall seconds of this call)."""
    from fedfm.reproduce.fedekd import run_status

    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    for opt in grid.optimizers:
        for method in METHODS:
            cfg = job_config(grid, opt, method, out)
            status = run_status(cfg)
            if status == "done":
                continue
            start, load0 = time.perf_counter(), os.getloadavg()[0]
            try:
                from fedfm.config import load_config
                from fedfm.runtime import run

                resume = status == "partial"
                run(load_config(cfg), resume=resume, overwrite=not resume, progress=False)
            except Exception as e:  # one failed run is reported, the others still run
                errors[cfg["name"]] = f"{type(e).__name__}: {e}"
            _log_load(out, cfg["name"], time.perf_counter() - start, load0)
    return errors, time.perf_counter() - t0


LOAD_LOG = "study_load.jsonl"


def _log_load(out: Path, name: str, wall_s: float, load_start: float) -> None:
    """Appends the run's wall time and the machine's 1-min load average at its start and end
    (the report states the load the times were measured at)."""
    row = {"run": name, "wall_s": round(wall_s, 1), "load_start": load_start}
    row["load_end"] = os.getloadavg()[0]
    out.mkdir(parents=True, exist_ok=True)
    with (out / LOAD_LOG).open("a") as f:
        f.write(json.dumps(row) + "\n")


def _load_line(out: Path) -> str:
    rows = read_jsonl(out / LOAD_LOG, need_round=False)
    if not rows:
        return f"load average {os.getloadavg()[0]:.1f} when this report was written"
    loads = [float(r[k]) for r in rows for k in ("load_start", "load_end")]
    last = {str(r["run"]): float(r["wall_s"]) for r in rows}  # a rerun replaces its row
    return (
        f"1-min load average {min(loads):.1f}-{max(loads):.1f} at the starts and ends of "
        f"the runs, which took {sum(last.values()) / 60:.1f} min from start to end "
        f"(`{LOAD_LOG}`)"
    )


# ----------------------------------------------------------------------------- reading runs


@dataclass
class RunResult:
    """What the report reads of one finished run."""

    final: dict[str, Any]
    items: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    wall_s: float


def read_run(run: Path) -> RunResult | None:
    """The run's final metrics, last evaluated items and log rows (None when unfinished)."""
    from fedfm.eval.compare import read_items

    summary = run / "summary.json"
    if not summary.exists():
        return None
    s = json.loads(summary.read_text())
    rows = read_jsonl(run / "metrics.jsonl", need_round=False)
    wall = sum(float(r.get("time_s", 0.0)) for r in rows)
    return RunResult(s["final"], read_items(run), rows, wall)


def paired_diff(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-domain and overall mean score difference ``a − b`` over shared items, with SEs.

    Returns:
        ``{domain: (mean, se, n)}`` and ``"overall": (mean over domains, √(Σ se²)/D, n)``.
    """
    sb = {(it["id"], it.get("zeroshot", False)): float(it["score"]) for it in b}
    by: dict[str, list[float]] = {}
    for it in a:
        key = (it["id"], it.get("zeroshot", False))
        if key in sb:
            by.setdefault(str(it["domain"]), []).append(float(it["score"]) - sb[key])
    out: dict[str, Any] = {}
    for d, v in sorted(by.items()):
        arr = np.asarray(v)
        se = float(arr.std(ddof=1) / math.sqrt(len(arr))) if len(arr) > 1 else math.nan
        out[d] = (float(arr.mean()), se, len(arr))
    doms = [out[d] for d in sorted(by)]
    if doms:
        out["overall"] = (
            float(np.mean([m for m, _, _ in doms])),
            math.sqrt(sum(se**2 for _, se, _ in doms)) / len(doms),
            sum(n for _, _, n in doms),
        )
    return out


# ----------------------------------------------------------------------------- the report


def _f(x: float, digits: int = 3, signed: bool = False) -> str:
    return "—" if not math.isfinite(x) else f"{x:{'+' if signed else ''}.{digits}f}"


def _diff(d: tuple[float, float, int] | None) -> str:
    if d is None:
        return "—"
    m, se, _ = d
    mark = " *" if math.isfinite(se) and abs(m) > 2 * se else ""
    return f"{_f(m, signed=True)} ± {_f(se)}{mark}"


def _score_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    doms = list(grid.domains)
    head = [
        "optimizer",
        "method",
        *doms,
        "overall",
        "Δ overall vs base (± SE)",
        "win rate vs base (± SE)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    from fedfm.eval.compare import win_rate

    for opt in grid.optimizers:
        base = res.get(f"{opt}-base")
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                lines.append(f"| {opt} | {LABELS[method]} |" + " — |" * (len(head) - 2))
                continue
            cells = [_f(float(r.final.get(f"score/{d}", math.nan))) for d in doms]
            cells.append(_f(float(r.final.get("score", math.nan))))
            if method == "base" or base is None:
                cells += ["", ""]
            else:
                cells.append(_diff(paired_diff(r.items, base.items).get("overall")))
                w = win_rate(r.items, base.items)
                cells.append(f"{100 * w['win_rate']:.1f}% ± {100 * w['se']:.1f}")
            lines.append(f"| {opt} | {LABELS[method]} | " + " | ".join(cells) + " |")
    return lines


def _domain_diff_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    doms = list(grid.domains)
    head = ["optimizer", "comparison", *doms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pairs = [("fedsd", "base"), ("fedsdr", "base"), ("fedsdr", "fedsd")]
    for opt in grid.optimizers:
        for a, b in pairs:
            ra, rb = res.get(f"{opt}-{a}"), res.get(f"{opt}-{b}")
            if ra is None or rb is None:
                continue
            d = paired_diff(ra.items, rb.items)
            cells = [_diff(d.get(x)) for x in doms]
            lines.append(f"| {opt} | {LABELS[a]} − {LABELS[b]} | " + " | ".join(cells) + " |")
    return lines


def _rewrite_lines(res: Mapping[str, RunResult]) -> list[str]:
    zero = next(
        (r.rows[0] for r in res.values() if r.rows and "fedsd/kept_share" in r.rows[0]), None
    )
    if zero is None:
        return ["No run logged rewrite statistics."]
    lines = ["| statistic | value |", "|---|---|"]
    lines += [f"| {label} | {_f(float(zero[k]), d)} |" for k, label, d in REWRITE_KEYS if k in zero]
    return lines


def _cosine_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    """Mean / min pairwise cosine of the clients' updates per round, by method."""
    from fedfm.analyze import update_cosine_rows

    rounds = range(1, grid.rounds + 1)
    head = ["optimizer", "method", "trained on", *(f"round {r} mean / min" for r in rounds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    data = {"base": "raw answers", "fedsd": "distilled", "fedsdr": "LoRA-R on raw, S active"}
    for opt in grid.optimizers:
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                continue
            cos = {k: (m, lo) for k, m, lo in update_cosine_rows(r.rows)}
            cells = [f"{cos[k][0]:.4f} / {cos[k][1]:.4f}" if k in cos else "—" for k in rounds]
            lines.append(
                f"| {opt} | {LABELS[method]} | {data[method]} | " + " | ".join(cells) + " |"
            )
    return lines


def _bytes_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    """Uplink bytes per training round from the audit ledger (the rows' ``bytes_up*``)."""
    head = ["optimizer", "method", "uplink array bytes / round", "uplink meta bytes / round"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for opt in grid.optimizers:
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                continue
            rows = [x for x in r.rows if int(x["round"]) > 0]
            arrays = sorted({int(x.get("bytes_up_arrays", 0)) for x in rows})
            meta = sorted({int(x.get("bytes_up_meta", 0)) for x in rows})
            cells = [", ".join(f"{v:,}" for v in arrays), ", ".join(f"{v:,}" for v in meta)]
            label = "base (FedIT)" if method == "base" else LABELS[method]
            lines.append(f"| {opt} | {label} | " + " | ".join(cells) + " |")
    return lines


def _round_times(res: Mapping[str, RunResult]) -> tuple[float, float]:
    """Mean seconds of a training round without evaluation and of the final evaluation (the
    last round's time less the run's earlier training rounds' mean, at least 0)."""
    train, evals = [], []
    for r in res.values():
        by = {int(x["round"]): float(x.get("time_s", 0.0)) for x in r.rows}
        last = max(by)
        plain = [t for k, t in by.items() if 0 < k < last]
        if plain:
            train.append(float(np.mean(plain)))
            evals.append(max(by[last] - train[-1], 0.0))
    return _mean(train), _mean(evals)


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _rewrite_time(made: Sequence[float], read: Sequence[float], runs: int) -> str:
    """How the runs' round 0 got their rewrites, and how long it took."""
    if made:
        return (
            f"generating the rewrites took {sum(made):.0f} s, reading them from the cache "
            f"{sum(read):.0f} s over the other runs"
        )
    if read:
        return (
            f"every run with rewrites ({runs}) read them from the cache, filled by an earlier "
            f"run of the same model, data and decoding settings ({sum(read):.0f} s in all)"
        )
    return "no run rewrote"


def _eval_counts(res: Mapping[str, RunResult]) -> str:
    """The evaluated items per domain, as the runs' items show them (e.g. ``16``)."""
    counts = {n for r in res.values() for n in Counter(str(i["domain"]) for i in r.items).values()}
    if not counts:
        return "no"
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _full_grid_lines(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    train, ev = _round_times(res)
    n_full = len(OPTIMIZERS) * len(METHODS)
    lines = [
        "## The full grid",
        "",
        f"`fedfm reproduce fedsdr` runs all six optimizers × 3 methods ({n_full} runs: "
        f"{FULL.rounds} rounds of {FULL.steps} + {FULL.steps} steps, {FULL.per_domain} items "
        "per domain, 96 new tokens per held-out answer, the untrained model evaluated once) and "
        "writes this file in place of the quick grid's report. It was not run.",
    ]
    if math.isfinite(train) and math.isfinite(ev):
        steps = FULL.steps / grid.steps
        tokens = int(_preset("fedsdr")["task"]["max_new_tokens"])
        ours = int(grid.task.get("max_new_tokens", tokens))
        items = (FULL.eval_per_domain or FULL.per_domain) / (
            grid.eval_per_domain or grid.per_domain
        )
        full_ev = ev * items * tokens / ours  # evaluation time ~ items × new tokens (a bound)
        per_run = FULL.rounds * train * steps + full_ev
        # The full grid's rewrites have the quick grid's model, data and decoding: cached.
        total = n_full * per_run + full_ev
        lines += [
            "",
            f"Estimate (not a measurement): here a training round took {train:.0f} s and the "
            f"final evaluation {ev:.0f} s on average, so a full-grid run takes about "
            f"{FULL.rounds} × {train * steps:.0f} s + {full_ev:.0f} s (evaluation scaled by "
            f"{items:g}× the items and {tokens}/{ours} new tokens, an upper bound) ≈ "
            f"{per_run / 60:.0f} min, and the grid about {total / 3600:.1f} h at the same "
            "load, one run at a time (its rewrites are the quick grid's: same model, data and "
            "decoding, read from the cache). The evaluation time is the last round's time "
            "less a training round's, which changes in the machine's load blur.",
        ]
    return [*lines, ""]


SCORING = {
    "rouge": "ROUGE-L",
    "gsm8k": "final-number accuracy",
    "choice": "label log-likelihood",
}


def _scoring(domains: Sequence[str]) -> str:
    """How each domain of the grid is scored, e.g. ``ROUGE-L (general), ...``."""
    from fedfm.data.instruct import DOMAINS

    by: dict[str, list[str]] = {}
    for d in domains:
        by.setdefault(SCORING[DOMAINS[d].metric], []).append(d)
    return ", ".join(f"{how} ({', '.join(ds)})" for how, ds in by.items())


def write_report(
    grid: Grid,
    out: Path,
    report: Path,
    command: str,
    errors: Mapping[str, str],
    wall_s: float,
) -> Path:
    """Writes the markdown report from the runs in ``out``."""
    res: dict[str, RunResult] = {}
    for opt in grid.optimizers:
        for method in METHODS:
            r = read_run(out / f"{opt}-{method}")
            if r is not None:
                res[f"{opt}-{method}"] = r
    first = f"{grid.optimizers[0]}-fedsd"
    dist = (
        distribution_analysis(out / first, job_config(grid, grid.optimizers[0], "fedsd", out))
        if first in res
        else None
    )
    from fedfm.config import load_config
    from fedfm.engine import resolve

    ref_cfg = load_config(job_config(grid, grid.optimizers[0], "fedsdr", out))
    algo_cfg, task_cfg = resolve(ref_cfg)  # with every default filled in
    task, train = task_cfg.model_dump(), ref_cfg.train.model_dump()
    run_wall = sum(r.wall_s for r in res.values())
    zeros = [r.rows[0] for r in res.values() if r.rows and "fedsd/rows" in r.rows[0]]
    made = [float(z["time_s"]) for z in zeros if not z.get("fedsd/cached_clients")]
    read = [float(z["time_s"]) for z in zeros if z.get("fedsd/cached_clients")]
    base0 = next((r.rows[0] for r in res.values() if r.rows and "score" in r.rows[0]), None)
    lines = [
        f"# FedSDR reproduction ({grid.label})",
        "",
        "FedSDR (ICML 2026, arXiv 2605.18028; METHODS.md section 1): FedSD rewrites of every "
        "client's answers by the global model before round 1, dual-stream LoRA (LoRA-S on the "
        "rewrites, LoRA-R on the raw answers), only LoRA-R aggregated. Generated by "
        f"`{command}` (`src/fedfm/reproduce/fedsdr.py`); every number below is read from the "
        "runs' folders.",
        "",
        "## Setup",
        "",
        f"- Model: {task['model']} (bfloat16 autocast: {task.get('autocast_bf16', False)}), "
        f"LoRA r={task['lora']['r']} on {', '.join(task['lora']['target_modules'])}; "
        f"{len(grid.domains)} clients, one domain each ({', '.join(grid.domains)}), "
        f"{grid.per_domain} training items per client; {_eval_counts(res)} held-out items "
        "evaluated per domain (the same items for every run).",
        f"- {grid.rounds} rounds, all clients every round; FedSDR {grid.steps} + {grid.steps} "
        f"steps per round (LoRA-S, then LoRA-R), base and +FedSD {2 * grid.steps} steps; "
        f"batch {train['batch_size']}, {train['optimizer']} lr {train['lr']:g}.",
        f"- Scoring: {_scoring(grid.domains)}; overall = mean over domains;"
        f" {task['max_new_tokens']} new tokens per generated answer (a worked maths solution"
        " may not reach its final number).",
        f"- Rewrites: SDFT prompt, decoding {algo_cfg.refinery.decoding}; "
        "generated once and cached.",
        f"- Wall time: {run_wall / 60:.1f} min summed over the runs' rounds "
        f"({len(res)} runs; {_rewrite_time(made, read, len(zeros))}); the invocation that "
        "wrote this report "
        f"{wall_s / 60:.1f} min (finished runs are not run again). "
        f"Machine: 2 CPU cores shared with other jobs, {_load_line(out)}; one thread per "
        "run.",
        "",
    ]
    if base0 is not None:
        lines += [
            f"The untrained model (round 0 of `{grid.optimizers[0]}-base`): overall "
            f"{_f(float(base0['score']))}; "
            + ", ".join(f"{d} {_f(float(base0.get(f'score/{d}', math.nan)))}" for d in grid.domains)
            + ".",
            "",
        ]
    lines += [
        "## Held-out scores",
        "",
        "Differences are paired by item (mean ± SE of the per-item differences; `*`: more "
        "than 2 SE from zero). Win rate: per item, a win, tie or loss against the base; ties "
        "count half.",
        "",
        *_score_table(grid, res),
        "",
        "### Per-domain differences",
        "",
        *_domain_diff_table(grid, res),
        "",
        "### The paper's table (overall score base → +FedSD, win rate)",
        "",
        "| optimizer | base | +FedSD | win rate |",
        "|---|---|---|---|",
        *[f"| {o} | {b} | {s} | {w}% |" for o, (b, s, w) in PAPER.items()],
        "",
        "## Rewrite statistics (the rewrite paradox)",
        "",
        *_rewrite_lines(res),
        "",
        "The paper: about 47% of rewrites do not entail the reference; rewrites are longer and "
        "use twice the filler words. Entailment is not measured here; the answer-keeping share "
        "covers maths and classification rows (final number or label).",
        "",
        "## Answer distributions across clients, raw vs distilled",
        "",
    ]
    if dist is not None:
        lines += [
            "| measure | raw | distilled | paper raw → distilled |",
            "|---|---|---|---|",
            f"| JS divergence (bits, mean over client pairs) | {_f(dist['js_raw'], 4)} | "
            f"{_f(dist['js_distilled'], 4)} | {PAPER_JS[0]} → {PAPER_JS[1]} |",
            f"| TF-IDF cosine (mean over client pairs) | {_f(dist['tfidf_raw'], 4)} | "
            f"{_f(dist['tfidf_distilled'], 4)} | {PAPER_TFIDF[0]} → {PAPER_TFIDF[1]} |",
            "",
            f"Distilled answers: the kept rewrites of `{first}`'s clients (fallback rows keep the "
            "reference).",
            "",
        ]
    else:
        lines += ["No +FedSD run finished.", ""]
    lines += [
        "## Pairwise cosine between clients' updates, raw vs distilled",
        "",
        "Cosine between each pair of clients' updates θ_i − θ of a round (FedSDR: LoRA-R), "
        "computed by the server from the uploads it aggregates (`algo.update_cosines`); mean "
        "and minimum over the client pairs. The paper reports the figure without a recipe.",
        "",
        *_cosine_table(grid, res),
        "",
        "## Uplink bytes (audit ledger)",
        "",
        "Per training round, all clients together, as the audit ledger counted them (tensor "
        "data and JSON meta values apart). The paper: FedSDR at FedIT's communication cost.",
        "",
        *_bytes_table(grid, res),
        "",
    ]
    lines += _full_grid_lines(grid, res)
    if errors:
        lines += ["## Failed runs", "", *[f"- `{k}`: {v}" for k, v in sorted(errors.items())], ""]
    missing = [f"{o}-{m}" for o in grid.optimizers for m in METHODS if f"{o}-{m}" not in res]
    if missing:
        lines += [
            "## Runs not finished",
            "",
            f"{', '.join(f'`{m}`' for m in missing)}: their rows above are empty. `{command}` "
            "finishes them (finished runs are skipped, an unfinished one resumes from its last "
            "checkpoint) and rewrites this report.",
            "",
        ]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines))
    return report


@STUDIES.register("fedsdr", "FedSDR: base vs +FedSD vs FedSDR per server optimizer")
def fedsdr_study(out: Path, quick: bool) -> Path:
    """The registered study: either grid writes docs/fedsdr.md (its title names the grid)."""
    grid = QUICK if quick else FULL
    out = Path(out) / ("fedsdr-quick" if quick else "fedsdr")
    errors, wall = run_grid(grid, out)
    command = "fedfm reproduce fedsdr" + (" --quick" if quick else "")
    return write_report(grid, out, Path("docs") / "fedsdr.md", command, errors, wall)
