"""FedeKD reproduction study: methods x datasets x heterogeneity x seeds, and an ablation over β.

``fedfm reproduce fedekd`` runs every method on the six ``fedekd-*`` presets (four
classification sets, two regression sets) at two Dirichlet concentrations and three seeds,
measures negative transfer per client against the matching local-only run (same seed, same
partition), and writes ``docs/fedekd.md`` with tables and figures. ``--quick`` runs a small
grid and writes its report under the output folder instead, so it never replaces the committed
report.

Negative transfer references (ours): FedAvg and FedProx train the shared architecture
(``task.model_args``) and are compared with ``local`` (that architecture trained alone); the
private/proxy methods are compared with ``local-private`` (each client's own private
architecture trained alone for the same budget), so architecture and federation are not
confounded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import os
import platform
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedfm.reproduce import STUDIES

log = logging.getLogger("fedfm")


@dataclass(frozen=True)
class Method:
    """One row of the study.

    Attributes:
        label: Name in the report.
        algorithm: Registered algorithm.
        reference: Method whose run is the local-only reference (None for local-only itself).
        algo: Builds the ``algo`` section from the preset's FedeKD section.
    """

    label: str
    algorithm: str
    reference: str | None
    algo: Callable[[dict[str, Any]], dict[str, Any]]


def _shared(extra: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def build(p: dict[str, Any]) -> dict[str, Any]:
        return {
            "server_opt": p.get("server_opt", {"name": "fedavg"}),
            "personal_eval": True,
            **extra,
        }

    return build


METHODS: dict[str, Method] = {
    "local": Method("local-only (shared arch)", "local", None, lambda p: {}),
    "local-private": Method("local-only (private archs)", "local-private", None, dict),
    "fedavg": Method("FedAvg", "fedavg", "local", _shared({})),
    "fedprox": Method("FedProx (μ=0.01)", "fedprox", "local", _shared({"mu": 0.01})),
    "fedkd-ungated": Method(
        "private/proxy KD, ungated",
        "fedkd-ungated",
        "local-private",
        lambda p: {**p, "gate": "ungated"},
    ),
    "fedekd": Method("FedeKD (gated)", "fedekd", "local-private", dict),
}


@dataclass
class Grid:
    """What the study runs.

    Attributes:
        presets: ``fedekd-*`` presets, one per dataset.
        alphas: Dirichlet concentrations (label skew; binned targets for regression).
        seeds: Run seeds (each also seeds the partition).
        methods: Keys of :data:`METHODS`.
        betas: Gate scales of the ablation (FedeKD at ``ablation_alpha``; the preset's β is
            taken from the main grid).
        ablation_alpha: Concentration of the ablation.
        rounds: Rounds per run (None: the preset's).
        train: Overrides of the ``train`` section.
        workers: Parallel worker processes (one torch thread each).
    """

    presets: Sequence[str]
    alphas: Sequence[float] = (0.5, 5.0)
    seeds: Sequence[int] = (0, 1, 2)
    methods: Sequence[str] = tuple(METHODS)
    betas: Sequence[float] = (0.5, 2.0, 4.0)
    ablation_alpha: float = 0.5
    rounds: int | None = None
    train: dict[str, Any] = field(default_factory=dict)
    workers: int = 2


FULL = Grid(
    presets=(
        "fedekd-breast-cancer",
        "fedekd-credit",
        "fedekd-covid",
        "fedekd-digits",
        "fedekd-concrete",
        "fedekd-diabetes",
    )
)
QUICK = Grid(
    presets=("fedekd-breast-cancer", "fedekd-concrete"),
    seeds=(0,),
    betas=(0.0, 4.0),
    rounds=4,
)


@dataclass(frozen=True)
class Job:
    """One run of the grid."""

    preset: str
    alpha: float
    seed: int
    method: str
    beta: float | None = None  # None: the preset's β

    @property
    def name(self) -> str:
        b = "" if self.beta is None else f"-b{self.beta:g}"
        return (
            f"{self.preset.removeprefix('fedekd-')}-a{self.alpha:g}-s{self.seed}-{self.method}{b}"
        )


def jobs_of(grid: Grid) -> list[Job]:
    """Every run of the grid: the main grid, then the β ablation."""
    jobs = [
        Job(p, a, s, m)
        for p in grid.presets
        for a in grid.alphas
        for s in grid.seeds
        for m in grid.methods
    ]
    if "fedekd" in grid.methods:
        jobs += [
            Job(p, grid.ablation_alpha, s, "fedekd", b)
            for p in grid.presets
            for s in grid.seeds
            for b in grid.betas
        ]
    return jobs


def preset_data(preset: str) -> dict[str, Any]:
    """A preset as a validated, complete config mapping."""
    from fedfm.config import load_config

    return load_config(preset).model_dump(mode="json")


def preset_beta(preset: str) -> float:
    """The gate scale β of a preset (FedeKD's default when the preset does not set it)."""
    from fedfm.algorithms.fedekd import FedeKDConfig

    return FedeKDConfig(**preset_data(preset).get("algo", {})).beta


def job_config(job: Job, grid: Grid, out: Path) -> dict[str, Any]:
    """The run config of one job: the preset with the method, α, seed and study settings."""
    data = preset_data(job.preset)
    method = METHODS[job.method]
    algo = method.algo(dict(data.get("algo", {})))
    if job.beta is not None:
        algo["beta"] = job.beta
    rounds = grid.rounds or int(data.get("rounds", 15))
    data.update(
        name=job.name,
        seed=job.seed,
        algorithm=method.algorithm,
        algo=algo,
        rounds=rounds,
        out_dir=str(out),
        eval_every=rounds,  # only the final round is reported: skip the intermediate evals
        eval_before=False,
        plots=False,
        threads=1,
    )
    data["partition"] = {**data.get("partition", {}), "alpha": job.alpha}
    data["train"] = {**data.get("train", {}), **grid.train}
    return data


def run_job(cfg: dict[str, Any]) -> tuple[str, str | None]:
    """Runs one config (in a worker process); returns (run name, error or None)."""
    import fedfm.algorithms.fedekd  # noqa: F401  (registers fedekd, fedkd-ungated, local-private)
    from fedfm.config import load_config
    from fedfm.runtime import run

    try:
        run(load_config(cfg), overwrite=True, progress=False)
        return cfg["name"], None
    except Exception as e:  # a failed run is reported in the study, not fatal to it
        return cfg["name"], f"{type(e).__name__}: {e}"


def _run_all(cfgs: list[dict[str, Any]], workers: int) -> dict[str, str]:
    if workers <= 1:
        results = [run_job(c) for c in cfgs]
    else:
        # spawn: fresh interpreters, no forked torch thread pools.
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            results = list(pool.map(run_job, cfgs, chunksize=1))
    return {name: err for name, err in results if err}


# ----------------------------------------------------------------------------- analysis


@dataclass
class Cell:
    """One (dataset, α, method[, β]) cell: per-seed values of each statistic."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, v: float) -> None:
        self.values.setdefault(key, []).append(v)


def _metrics(kind: str) -> list[tuple[str, bool]]:
    """(metric, higher_is_better) reported for a task kind."""
    return [("rmse", False)] if kind == "regression" else [("acc", True), ("macro_f1", True)]


def analyse(grid: Grid, out: Path) -> dict[str, Any]:
    """Reads every run of the grid; per-seed mean metric and mean/worst negative transfer."""
    from fedfm.algorithms.fedekd import client_metric, negative_transfer

    cells: dict[tuple[Any, ...], Cell] = {}
    kinds: dict[str, str] = {}
    for job in jobs_of(grid):
        run = out / job.name
        if not (run / "client_metrics.jsonl").exists():
            continue
        kind = _kind_of(run)
        kinds[job.preset] = kind
        key = (job.preset, job.alpha, job.method, job.beta)
        cell = cells.setdefault(key, Cell())
        ref_method = METHODS[job.method].reference
        ref = out / Job(job.preset, job.alpha, job.seed, ref_method).name if ref_method else None
        for metric, hib in _metrics(kind):
            mine = client_metric(run, metric)
            cell.add(metric, float(np.mean(list(mine.values()))))
            if ref is not None and (ref / "client_metrics.jsonl").exists():
                nt = negative_transfer(mine, client_metric(ref, metric), hib)
                cell.add(f"nt_{metric}", nt["mean"])
                cell.add(f"nt_{metric}_worst", nt["worst"])
    return {"cells": cells, "kinds": kinds}


def _kind_of(run: Path) -> str:
    import json

    summary = json.loads((run / "summary.json").read_text())
    return "regression" if summary["primary"] == "rmse" else "classification"


def _fmt(vals: list[float] | None, digits: int = 3) -> str:
    if not vals:
        return "—"
    m = float(np.mean(vals))
    if len(vals) == 1:
        return f"{m:.{digits}f}"
    s = float(np.std(vals, ddof=1))
    return f"{m:.{digits}f} ± {s:.{digits}f}"


# ----------------------------------------------------------------------------- report


def _main_table(grid: Grid, res: dict[str, Any], preset: str) -> list[str]:
    kind = res["kinds"].get(preset, "classification")
    metrics = _metrics(kind)
    head = ["α", "method"]
    for m, _ in metrics:
        name = {"acc": "acc", "macro_f1": "macro-F1", "rmse": "RMSE"}[m]
        head += [f"{name} (mean client)", f"NT {name} mean", f"NT {name} worst"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in grid.alphas:
        for meth in grid.methods:
            cell = res["cells"].get((preset, a, meth, None))
            row = [f"{a:g}", METHODS[meth].label]
            for m, _ in metrics:
                v = cell.values if cell else {}
                row += [_fmt(v.get(m)), _fmt(v.get(f"nt_{m}")), _fmt(v.get(f"nt_{m}_worst"))]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _betas(grid: Grid) -> list[float]:
    """β values of the ablation: the grid's and each preset's own (run in the main grid)."""
    return sorted({*grid.betas, *(preset_beta(p) for p in grid.presets)})


def _beta_cell(grid: Grid, res: dict[str, Any], preset: str, beta: float) -> Cell | None:
    """FedeKD's cell at ``beta``: the main grid's run when β is the preset's own."""
    key_b = None if beta == preset_beta(preset) else beta
    return res["cells"].get((preset, grid.ablation_alpha, "fedekd", key_b))


def _ablation_table(grid: Grid, res: dict[str, Any]) -> list[str]:
    betas = _betas(grid)
    head = ["dataset", "statistic", "ungated (β=0)", *[f"β={b:g}" for b in betas]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for preset in grid.presets:
        kind = res["kinds"].get(preset, "classification")
        m = _metrics(kind)[0][0]
        for stat, label in (
            (m, m),
            (f"nt_{m}", f"NT {m} mean"),
            (f"nt_{m}_worst", f"NT {m} worst"),
        ):
            cell = res["cells"].get((preset, grid.ablation_alpha, "fedkd-ungated", None))
            row = [
                preset.removeprefix("fedekd-"),
                label,
                _fmt(cell.values.get(stat) if cell else None),
            ]
            for b in betas:
                cell = _beta_cell(grid, res, preset, b)
                row.append(_fmt(cell.values.get(stat) if cell else None))
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _groups(grid: Grid, res: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Presets by task kind: classification (accuracy NT) and regression (RMSE NT) get their own
    panels, since their scales differ by orders of magnitude."""
    out = []
    for kind, label in (("classification", "accuracy"), ("regression", "RMSE")):
        ps = [p for p in grid.presets if res["kinds"].get(p, "classification") == kind]
        if ps:
            out.append((label, ps))
    return out


def _figures(grid: Grid, res: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    groups = _groups(grid, res)
    fed = [m for m in grid.methods if METHODS[m].reference is not None]
    width = 0.8 / max(len(fed), 1)
    fig, axes = plt.subplots(
        len(grid.alphas),
        len(groups),
        figsize=(4.5 * len(groups) + 1, 3.2 * len(grid.alphas)),
        squeeze=False,
        gridspec_kw={"width_ratios": [len(ps) for _, ps in groups]},
    )
    for r, a in enumerate(grid.alphas):
        for c, (label, presets) in enumerate(groups):
            ax = axes[r, c]
            for j, meth in enumerate(fed):
                means, worsts = [], []
                for p in presets:
                    m = _metrics(res["kinds"].get(p, "classification"))[0][0]
                    cell = res["cells"].get((p, a, meth, None))
                    v = cell.values if cell else {}
                    means.append(float(np.mean(v.get(f"nt_{m}", [math.nan]))))
                    worsts.append(float(np.mean(v.get(f"nt_{m}_worst", [math.nan]))))
                x = np.arange(len(presets)) + (j - (len(fed) - 1) / 2) * width
                bars = ax.bar(x, means, width, label=METHODS[meth].label)
                ax.scatter(x, worsts, marker="v", color=bars.patches[0].get_facecolor(), zorder=3)
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xticks(np.arange(len(presets)))
            ax.set_xticklabels([p.removeprefix("fedekd-") for p in presets])
            ax.set_ylabel(f"NT, {label}")
            ax.set_title(f"α = {a:g}: bar = mean client, ▼ = worst client", fontsize=10)
    axes[0, 0].legend(fontsize=7, ncols=2)
    fig.tight_layout()
    paths.append(folder / "negative_transfer.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    betas = _betas(grid)
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.2 * len(groups)), squeeze=False)
    for r, (label, presets) in enumerate(groups):
        for p in presets:
            m = _metrics(res["kinds"].get(p, "classification"))[0][0]
            for ax, stat in zip(axes[r], (f"nt_{m}", f"nt_{m}_worst"), strict=True):
                cells = [res["cells"].get((p, grid.ablation_alpha, "fedkd-ungated", None))]
                cells += [_beta_cell(grid, res, p, b) for b in betas]
                ys = [
                    float(np.mean(c.values.get(stat, [math.nan]))) if c else math.nan for c in cells
                ]
                ax.plot([0.0, *betas], ys, marker="o", label=p.removeprefix("fedekd-"))
        for ax, t in zip(axes[r], ("mean client", "worst client"), strict=True):
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xlabel("gate scale β (β = 0: ungated, uniform weights)")
            ax.set_ylabel(f"NT, {label}")
            ax.set_title(f"FedeKD, α = {grid.ablation_alpha:g}: {t}", fontsize=10)
        axes[r, 0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(folder / "beta_ablation.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _preset_summary(preset: str) -> str:
    d = preset_data(preset)
    t, a, p, tr = d["task"], d.get("algo", {}), d["partition"], d.get("train", {})
    skew = f"{p['scheme']} by {p.get('by', 'label')}" + (
        f" ({p['bins']} bins)" if p.get("bins") else ""
    )
    return (
        f"| {preset.removeprefix('fedekd-')} | {t['dataset']} ({t['kind']}) |"
        f" {t.get('model', 'mlp')} {t.get('model_args', {})} |"
        f" {a.get('private_archs')} | {a.get('proxy_arch')} |"
        f" {p['num_clients']}, {skew}, min {p.get('min_size')} | {d.get('rounds')} |"
        f" {tr.get('steps')} steps per stage, bs {tr.get('batch_size')}, {tr.get('optimizer')}"
        f" lr {tr.get('lr')} |"
    )


def _data_notes(grid: Grid) -> list[str]:
    """Rows the sources dropped (missing numeric feature or target), captured from their log."""
    from fedfm.data.sources import load_source

    notes: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    handler = Grab(logging.WARNING)
    data_log = logging.getLogger("fedfm.data")
    data_log.addHandler(handler)
    try:
        for preset in grid.presets:
            load_source(preset_data(preset)["task"]["dataset"])
    finally:
        data_log.removeHandler(handler)
    return notes


INTRO = """\
# FedeKD: energy-gated federated knowledge distillation — reproduction

Paper: Nguyen, Wang, Ku, *FedeKD: Energy-Based Gating for Robust Federated Knowledge
Distillation under Heterogeneity*, arXiv:2605.05553. Code: `src/fedfm/algorithms/fedekd.py`
(algorithm), `src/fedfm/core/kd.py` (losses, energies, gates), this study:
`src/fedfm/reproduce/fedekd.py`. This page is written by the study; do not edit it by hand.

## The method in brief

Each client keeps a private model f_k (never sent; its architecture may differ per client)
and a small proxy g_k whose architecture all clients share. A round has two exchanges:

1. **forward**: the client receives the global proxy, trains it to mimic its frozen private
   model on local data (KL on softmax, or squared error for regression) and sends it back;
   the server aggregates the proxies (FedAvg here; any server optimizer works).
2. **backward**: the client receives the new global proxy g and updates f_k with
   `sup. loss + λ · Σ w·D(f_k(x), g(x)) / Σ w`, where the trust weight `w = gate(E(x))` falls
   as the private–proxy energy rises: E = ½(KL(p‖q)+KL(q‖p)) / (H(p)+H(q)+1e-8) for
   classification, E = ½‖f_k(x) − g(x)‖² for regression (paper eqs. 1–2).

The gate is pluggable (`algo.gate`, registry `fedfm.core.kd.GATES`). Default (ours; the paper
only says "batch-normalised"): `w = sigmoid(−β·z)`, z the batch-standardised energy, β = 1,
λ = 1, weights detached. `fedkd-ungated` uses w = 1 (FML/FedKD style). With β = 0 every weight
is ½, so after the Σw normalisation β = 0 is the ungated baseline (the ablation's "ungated"
column; `tests/test_fedekd.py` checks the two agree). Only the proxy travels: in every run's
audit ledger `proxy` is the only array field.
"""


@dataclass
class Timing:
    """How long the grid took: wall clock, CPU of every process, and the machine's load.

    The load averages say how much other work shared the cores: wall time on a busy machine
    overstates the study's own cost, which the CPU time measures.
    """

    wall_s: float
    cpu_s: float
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]

    def line(self) -> str:
        """One report line."""
        ls, le = (f"{x[0]:.1f}" for x in (self.load_start, self.load_end))
        return (
            f"- Wall time: {self.wall_s / 60:.1f} min; CPU time of all processes"
            f" {self.cpu_s / 60:.1f} min; 1-minute load average {ls} at the start, {le} at"
            f" the end, on {os.cpu_count()} CPU cores ({platform.machine()}, Python"
            f" {platform.python_version()})."
        )


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the worker processes)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _findings(grid: Grid, res: dict[str, Any]) -> list[str]:
    """Counts, from the tables, how often FedeKD's negative transfer beats each baseline's."""
    lines = []
    for other in ("fedkd-ungated", "fedavg", "fedprox"):
        if other not in grid.methods or "fedekd" not in grid.methods:
            continue
        n = mean_wins = worst_wins = 0
        for p in grid.presets:
            m = _metrics(res["kinds"].get(p, "classification"))[0][0]
            for a in grid.alphas:
                mine = res["cells"].get((p, a, "fedekd", None))
                theirs = res["cells"].get((p, a, other, None))
                if not (
                    mine and theirs and f"nt_{m}" in mine.values and f"nt_{m}" in theirs.values
                ):
                    continue
                n += 1
                mean_wins += np.mean(mine.values[f"nt_{m}"]) > np.mean(theirs.values[f"nt_{m}"])
                worst_wins += np.mean(mine.values[f"nt_{m}_worst"]) > np.mean(
                    theirs.values[f"nt_{m}_worst"]
                )
        if n:
            lines.append(
                f"- FedeKD vs {METHODS[other].label}: higher mean-client NT in {mean_wins} of {n}"
                f" (dataset, α) cells, higher worst-client NT in {worst_wins} of {n}."
            )
    return lines


def write_report(
    grid: Grid,
    out: Path,
    report: Path,
    timing: Timing,
    command: str,
    failed: dict[str, str],
    notes: Sequence[str] = (),
) -> Path:
    """Writes the markdown report with its figures (in a folder next to it)."""
    res = analyse(grid, out)
    figs = _figures(grid, res, report.parent / report.stem)
    n_jobs = len(jobs_of(grid))
    lines = [
        INTRO,
        "## How to reproduce",
        "",
        "```",
        command,
        "```",
        "",
        f"- Runs: {n_jobs} ({len(grid.presets)} datasets × {len(grid.alphas)} α ×"
        f" {len(grid.seeds)} seeds × {len(grid.methods)} methods, plus the β ablation),"
        f" {grid.workers} worker process(es) with one torch thread each.",
        f"- Seeds: {', '.join(map(str, grid.seeds))} (the seed also draws the partition, so every"
        " method of a seed sees the same clients).",
        f"- Dirichlet concentrations α: {', '.join(f'{a:g}' for a in grid.alphas)}"
        " (label skew; for regression over quantile bins of the target).",
        f"- β ablation: FedeKD at α = {grid.ablation_alpha:g}, β ∈"
        f" {{{', '.join(f'{b:g}' for b in _betas(grid))}}}.",
        timing.line(),
        *([f"- Rounds overridden to {grid.rounds}."] if grid.rounds else []),
        *([f"- Local training overridden: {grid.train}."] if grid.train else []),
        "",
        "| preset | data | shared arch (FedAvg, FedProx, local) | private archs (cycled) |"
        " proxy | clients, skew | rounds | local training |",
        "|---|---|---|---|---|---|---|---|",
        *[_preset_summary(p) for p in grid.presets],
        "",
        "**Metrics.** Each client's model on its own local test split (25 % of its partition),"
        ' averaged over clients ("mean client"), then mean ± sample std over seeds.'
        " **Negative transfer** (NT) per client = federated − local-only for accuracy and"
        " macro-F1, local-only − federated for RMSE, so a negative value always means the"
        ' federation hurt that client; "worst" is the most harmed client. References: FedAvg'
        " and FedProx against the shared architecture trained alone (`local`), the"
        " private/proxy methods against each client's private architecture trained alone"
        " (`local-private`, same budget as FedeKD's backward stage). Local test splits are"
        " small (a few rows on the smallest clients), so worst-client values are noisy.",
        "",
    ]
    if notes:
        lines += ["**Data notes.** " + "; ".join(notes) + ".", ""]
    lines += ["## Results", ""]
    findings = _findings(grid, res)
    if findings:
        lines += [
            "Counted from the tables below (first metric of each task; means over seeds, so a"
            " count says nothing about whether a difference exceeds the spread over seeds):",
            "",
            *findings,
            "",
        ]
    for preset in grid.presets:
        lines += [f"### {preset.removeprefix('fedekd-')}", "", *_main_table(grid, res, preset), ""]
    if "fedekd" in grid.methods and grid.betas:
        lines += [
            "## Ablation over the gate scale β",
            "",
            f"FedeKD at α = {grid.ablation_alpha:g} (the preset's own β is the main grid's run),"
            " with the ungated baseline for comparison; first metric of each task (acc or RMSE).",
            "",
            *_ablation_table(grid, res),
            "",
        ]
    lines += ["## Figures", ""]
    lines += [f"![{f.stem}]({report.stem}/{f.name})" for f in figs]
    lines += [""]
    if failed:
        lines += ["## Failed runs", "", *[f"- `{k}`: {v}" for k, v in sorted(failed.items())], ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines))
    return report


def run_study(grid: Grid, out: Path, report: Path, command: str) -> Path:
    """Runs the grid into ``out`` and writes ``report``; returns its path."""
    t0, cpu0, load0 = time.perf_counter(), _cpu_seconds(), os.getloadavg()
    notes = _data_notes(grid)  # before the runs: sources log their dropped rows on first load
    cfgs = [job_config(j, grid, out) for j in jobs_of(grid)]
    failed = _run_all(cfgs, grid.workers)
    timing = Timing(time.perf_counter() - t0, _cpu_seconds() - cpu0, load0, os.getloadavg())
    return write_report(grid, out, report, timing, command, failed, notes)


@STUDIES.register("fedekd", "FedeKD vs local, FedAvg, FedProx, ungated KD on six datasets")
def fedekd_study(out: Path, quick: bool) -> Path:
    """The registered study: the full grid into docs/fedekd.md, or the quick one into ``out``."""
    out = Path(out) / ("fedekd-quick" if quick else "fedekd")
    workers = min(2, os.cpu_count() or 1)
    if quick:
        grid = dataclasses.replace(QUICK, workers=workers)
        return run_study(grid, out, out / "fedekd-quick.md", "fedfm reproduce fedekd --quick")
    grid = dataclasses.replace(FULL, workers=workers)
    return run_study(grid, out, Path("docs") / "fedekd.md", "fedfm reproduce fedekd")
