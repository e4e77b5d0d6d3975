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
overall difference is the mean over domains, its SE √(Σ_d SE_d²) / D
(:func:`fedfm.reproduce.stats.mean_of`). One seed: the SE says what the item count can
resolve, not the spread over seeds or partitions.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfm.analyze import REWRITE_KEYS, distribution_analysis, update_cosine_rows
from fedfm.reproduce.framework import Context, Readout, Run, RunView, Study, preset, register
from fedfm.reproduce.stats import NONE, Estimate, mean_of, paired
from fedfm.reproduce.tables import head, marked, num, row, table

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
    eval_before=False,
    eval_per_domain=16,
)
FULL = Grid(OPTIMIZERS, rounds=3, steps=6, per_domain=32)


def job_config(grid: Grid, opt: str, method: str) -> dict[str, Any]:
    """The run config of one (optimizer, method) cell."""
    cfg = preset("fedsdr")
    cfg.update(rounds=grid.rounds, plots=False, eval_every=grid.rounds)
    cfg["eval_before"] = grid.eval_before and (opt, method) == (grid.optimizers[0], "base")
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


def jobs(ctx: Context[Grid]) -> list[Run]:
    """Every (optimizer, method) run, optimizer by optimizer (the first rewrites for all)."""
    grid = ctx.grid
    return [
        Run(f"{o}-{m}", job_config(grid, o, m), group=m) for o in grid.optimizers for m in METHODS
    ]


Results = dict[str, RunView]


def read(ctx: Context[Grid]) -> Results:
    """The finished runs, by name."""
    names = [f"{o}-{m}" for o in ctx.grid.optimizers for m in METHODS]
    return {n: ctx.run(n) for n in names if ctx.run(n).finished}


def paired_diff(a: RunView, b: RunView) -> dict[str, Estimate]:
    """Per-domain and overall mean score difference ``a − b`` over shared items, with SEs.

    Returns:
        ``{domain: Estimate}`` and ``"overall"``: the mean over domains (SE √(Σ SE²) / D).
    """
    sb = {(it["id"], it.get("zeroshot", False)): float(it["score"]) for it in b.items()}
    by: dict[str, dict[Any, float]] = {}
    for it in a.items():
        key = (it["id"], it.get("zeroshot", False))
        by.setdefault(str(it["domain"]), {})[key] = float(it["score"])
    out = {d: paired(v, sb) for d, v in sorted(by.items())}
    out = {d: e for d, e in out.items() if e.n}
    if out:
        out["overall"] = mean_of(list(out.values()))
    return out


def _win(a: RunView, b: RunView) -> dict[str, float]:
    from fedfm.eval.compare import win_rate

    return win_rate(a.items(), b.items())


def _overall(res: Results, opt: str, a: str, b: str) -> Estimate:
    ra, rb = res.get(f"{opt}-{a}"), res.get(f"{opt}-{b}")
    return paired_diff(ra, rb).get("overall", NONE) if ra and rb else NONE


def _win_rate(res: Results, opt: str) -> Estimate:
    ra, rb = res.get(f"{opt}-fedsd"), res.get(f"{opt}-base")
    if not (ra and rb):
        return NONE
    w = _win(ra, rb)
    return Estimate(w["win_rate"], w["se"], int(w["n"]))


SCORES_NOTE = (
    "The scores here are closeness to the clients' own held-out references (Rouge-L, label"
    " likelihood, maths at a short budget), which rewards copying them; the paper's claim is"
    " the general ability a model keeps (MMLU, BBH, CRASS, DROP, tasks no client trains on)."
    " One seed: the SE covers the evaluated items only."
)


def readouts(grid: Grid) -> list[Readout[Results]]:
    """+FedSD against base and FedSDR against +FedSD on the first optimizer, and the two
    claims this grid cannot test."""
    opt = grid.optimizers[0]
    fedavg = PAPER.get(opt, PAPER["fedavg"])
    return [
        Readout(
            f"+FedSD − base, overall held-out score of the clients' domains ({opt})",
            "paired over items, mean over domains",
            f"+FedSD above base (overall {fedavg[0]} → {fedavg[1]}, on general benchmarks)",
            +1,
            lambda r: _overall(r, opt, "fedsd", "base"),
            scope=SCORES_NOTE,
        ),
        Readout(
            f"+FedSD over base, head-to-head win rate ({opt}; ties half)",
            "per item, SE of the outcomes",
            f"above one half ({fedavg[2]}%)",
            +1,
            lambda r: _win_rate(r, opt),
            null=0.5,
            scope=SCORES_NOTE,
        ),
        Readout(
            f"FedSDR − +FedSD, overall held-out score of the clients' domains ({opt})",
            "paired over items, mean over domains",
            "FedSDR above +FedSD (rectification by the raw answers)",
            +1,
            lambda r: _overall(r, opt, "fedsdr", "fedsd"),
            scope=SCORES_NOTE,
        ),
        Readout(
            "+FedSD − base, general ability kept (domains and text no client trains on)",
            "—",
            "+FedSD keeps more general ability (MMLU, BBH, CRASS, DROP)",
            +1,
            lambda r: NONE,
            scope="This grid evaluates no untrained domain or general text and has no untrained"
            " baseline, so it cannot test the paper's claim.",
            testable=False,
        ),
        Readout(
            "+FedSD − FedIT at +FedSD's update norm (matched drift)",
            "—",
            "the gain comes from the refinery, not from moving the model less",
            +1,
            lambda r: NONE,
            scope="This grid has no FedIT run whose learning rate matches +FedSD's update norm,"
            " so it cannot separate the refinery from a smaller drift.",
            testable=False,
        ),
    ]


# ----------------------------------------------------------------------------- the report


def _score_table(grid: Grid, res: Results) -> list[str]:
    doms = list(grid.domains)
    header = ["optimizer", "method", *doms, "overall"]
    header += ["Δ overall vs base (± SE)", "win rate vs base (± SE)"]
    lines = head(header)
    for opt in grid.optimizers:
        base = res.get(f"{opt}-base")
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                lines.append(f"| {opt} | {LABELS[method]} |" + " — |" * (len(header) - 2))
                continue
            cells = [num(r.final.get(f"score/{d}")) for d in doms] + [num(r.final.get("score"))]
            if method == "base" or base is None:
                cells += ["", ""]
            else:
                w = _win(r, base)
                cells.append(marked(paired_diff(r, base).get("overall")))
                cells.append(f"{100 * w['win_rate']:.1f}% ± {100 * w['se']:.1f}")
            lines.append(row([opt, LABELS[method], *cells]))
    return lines


def _domain_diff_table(grid: Grid, res: Results) -> list[str]:
    rows = []
    for opt in grid.optimizers:
        for a, b in (("fedsd", "base"), ("fedsdr", "base"), ("fedsdr", "fedsd")):
            ra, rb = res.get(f"{opt}-{a}"), res.get(f"{opt}-{b}")
            if ra is not None and rb is not None:
                d = paired_diff(ra, rb)
                label = f"{LABELS[a]} − {LABELS[b]}"
                rows.append([opt, label, *(marked(d.get(x)) for x in grid.domains)])
    return table(["optimizer", "comparison", *grid.domains], rows)


def _rewrite_lines(res: Results) -> list[str]:
    zero = next(
        (r.metrics[0] for r in res.values() if r.metrics and "fedsd/kept_share" in r.metrics[0]),
        None,
    )
    if zero is None:
        return ["No run logged rewrite statistics."]
    return table(
        ["statistic", "value"],
        [[label, num(float(zero[k]), d)] for k, label, d in REWRITE_KEYS if k in zero],
    )


TRAINED_ON = {"base": "raw answers", "fedsd": "distilled", "fedsdr": "LoRA-R on raw, S active"}


def _cosine_table(grid: Grid, res: Results) -> list[str]:
    """Mean / min pairwise cosine of the clients' updates per round, by method."""
    rounds = range(1, grid.rounds + 1)
    rows = []
    for opt in grid.optimizers:
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                continue
            cos = {k: (m, lo) for k, m, lo in update_cosine_rows(r.metrics)}
            cells = [f"{cos[k][0]:.4f} / {cos[k][1]:.4f}" if k in cos else "—" for k in rounds]
            rows.append([opt, LABELS[method], TRAINED_ON[method], *cells])
    header = ["optimizer", "method", "trained on", *(f"round {r} mean / min" for r in rounds)]
    return table(header, rows)


def _bytes_table(grid: Grid, res: Results) -> list[str]:
    """Uplink bytes per training round from the audit ledger (the rows' ``bytes_up*``)."""
    rows = []
    for opt in grid.optimizers:
        for method in METHODS:
            r = res.get(f"{opt}-{method}")
            if r is None:
                continue
            trained = [x for x in r.metrics if int(x["round"]) > 0]
            cells = [
                ", ".join(f"{v:,}" for v in sorted({int(x.get(key, 0)) for x in trained}))
                for key in ("bytes_up_arrays", "bytes_up_meta")
            ]
            label = "base (FedIT)" if method == "base" else LABELS[method]
            rows.append([opt, label, *cells])
    header = ["optimizer", "method", "uplink array bytes / round", "uplink meta bytes / round"]
    return table(header, rows)


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _round_times(res: Results) -> tuple[float, float]:
    """Mean seconds of a training round without evaluation and of the final evaluation (the
    last round's time less the run's earlier training rounds' mean, at least 0)."""
    train, evals = [], []
    for r in res.values():
        by = {k: float(x.get("time_s", 0.0)) for k, x in r.rounds.items()}
        last = max(by)
        plain = [t for k, t in by.items() if 0 < k < last]
        if plain:
            train.append(float(np.mean(plain)))
            evals.append(max(by[last] - train[-1], 0.0))
    return _mean(train), _mean(evals)


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


def _eval_counts(res: Results) -> str:
    """The evaluated items per domain, as the runs' items show them (e.g. ``16``)."""
    counts = {
        n for r in res.values() for n in Counter(str(i["domain"]) for i in r.items()).values()
    }
    if not counts:
        return "no"
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _full_grid_lines(grid: Grid, res: Results) -> list[str]:
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
        tokens = int(preset("fedsdr")["task"]["max_new_tokens"])
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


def _setup_lines(ctx: Context[Grid], res: Results) -> list[str]:
    from fedfm.config import load_config
    from fedfm.engine import resolve

    grid = ctx.grid
    ref_cfg = load_config(job_config(grid, grid.optimizers[0], "fedsdr"))
    algo_cfg, task_cfg = resolve(ref_cfg)  # with every default filled in
    task, train = task_cfg.model_dump(), ref_cfg.train.model_dump()
    zeros = [r.metrics[0] for r in res.values() if r.metrics and "fedsd/rows" in r.metrics[0]]
    made = [float(z["time_s"]) for z in zeros if not z.get("fedsd/cached_clients")]
    read_ = [float(z["time_s"]) for z in zeros if z.get("fedsd/cached_clients")]
    return [
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
        f"- Wall time: {sum(r.wall_s for r in res.values()) / 60:.1f} min summed over the runs'"
        f" rounds ({len(res)} runs; {_rewrite_time(made, read_, len(zeros))}); one thread per"
        " run (the jobs' times and the machine's load are at the end).",
        "",
    ]


def body(ctx: Context[Grid], res: Results) -> list[str]:
    """Setup, held-out scores, rewrites, answer distributions, cosines, bytes, the full grid."""
    grid = ctx.grid
    first = f"{grid.optimizers[0]}-fedsd"
    cfg = job_config(grid, grid.optimizers[0], "fedsd")
    dist = distribution_analysis(ctx.out / first, cfg) if first in res else None
    base0 = next(
        (r.metrics[0] for r in res.values() if r.metrics and "score" in r.metrics[0]), None
    )
    lines = [
        "FedSDR (ICML 2026, arXiv 2605.18028; METHODS.md section 1): FedSD rewrites of every "
        "client's answers by the global model before round 1, dual-stream LoRA (LoRA-S on the "
        "rewrites, LoRA-R on the raw answers), only LoRA-R aggregated.",
        "",
        *_setup_lines(ctx, res),
    ]
    if base0 is not None:
        lines += [
            f"The untrained model (round 0 of `{grid.optimizers[0]}-base`): overall "
            f"{num(float(base0['score']))}; "
            + ", ".join(f"{d} {num(base0.get(f'score/{d}'))}" for d in grid.domains)
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
        *table(
            ["optimizer", "base", "+FedSD", "win rate"],
            [[o, b, s, f"{w}%"] for o, (b, s, w) in PAPER.items()],
        ),
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
            *table(
                ["measure", "raw", "distilled", "paper raw → distilled"],
                [
                    [
                        "JS divergence (bits, mean over client pairs)",
                        num(dist["js_raw"], 4),
                        num(dist["js_distilled"], 4),
                        f"{PAPER_JS[0]} → {PAPER_JS[1]}",
                    ],
                    [
                        "TF-IDF cosine (mean over client pairs)",
                        num(dist["tfidf_raw"], 4),
                        num(dist["tfidf_distilled"], 4),
                        f"{PAPER_TFIDF[0]} → {PAPER_TFIDF[1]}",
                    ],
                ],
            ),
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
        *_full_grid_lines(grid, res),
    ]
    missing = [f"{o}-{m}" for o in grid.optimizers for m in METHODS if f"{o}-{m}" not in res]
    if missing:
        lines += [
            "## Runs not finished",
            "",
            f"{', '.join(f'`{m}`' for m in missing)}: their rows above are empty. `{ctx.command}`"
            " finishes them (finished runs are skipped, an unfinished one resumes from its last "
            "checkpoint) and rewrites this report.",
            "",
        ]
    return lines


STUDY = register(
    Study(
        name="fedsdr",
        summary="FedSDR: base vs +FedSD vs FedSDR per server optimizer",
        full=FULL,
        quick=QUICK,
        jobs=jobs,
        read=read,
        readouts=readouts,
        title=lambda ctx: f"FedSDR reproduction ({ctx.grid.label})",
        body=body,
        reports=("fedsdr.md", "fedsdr.md"),
    )
)
