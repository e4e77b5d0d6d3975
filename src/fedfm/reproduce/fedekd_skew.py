"""FedeKD reproduction study.

Negative transfer with standard errors, the gate's β × λ grid, stronger skew, and negative transfer
over a longer run.

``fedfm reproduce fedekd_skew`` runs, on the six ``fedekd-*`` presets, the **main grid** (two
skewed settings, five seeds, the baselines and FedeKD at every (β, λ)), chooses β and λ by the
rule below on each client's validation split, then runs with the chosen (β, λ) the near-IID
**control** setting and the **long runs** (60 rounds on three presets).

The rule that chooses β and λ (stated before the grid ran; it never reads a test number):
for every (dataset, skewed setting) cell of the main grid, the 12 gated configurations are
ranked by their mean-client negative transfer on the validation split (primary metric:
accuracy, or RMSE for regression), averaged over seeds (rank 1 = least harmful, ties share
the mean rank); the configuration with the lowest mean rank over all cells is chosen; ties go
to the smaller β, then the smaller λ. FedeKD's default (``FedeKDConfig``) follows the chosen
configuration; the report says whether the two agree.
"""

from __future__ import annotations

import copy
import functools
import logging
import logging.handlers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import numpy as np

from fedfm import plots
from fedfm.reproduce.framework import (
    Context,
    Readout,
    Run,
    RunView,
    preset,
    register,
    untestable,
)
from fedfm.reproduce.stats import Estimate, mean_se, paired, pooled_paired
from fedfm.reproduce.tables import Text, band, head, joined, row, save, side, values

TEXT = Text("fedekd_skew")

# The gate setting FedeKD had as its default before the selection rule was first applied; the
# study always runs it, so the report can compare it with the rule's choice.
REFERENCE_GATE = (1.0, 1.0)


class Method(NamedTuple):
    """A family of rows (its key is the registered algorithm).

    Its name in the report and the method whose run is its local-only reference (None for local-only
    itself).
    """

    label: str
    reference: str | None


METHODS: dict[str, Method] = {
    "local": Method("local-only (shared arch)", None),
    "local-private": Method("local-only (private archs)", None),
    "fedavg": Method("FedAvg", "local"),
    "fedprox": Method("FedProx (μ=0.01)", "local"),
    "fedkd-ungated": Method("ungated KD", "local-private"),
    "fedekd": Method("FedeKD", "local-private"),
}
BASELINES = ("local", "local-private", "fedavg", "fedprox")


@dataclass(frozen=True)
class Variant:
    """A method with its gate settings: β and λ for FedeKD, λ for ungated KD."""

    method: str
    beta: float | None = None
    lam: float | None = None

    @property
    def key(self) -> str:
        """Stable name in run folders, e.g. ``fedekd-b4-l0.5``."""
        b = "" if self.beta is None else f"-b{self.beta:g}"
        lam = "" if self.lam is None else f"-l{self.lam:g}"
        return f"{self.method}{b}{lam}"

    @property
    def label(self) -> str:
        """Name in the report, e.g. ``FedeKD (β=4, λ=0.5)``."""
        parts = [f"β={self.beta:g}"] if self.beta is not None else []
        parts += [f"λ={self.lam:g}"] if self.lam is not None else []
        base = METHODS[self.method].label
        return f"{base} ({', '.join(parts)})" if parts else base

    @property
    def reference(self) -> Variant | None:
        """The local-only variant this one's negative transfer is measured against."""
        ref = METHODS[self.method].reference
        return Variant(ref) if ref else None

    def algo(self, preset_algo: Mapping[str, Any]) -> dict[str, Any]:
        """The run's ``algo`` section, every gate field explicit (defaults may change)."""
        if self.method == "local":
            return {}
        if self.method in ("fedavg", "fedprox"):
            algo = {"server_opt": preset_algo.get("server_opt", {"name": "fedavg"})}
            algo["personal_eval"] = True
            return {**algo, "mu": 0.01} if self.method == "fedprox" else algo
        keep = ("proxy_arch", "private_archs", "server_opt")
        algo = {k: copy.deepcopy(preset_algo[k]) for k in keep if k in preset_algo}
        if self.method == "fedkd-ungated":
            algo.update(gate="ungated", lam=self.lam)
        elif self.method == "fedekd":
            algo.update(gate="sigmoid", beta=self.beta, lam=self.lam)
        return algo


def gated(beta: float, lam: float) -> Variant:
    """FedeKD at (β, λ)."""
    return Variant("fedekd", float(beta), float(lam))


def ungated(lam: float) -> Variant:
    """Ungated private/proxy KD at λ."""
    return Variant("fedkd-ungated", lam=float(lam))


@dataclass(frozen=True)
class Setting:
    """A heterogeneity setting: Dirichlet α over ``num_clients``, the smallest partition."""

    alpha: float
    num_clients: int
    min_size: int | None = None

    @property
    def tag(self) -> str:
        """Stable name in run folders, e.g. ``a0.5-k10``."""
        return f"a{self.alpha:g}-k{self.num_clients}"

    @property
    def label(self) -> str:
        """Name in the report."""
        return f"α={self.alpha:g}, {self.num_clients} clients"


@dataclass
class Grid:
    """What the study runs.

    Attributes:
        presets: ``fedekd-*`` presets, one per dataset.
        settings: Skewed settings of the main grid (every variant; the rule ranks these).
        control_settings: The near-IID control, run after the choice (featured variants).
        seeds, betas, lams, rounds: The main grid's seeds (each draws the partition and the
            splits), gate scales, backward weights (also ungated KD's) and rounds (None: the
            preset's).
        eval_every: Clients are evaluated every this many rounds (and after the last).
        val_fraction: Share of each client's partition held out for validation.
        long_presets, long_setting, long_seeds, long_rounds, long_eval_every: The long runs.
        train: Overrides of the ``train`` section.
    """

    presets: Sequence[str]
    settings: Sequence[Setting] = (Setting(0.1, 4, 16), Setting(0.5, 10))
    control_settings: Sequence[Setting] = (Setting(5.0, 10),)
    seeds: Sequence[int] = (0, 1, 2, 3, 4)
    betas: Sequence[float] = (1.0, 2.0, 4.0, 8.0)
    lams: Sequence[float] = (0.5, 1.0, 2.0)
    rounds: int | None = None
    eval_every: int = 3
    val_fraction: float = 0.15
    long_presets: Sequence[str] = ()
    long_setting: Setting = Setting(0.5, 10)
    long_seeds: Sequence[int] = (0, 1, 2, 3, 4)
    long_rounds: int = 60
    long_eval_every: int = 3
    train: dict[str, Any] = field(default_factory=dict)

    def all_settings(self) -> list[Setting]:
        """Main and control settings, in report order."""
        return [*self.settings, *self.control_settings]

    def configs(self) -> list[tuple[float, float]]:
        """The gated (β, λ) configurations of the main grid."""
        return [(float(b), float(lam)) for b in self.betas for lam in self.lams]

    def main_variants(self) -> list[Variant]:
        """Every variant of the main grid: baselines, ungated KD per λ, FedeKD per (β, λ)."""
        return [
            *(Variant(m) for m in BASELINES),
            *(ungated(lam) for lam in self.lams),
            *(gated(b, lam) for b, lam in self.configs()),
        ]


DATASETS = ("breast-cancer", "credit", "covid", "digits", "concrete", "diabetes")
FULL = Grid(
    presets=tuple(f"fedekd-{d}" for d in DATASETS),
    long_presets=("fedekd-breast-cancer", "fedekd-credit", "fedekd-diabetes"),
)
QUICK = Grid(
    presets=("fedekd-breast-cancer", "fedekd-concrete"),
    settings=(Setting(0.5, 10),),
    control_settings=(),
    seeds=(0, 1),
    betas=(1.0, 4.0),
    lams=(1.0,),
    rounds=2,
    eval_every=1,
    long_presets=("fedekd-concrete",),
    long_seeds=(0, 1),
    long_rounds=4,
    long_eval_every=2,
    train={"steps": 2},
)


class Cell(NamedTuple):
    """One run of the study."""

    preset: str
    setting: Setting
    seed: int
    variant: Variant
    long: bool = False

    @property
    def name(self) -> str:
        """Run folder name."""
        head = "long-" if self.long else ""
        return f"{head}{_name(self.preset)}-{self.setting.tag}-s{self.seed}-{self.variant.key}"


def main_cells(grid: Grid) -> list[Cell]:
    """The main grid, seed by seed: an interrupted grid has every cell at fewer seeds."""
    return [
        Cell(p, st, s, v)
        for s in grid.seeds
        for st in grid.settings
        for p in grid.presets
        for v in grid.main_variants()
    ]


def featured(choice: tuple[float, float]) -> list[Variant]:
    """The baselines, the chosen and the reference gate, each with ungated KD at its λ."""
    out = [Variant(m) for m in BASELINES]
    for b, lam in (choice, REFERENCE_GATE):
        out += [v for v in (ungated(lam), gated(b, lam)) if v not in out]
    return out


def federated(choice: tuple[float, float]) -> list[Variant]:
    """The featured variants that have a local-only reference (all but local-only)."""
    return [v for v in featured(choice) if v.reference is not None]


def chosen_cells(grid: Grid, choice: tuple[float, float]) -> list[Cell]:
    """What runs once (β, λ) is chosen: the control settings, then the long runs."""
    control = [
        Cell(p, st, s, v)
        for s in grid.seeds
        for st in grid.control_settings
        for p in grid.presets
        for v in featured(choice)
    ]
    return control + [
        Cell(p, grid.long_setting, s, v, long=True)
        for s in grid.long_seeds
        for p in grid.long_presets
        for v in featured(choice)
    ]


def job_config(job: Cell, grid: Grid) -> dict[str, Any]:
    """The run config of one job: the preset with the variant, setting, seed and study settings."""
    data = preset(job.preset)
    rounds = grid.long_rounds if job.long else (grid.rounds or int(data.get("rounds", 15)))
    st = job.setting
    part = {**data.get("partition", {}), "alpha": st.alpha, "num_clients": st.num_clients}
    if st.min_size is not None:
        part["min_size"] = st.min_size
    clients = dict(data.get("clients", {}))
    clients["min_clients"] = min(int(clients.get("min_clients", st.num_clients)), st.num_clients)
    data.update(
        seed=job.seed,
        algorithm=job.variant.method,
        algo=job.variant.algo(data.get("algo", {})),
        rounds=rounds,
        eval_every=grid.long_eval_every if job.long else grid.eval_every,
        eval_before=False,
        plots=False,
        partition=part,
        clients=clients,
    )
    data["task"] = {**data["task"], "local_val_fraction": grid.val_fraction}
    data["train"] = {**data.get("train", {}), **grid.train}
    return data


def client_curves(run: RunView, split: str, metric: str) -> dict[int, dict[str, float]]:
    """Per round and client, one metric of a run's ``client_metrics.jsonl``.

    Round -> client id -> ``<split>/<metric>`` (``local``, ``test`` or ``val``) of a run's
    ``client_metrics.jsonl``. FedAvg-family runs log only ``local/``; on ``test`` their clients
    hold the global model, whose value is read from ``metrics.jsonl``.
    """
    glob = run.rounds
    out: dict[int, dict[str, float]] = {}
    for rec in run.client_metrics:
        rnd, vals = rec["round"], {}
        for cid, m in rec["clients"].items():
            key = f"{split}/{metric}"
            if key in m:
                vals[cid] = float(m[key])
            elif split == "test" and f"local/{metric}" in m and metric in glob.get(rnd, {}):
                vals[cid] = float(glob[rnd][metric])
        if vals:
            out[rnd] = vals
    return out


def negative_transfer(
    federated: Mapping[str, float], local: Mapping[str, float], higher_is_better: bool = True
) -> dict[str, Any]:
    """Per-client negative transfer, signed so that a negative value means federation hurt.

    NT_k = m_k(federated) − m_k(local-only) for metrics where higher is better (accuracy,
    macro-F1), and m_k(local-only) − m_k(federated) for errors (RMSE).

    Args:
        federated: Client id -> metric of the federated method.
        local: Client id -> metric of the local-only run (same seed and partition).
        higher_is_better: Direction of the metric.

    Returns:
        ``{"per_client": {cid: nt}, "mean": float, "worst": float}`` over the clients present
        in both.

    Raises:
        ValueError: The two runs share no client.
    """
    common = sorted(set(federated) & set(local), key=lambda c: (len(c), c))
    if not common:
        raise ValueError("negative transfer: the federated and local-only runs share no client")
    sign = 1.0 if higher_is_better else -1.0
    per = {c: sign * (float(federated[c]) - float(local[c])) for c in common}
    vals = list(per.values())
    return {"per_client": per, "mean": sum(vals) / len(vals), "worst": min(vals)}


def nt_stats(
    mine: Mapping[str, float], ref: Mapping[str, float], higher_is_better: bool
) -> dict[str, float]:
    """Mean and worst negative transfer over clients, and the clients harmed (NT < 0)."""
    nt = negative_transfer(mine, ref, higher_is_better)
    per = list(nt["per_client"].values())
    return {
        "nt_mean": nt["mean"],
        "nt_worst": nt["worst"],
        "harmed": float(sum(v < 0 for v in per)),
        "clients": float(len(per)),
    }


def metrics_of(kind: str) -> list[tuple[str, bool]]:
    """(metric, higher_is_better) of a task kind, the primary first."""
    return [("rmse", False)] if kind == "regression" else [("acc", True), ("macro_f1", True)]


SPLITS = ("test", "local", "val")


class CellKey(NamedTuple):
    """A cell of the study: every seed of one (dataset, setting, variant, main or long)."""

    preset: str
    setting: str  # Setting.tag
    variant: str  # Variant.key
    long: bool = False


@dataclass
class Results:
    """Everything the report reads.

    ``kinds`` (preset -> ``classification`` or ``regression``), ``final`` ((cell, split, metric,
    stat) -> seed -> value at the last round; stat ``value``, ``nt_mean``, ``nt_worst``, ``harmed``
    or ``clients``), ``curves`` ((cell, split, metric) -> seed -> round -> mean-client NT),
    ``sizes`` (partitions).
    """

    kinds: dict[str, str] = field(default_factory=dict)
    final: dict[tuple[CellKey, str, str, str], dict[int, float]] = field(default_factory=dict)
    curves: dict[tuple[CellKey, str, str], dict[int, dict[int, float]]] = field(
        default_factory=dict
    )
    sizes: dict[tuple[str, str], dict[int, dict[str, Any]]] = field(default_factory=dict)

    def get(self, cell: CellKey, split: str, metric: str, stat: str) -> dict[int, float]:
        """Seed -> value of one statistic (empty when the cell has none)."""
        return self.final.get((cell, split, metric, stat), {})

    def nt(
        self, preset: str, tag: str, v: Variant, split: str, stat: str = "nt_mean", metric: str = ""
    ) -> dict[int, float]:
        """Seed -> one statistic of a main-grid cell, of the primary metric unless ``metric``."""
        return self.get(CellKey(preset, tag, v.key), split, metric or self.primary(preset), stat)

    def kind(self, preset: str) -> str:
        """``classification`` or ``regression``: the kind of the preset's task."""
        return self.kinds.get(preset, "classification")

    def primary(self, preset: str) -> str:
        """The preset's headline metric (the first of its kind's metrics)."""
        return metrics_of(self.kind(preset))[0][0]

    def classification(self, presets: Iterable[str]) -> list[str]:
        """The classification presets among ``presets``, in order."""
        return [p for p in presets if self.kind(p) == "classification"]

    def regression(self, presets: Iterable[str]) -> list[str]:
        """The regression presets among ``presets``, in order."""
        return [p for p in presets if self.kind(p) == "regression"]


def _finished(run: RunView) -> bool:
    return run.finished and bool(run.client_metrics)


def analyse(ctx: Context[Grid], jobs: Iterable[Cell]) -> Results:
    """Reads every finished run of ``jobs`` and its local-only reference."""
    res = Results()
    curve = functools.cache(client_curves)  # a reference run is read for many variants
    for job in jobs:
        run = ctx.run(job.name)
        if not _finished(run):
            continue
        regression = (run.summary or {})["primary"] == "rmse"
        kind = res.kinds.setdefault(job.preset, "regression" if regression else "classification")
        cell = CellKey(job.preset, job.setting.tag, job.variant.key, job.long)
        if job.variant.reference is None and not job.long:
            res.sizes.setdefault((job.preset, job.setting.tag), {})[job.seed] = run.partition
        ref_variant = job.variant.reference
        ref = ctx.run(job._replace(variant=ref_variant).name) if ref_variant else None
        for metric, hib in metrics_of(kind):
            for split in SPLITS:
                mine = curve(run, split, metric)
                if not mine:
                    continue
                value = float(np.mean(list(mine[max(mine)].values())))
                res.final.setdefault((cell, split, metric, "value"), {})[job.seed] = value
                if ref is None or not _finished(ref):
                    continue
                theirs = curve(ref, split, metric)
                rounds = sorted(set(mine) & set(theirs))
                if not rounds:
                    continue
                for stat, v in nt_stats(mine[rounds[-1]], theirs[rounds[-1]], hib).items():
                    res.final.setdefault((cell, split, metric, stat), {})[job.seed] = v
                if metric == metrics_of(kind)[0][0] and split != "val":
                    res.curves.setdefault((cell, split, metric), {})[job.seed] = {
                        r: nt_stats(mine[r], theirs[r], hib)["nt_mean"] for r in rounds
                    }
    return res


@dataclass
class Choice:
    """The rule's (β, λ), every (β, λ)'s mean rank, the cells ranked and those left out."""

    gate: tuple[float, float]
    mean_rank: dict[tuple[float, float], float]
    cells: list[tuple[str, str]]
    missing: list[tuple[str, str]]


def choose_gate(
    configs: Sequence[tuple[float, float]],
    cells: Mapping[tuple[str, str], Mapping[tuple[float, float], float]],
) -> Choice | None:
    """The selection rule: the (β, λ) with the lowest mean rank over the cells.

    The selection rule: the (β, λ) of ``configs`` with the lowest mean rank over the
    ``cells`` ((preset, setting) -> (β, λ) -> mean-client validation NT over seeds, higher is
    better; a cell lacking a configuration is left out); None when no cell is complete.
    """
    from scipy.stats import rankdata

    complete = {c: s for c, s in cells.items() if all(k in s for k in configs)}
    missing = [c for c in cells if c not in complete]
    if not complete:
        return None
    # Per cell, rank 1 for the highest score; ties share the mean rank.
    ranks = [
        dict(zip(configs, rankdata([-s[k] for k in configs]), strict=True))
        for s in complete.values()
    ]
    mean_rank = {k: float(np.mean([r[k] for r in ranks])) for k in configs}
    best = min(configs, key=lambda k: (mean_rank[k], k[0], k[1]))
    return Choice(best, mean_rank, list(complete), missing)


def config_scores(
    grid: Grid, res: Results, split: str = "val"
) -> dict[tuple[str, str], dict[tuple[float, float], float]]:
    """(preset, setting) -> (β, λ) -> mean-client NT on ``split``, mean over seeds."""
    out: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
    for p in grid.presets:
        for st in grid.settings:
            scores = {}
            for b, lam in grid.configs():
                vals = res.nt(p, st.tag, gated(b, lam), split)
                if vals:
                    scores[(b, lam)] = float(np.mean(list(vals.values())))
            out[(p, st.tag)] = scores
    return out


def _choose(grid: Grid, res: Results, split: str) -> Choice | None:
    return choose_gate(grid.configs(), config_scores(grid, res, split))


def gate_of(ctx: Context[Grid]) -> tuple[Choice | None, tuple[float, float]]:
    """The rule's choice, and the gate the later runs use (the reference without one)."""
    choice = _choose(ctx.grid, analyse(ctx, main_cells(ctx.grid)), "val")
    return choice, choice.gate if choice else REFERENCE_GATE


def jobs(ctx: Context[Grid]) -> list[Run]:
    """The main grid; once none of it is left to run, the runs of the rule's (β, λ)."""
    todo = main_cells(ctx.grid)
    if ctx.settled(c.name for c in todo):
        todo += chosen_cells(ctx.grid, gate_of(ctx)[1])
    return [Run(c.name, job_config(c, ctx.grid), group=c.variant.method) for c in todo]


def data_notes(grid: Grid) -> list[str]:
    """Rows the sources dropped, captured from their log (the loaders are called afresh)."""
    from fedfm.data.sources import SOURCES

    handler = logging.handlers.BufferingHandler(capacity=10**6)  # keeps every record
    handler.setLevel(logging.WARNING)
    data_log = logging.getLogger("fedfm.data")
    data_log.addHandler(handler)
    try:
        for p in grid.presets:
            task = preset(p)["task"]
            SOURCES.get(task["dataset"])(**task.get("source_options", {}))
    finally:
        data_log.removeHandler(handler)
    return [record.getMessage() for record in handler.buffer]


WHERE = {"test": "global test", "local": "local split"}  # the two test sets in the tables


def _name(preset: str) -> str:
    return preset.removeprefix("fedekd-")


def _digits(metric: str, stat: str = "") -> int:
    """Decimals of a metric's values and differences; one for the count of harmed clients."""
    return 1 if stat == "harmed" else 2 if metric == "rmse" else 3


UNITS = {"acc": "accuracy", "macro_f1": "macro-F1", "rmse": "RMSE"}


def _dataset_table(grid: Grid, res: Results, preset: str, choice: tuple[float, float]) -> list:
    metrics = metrics_of(res.kind(preset))
    m = metrics[0][0]
    header = ["setting", "method"]
    for where in WHERE.values():
        header += [f"{UNITS[m]} {where}", f"NT mean {where}", f"NT worst {where}"]
        header.append(f"harmed {where}")
    if len(metrics) > 1:
        header += ["NT macro-F1 mean global test", "NT macro-F1 mean local split"]
    lines = head(header)
    for st in grid.all_settings():
        for v in featured(choice):
            cells = [st.label, v.label]
            for split in ("test", "local"):
                cells.append(mean_se(res.nt(preset, st.tag, v, split, "value")).fmt(_digits(m)))
                for stat in ("nt_mean", "nt_worst", "harmed"):
                    nt = mean_se(res.nt(preset, st.tag, v, split, stat)).fmt(_digits(m, stat))
                    cells.append(nt if v.reference else "—")
            if len(metrics) > 1:
                for split in ("test", "local"):
                    vals = res.nt(preset, st.tag, v, split, metric="macro_f1")
                    cells.append(mean_se(vals).fmt(3) if v.reference else "—")
            lines.append(row(cells))
    return lines


# Statistics of a comparison: (split, stat, column title), e.g. "Δ NT mean, global test".
DIFF_STATS = tuple(
    (split, stat, f"Δ {title}, {WHERE[split]}")
    for split in WHERE
    for stat, title in (("nt_mean", "NT mean"), ("nt_worst", "NT worst"), ("harmed", "harmed"))
)


@dataclass(frozen=True)
class Comparison:
    """A paired comparison of two variants (a − b)."""

    a: Variant
    b: Variant

    @property
    def label(self) -> str:
        """The pair as the report names it: ``a − b``."""
        return f"{self.a.label} − {self.b.label}"


def comparisons(choice: tuple[float, float]) -> list[Comparison]:
    """The study's headline comparisons, the chosen gate first."""
    sel = gated(*choice)
    out = [Comparison(sel, ungated(choice[1]))]
    if choice != REFERENCE_GATE:
        out.append(Comparison(gated(*REFERENCE_GATE), ungated(REFERENCE_GATE[1])))
    return [*out, Comparison(sel, Variant("fedavg")), Comparison(sel, Variant("fedprox"))]


def _pair(res: Results, comp: Comparison, preset: str, tag: str, split: str, stat: str) -> tuple:
    return tuple(res.nt(preset, tag, v, split, stat) for v in (comp.a, comp.b))


def _pooled(
    res: Results, comp: Comparison, presets: Sequence[str], split: str, stat: str, tags: Sequence
) -> Estimate:
    """``a − b`` pooled per seed over the cells of ``presets`` × setting ``tags``."""
    pairs = [_pair(res, comp, p, t, split, stat) for p in presets for t in tags]
    return pooled_paired([(a, b) for a, b in pairs if a and b])


def _tags(settings: Sequence[Setting]) -> list[str]:
    return [st.tag for st in settings]


def _comparison_table(grid: Grid, res: Results, comp: Comparison) -> list[str]:
    """Per (dataset, setting) paired differences, then classification pooled per setting."""
    lines = head(["dataset", "setting", *[t for _, _, t in DIFF_STATS]])
    for p in grid.presets:
        m = res.primary(p)
        for st in grid.all_settings():
            cells = [_name(p), st.label]
            for split, stat, _ in DIFF_STATS:
                est = paired(*_pair(res, comp, p, st.tag, split, stat))
                cells.append(est.fmt(_digits(m, stat), signed=True))
            lines.append(row(cells))
    cls = res.classification(grid.presets)
    if cls:
        groups = [(st.label, [st.tag]) for st in grid.all_settings()]
        if len(grid.settings) > 1:
            groups.append(("skewed settings", _tags(grid.settings)))
        for label, tags in groups:
            cells = ["**classification pooled**", label]
            for split, stat, _ in DIFF_STATS:
                est = _pooled(res, comp, cls, split, stat, tags)
                cells.append(est.fmt(_digits("acc", stat), signed=True))
            lines.append(row(cells))
    return lines


def _tally(ests: Iterable[Estimate], sign: int = 1) -> tuple[int, int, int]:
    """Cells above and below zero by more than 2 SE (times ``sign``), and cells with an SE."""
    rs = [e.resolved() * sign for e in ests if e.n >= 2]
    return sum(r > 0 for r in rs), sum(r < 0 for r in rs), len(rs)


def _cell_counts(
    grid: Grid, res: Results, comp: Comparison, split: str, stat: str, tags: Sequence[str]
) -> tuple[int, int, int]:
    """Cells where a, where b is better by more than 2 SE, and cells (fewer harmed: better)."""
    ests = (paired(*_pair(res, comp, p, t, split, stat)) for p in grid.presets for t in tags)
    return _tally(ests, -1 if stat == "harmed" else 1)


def _findings_table(grid: Grid, res: Results, comp: Comparison) -> list[str]:
    """Per statistic: pooled estimates with SE, cell counts and the verdict."""
    skew, ctrl = _tags(grid.settings), _tags(grid.control_settings)
    cls, regs = res.classification(grid.presets), res.regression(grid.presets)
    header = ["statistic", "classification pooled, skewed settings", "verdict"]
    header += ["classification pooled, control"] if ctrl else []
    header += [f"{_name(p)}, skewed settings pooled" for p in regs]
    header += ["cells a better / b better / cells (skewed settings, > 2 SE)"]
    lines = head(header)
    for split, stat, title in DIFF_STATS:
        dig, sign = _digits("acc", stat), -1 if stat == "harmed" else 1
        est = _pooled(res, comp, cls, split, stat, skew)
        cells = [title, est.fmt(dig, signed=True), side(est, "a better", "b better", sign)]
        if ctrl:
            cells.append(_pooled(res, comp, cls, split, stat, ctrl).fmt(dig, True))
        for p in regs:
            cells.append(
                _pooled(res, comp, [p], split, stat, skew).fmt(_digits("rmse", stat), True)
            )
        up, down, n = _cell_counts(grid, res, comp, split, stat, skew)
        lines.append(row([*cells, f"{up} / {down} / {n}"]))
    return lines


def _own_nt_table(grid: Grid, res: Results, choice: tuple[float, float]) -> list[str]:
    """Whether each featured method harms the mean client relative to local-only training."""
    groups = [("skewed settings", _tags(grid.settings))]
    if grid.control_settings:
        groups.append(("control", _tags(grid.control_settings)))
    header = ["method"]
    for label, _ in groups:
        for where in WHERE.values():
            header.append(f"classification pooled NT mean, {where}, {label}")
            header.append(f"cells NT > 0 / < 0 / cells, {where}, {label}")
    lines = head(header)
    for v in federated(choice):
        cells = [v.label]
        for _, tags in groups:
            for split in ("test", "local"):
                nts = {(p, t): res.nt(p, t, v, split) for p in grid.presets for t in tags}
                cls = [x for (p, _), x in nts.items() if res.kind(p) == "classification" and x]
                pooled = pooled_paired([(x, dict.fromkeys(x, 0.0)) for x in cls])
                pos, neg, n = _tally(mean_se(x) for x in nts.values())
                cells += [pooled.fmt(3, True), f"{pos} / {neg} / {n}"]
        lines.append(row(cells))
    return lines


def _ranks_table(grid: Grid, choice: Choice) -> list[str]:
    """The mean rank of each (β, λ) over the cells."""
    lams = [float(x) for x in grid.lams]
    lines = head(["β \\ λ", *[f"λ={x:g}" for x in lams]])
    for b in grid.betas:
        ranks = [choice.mean_rank.get((float(b), lam)) for lam in lams]
        lines.append(row([f"β={b:g}", *["—" if r is None else f"{r:.2f}" for r in ranks]]))
    return lines


def _validation_table(grid: Grid, res: Results) -> list[str]:
    """The validation NT per cell and configuration: the numbers the rule ranks."""
    scores = config_scores(grid, res, "val")
    configs = grid.configs()
    lines = head(["dataset", "setting", *[f"β={b:g} λ={lam:g}" for b, lam in configs]])
    for p in grid.presets:
        d = _digits(res.primary(p))
        for st in grid.settings:
            s = scores.get((p, st.tag), {})
            cells = [f"{s[c]:+.{d}f}" if c in s else "—" for c in configs]
            lines.append(row([_name(p), st.label, *cells]))
    return lines


def _gate_grid_table(grid: Grid, res: Results) -> list[str]:
    """Every gated configuration against ungated KD at its λ, over the skewed settings."""
    tags = _tags(grid.settings)
    cls, regs = res.classification(grid.presets), res.regression(grid.presets)
    stats = [x for x in DIFF_STATS if x[1] != "harmed"]
    header = ["configuration", *[f"{t}, classification pooled" for _, _, t in stats]]
    header += [f"Δ NT mean, global test, {_name(p)}" for p in regs]
    header += ["cells a better / b better (NT mean, global test, > 2 SE)"]
    lines = head(header)
    for comp in (Comparison(gated(b, lam), ungated(lam)) for b, lam in grid.configs()):
        cells = [comp.label]
        cells += [
            _pooled(res, comp, cls, split, stat, tags).fmt(3, True) for split, stat, _ in stats
        ]
        cells += [_pooled(res, comp, [p], "test", "nt_mean", tags).fmt(2, True) for p in regs]
        up, down, n = _cell_counts(grid, res, comp, "test", "nt_mean", tags)
        lines.append(row([*cells, f"{up} / {down} of {n}"]))
    return lines


def _long_curve(res: Results, grid: Grid, preset: str, v: Variant, split: str) -> dict:
    """Seed -> round -> mean-client NT of a long run (primary metric)."""
    cell = CellKey(preset, grid.long_setting.tag, v.key, True)
    return res.curves.get((cell, split, res.primary(preset)), {})


def _at(curve: Mapping[int, Mapping[int, float]], r: int) -> dict[int, float]:
    """Seed -> value at round ``r`` (seeds without that round left out)."""
    return {s: c[r] for s, c in curve.items() if r in c}


def _curve_table(grid: Grid, res: Results, preset: str, choice: tuple, split: str) -> list[str]:
    """Mean-client NT per method at key rounds of the long runs, and paired differences."""
    d = _digits(res.primary(preset))
    fed = federated(choice)
    cuts = [Comparison(gated(*choice), ungated(choice[1])), Comparison(gated(*choice), fed[0])]
    curves = {v: _long_curve(res, grid, preset, v, split) for v in fed}
    rounds = sorted({r for c in curves.values() for per in c.values() for r in per})
    lines = head(["round", *[f"NT {v.label}" for v in fed], *[f"Δ {c.label}" for c in cuts]])
    if not rounds:
        return lines
    # About six rounds spread over the run (first and last included), and the main grid's last.
    idx = np.unique(np.linspace(0, len(rounds) - 1, min(6, len(rounds))).round().astype(int))
    keep = grid.rounds or 15
    for r in sorted({*(rounds[i] for i in idx), *([keep] if keep in rounds else [])}):
        cells = [str(r), *[mean_se(_at(curves[v], r)).fmt(d) for v in fed]]
        cells += [paired(_at(curves[c.a], r), _at(curves[c.b], r)).fmt(d, True) for c in cuts]
        lines.append(row(cells))
    return lines


def _sizes_table(grid: Grid, res: Results) -> list[str]:
    lines = []
    for p in grid.presets:
        for st in grid.all_settings():
            per = res.sizes.get((p, st.tag), {})
            if not per:
                continue
            cells = [_name(p), st.label]
            for key in ("sizes", "local_test_sizes", "local_val_sizes"):
                vals = [x for s in per.values() for x in s.get(key, [])]
                cells.append(f"{min(vals)} / {np.median(vals):g}" if vals else "—")
            tests = sorted({s["test_size"] for s in per.values() if "test_size" in s})
            cells.append(", ".join(map(str, tests)) or "—")
            lines.append(row(cells))
    return lines


def _preset_summary(preset_name: str) -> str:
    d = preset(preset_name)
    t, a, p, tr = d["task"], d.get("algo", {}), d["partition"], d.get("train", {})
    skew = f"{p['scheme']} by {p.get('by', 'label')}" + (
        f" ({p['bins']} bins)" if p.get("bins") else ""
    )
    cells = [f"{t['dataset']} ({t['kind']})", f"{t.get('model', 'mlp')} {t.get('model_args', {})}"]
    cells += [a.get("private_archs"), a.get("proxy_arch"), f"{skew}, min {p.get('min_size')}"]
    local = f"{tr.get('steps')} steps per stage, bs {tr.get('batch_size')},"
    local += f" {tr.get('optimizer')} lr {tr.get('lr')}"
    return row([_name(preset_name), *cells, d.get("rounds"), local])


def _nt_figure(grid: Grid, res: Results, choice: tuple, path: Path, palette: dict) -> Path:
    """Bars of mean-client NT ± SE per method, worst client marked, per setting and set."""
    fed = federated(choice)
    width = 0.8 / max(len(fed), 1)
    # Accuracy and RMSE get their own panels (their scales differ).
    kinds = (("accuracy", res.classification(grid.presets)), ("RMSE", res.regression(grid.presets)))
    panels = [(label, ps, split) for label, ps in kinds if ps for split in ("test", "local")]
    settings = grid.all_settings()
    size = (3.6 * len(panels) + 1, 3.0 * len(settings))
    fig, axes = plt.subplots(len(settings), len(panels), figsize=size, squeeze=False)
    for r, st in enumerate(settings):
        for c, (label, presets, split) in enumerate(panels):
            ax = axes[r, c]
            for j, v in enumerate(fed):
                ests = [mean_se(res.nt(p, st.tag, v, split)) for p in presets]
                worst = [mean_se(res.nt(p, st.tag, v, split, "nt_worst")).mean for p in presets]
                x = np.arange(len(presets)) + (j - (len(fed) - 1) / 2) * width
                ses = [e.se if e.n > 1 else 0.0 for e in ests]
                colour = palette[v.label]
                means = [e.mean for e in ests]
                ax.bar(x, means, width, yerr=ses, capsize=2, label=v.label, color=colour)
                ax.scatter(x, worst, marker="v", s=12, color=colour)
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xticks(np.arange(len(presets)), [_name(p) for p in presets], fontsize=8)
            ax.set_ylabel(f"NT, {label}")
            ax.set_title(f"{st.label}, {WHERE[split]}", fontsize=9)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(
        "Negative transfer: bar = mean client ± SE over seeds, ▼ = worst client", fontsize=10
    )
    return save(fig, path, 100)


def _gate_figure(grid: Grid, res: Results, path: Path) -> Path:
    """Mean ranks of the (β, λ) grid: on validation (the rule) and on the global test set."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), squeeze=False)
    sources = (("validation split (the rule)", "val"), ("global test set", "test"))
    for ax, (title, split) in zip(axes[0], sources, strict=True):
        ch = _choose(grid, res, split)
        mat = np.full((len(grid.betas), len(grid.lams)), np.nan)
        for i, b in enumerate(grid.betas):
            for j, lam in enumerate(grid.lams):
                if ch:
                    mat[i, j] = ch.mean_rank[(float(b), float(lam))]
                    ax.text(j, i, f"{mat[i, j]:.1f}", ha="center", va="center", fontsize=8)
        im = ax.imshow(mat, cmap="viridis_r", aspect="auto", alpha=0.8)
        ax.set_xticks(range(len(grid.lams)), [f"λ={x:g}" for x in grid.lams])
        ax.set_yticks(range(len(grid.betas)), [f"β={x:g}" for x in grid.betas])
        ax.set_title(f"mean rank of mean-client NT, {title}", fontsize=9)
        fig.colorbar(im, ax=ax)
    return save(fig, path, 100)


def _curves_figure(grid: Grid, res: Results, choice: tuple, path: Path, palette: dict) -> Path:
    """Mean-client NT over the rounds of the long runs, ± SE bands, per set and split."""
    n = len(grid.long_presets)
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 6.0), squeeze=False)
    for c, p in enumerate(grid.long_presets):
        for r, split in enumerate(("test", "local")):
            ax = axes[r, c]
            for v in federated(choice):
                curve = _long_curve(res, grid, p, v, split)
                rounds = sorted(set.intersection(*map(set, curve.values()))) if curve else []
                if not rounds:
                    continue
                ests = [mean_se(_at(curve, rr)) for rr in rounds]
                band(ax, rounds, ests, 0.2, label=v.label, lw=1.2, color=palette[v.label])
            ax.axhline(0, color="k", lw=0.8)
            ax.set_title(f"{_name(p)}, {WHERE[split]}", fontsize=9)
            plots.integer_rounds(ax)
            ax.set_ylabel(f"mean-client NT, {UNITS[res.primary(p)]}")
    axes[0, 0].legend(fontsize=6)
    title = f"Negative transfer over rounds, {grid.long_setting.label} (mean ± SE over seeds)"
    fig.suptitle(title, fontsize=10)
    return save(fig, path, 100)


def _figures(grid: Grid, res: Results, choice: tuple[float, float], folder: Path) -> list[Path]:
    # One colour per method in every figure of the study.
    palette = plots.colours(v.label for v in featured(choice))
    paths = [
        _nt_figure(grid, res, choice, folder / "negative_transfer.png", palette),
        _gate_figure(grid, res, folder / "gate_grid.png"),
    ]
    if grid.long_presets:
        paths.append(_curves_figure(grid, res, choice, folder / "nt_curves.png", palette))
    return paths


def _settings_text(sts: Sequence[Setting]) -> str:
    return "; ".join(
        st.label + (f" (min partition {st.min_size})" if st.min_size else "") for st in sts
    )


def _setup(ctx: Context[Grid], gate: tuple[float, float]) -> dict[str, Any]:
    """How to reproduce: the command, the grid, presets and split sizes."""
    grid = ctx.grid
    after = chosen_cells(grid, gate)
    n_long = sum(j.long for j in after)
    control = {"runs": len(after) - n_long, "settings": _settings_text(grid.control_settings)}
    out = {"command": ctx.command, "main_runs": len(main_cells(grid))}
    out.update(n_presets=len(grid.presets), n_settings=len(grid.settings))
    out.update(n_seeds=len(grid.seeds), n_variants=len(grid.main_variants()))
    out.update(lams=values(grid.lams), betas=values(grid.betas))
    out.update(rounds=grid.rounds or preset(grid.presets[0])["rounds"])
    out.update(settings=_settings_text(grid.settings), seeds=", ".join(map(str, grid.seeds)))
    out.update(control=TEXT("control", control) if grid.control_settings else "")
    out.update(long_runs=n_long, n_long=len(grid.long_presets), n_long_seeds=len(grid.long_seeds))
    out.update(long_presets=", ".join(_name(p) for p in grid.long_presets))
    out.update(n_long_variants=len(featured(gate)), long_setting=grid.long_setting.label)
    out.update(workers=ctx.workers, val_fraction=f"{grid.val_fraction:.0%}")
    out.update(train=TEXT("train", train=grid.train) if grid.train else None)
    return out | {"presets": [_preset_summary(p) for p in grid.presets]}


def _choice(grid: Grid, res: Results, choice: Choice | None) -> str:
    """The rule's choice, whether the code's default follows it, and its evidence."""
    from fedfm.algorithms.fedekd import FedeKDConfig

    if choice is None:
        return TEXT("no-choice")
    default = FedeKDConfig()
    d_gate, (beta, lam) = (default.beta, default.lam), choice.gate
    values = {"beta": f"{beta:g}", "lam": f"{lam:g}", "cells": len(choice.cells)}
    values.update(rank=f"{choice.mean_rank[choice.gate]:.2f}", configs=len(grid.configs()))
    values.update(left_out=TEXT("left-out", n=len(choice.missing)) if choice.missing else "")
    values.update(default_beta=f"{d_gate[0]:g}", default_lam=f"{d_gate[1]:g}")
    values.update(reference_beta=f"{REFERENCE_GATE[0]:g}", reference_lam=f"{REFERENCE_GATE[1]:g}")
    values.update(agree=TEXT("agrees" if d_gate == choice.gate else "differs"))
    values.update(history=TEXT("unchanged" if choice.gate == REFERENCE_GATE else "changed"))
    picks = []  # what the same ranking would pick on the test sets (reported, never used)
    for split, where in (("local", "local test splits"), ("test", "global test set")):
        if ch := _choose(grid, res, split):
            picks.append(TEXT("pick", where=where, beta=f"{ch.gate[0]:g}", lam=f"{ch.gate[1]:g}"))
    values.update(contrast=TEXT("contrast", picks=" and ".join(picks)) if picks else "")
    ranks, validation = _ranks_table(grid, choice), _validation_table(grid, res)
    return TEXT("chosen", values, ranks=ranks, validation=validation)


def _headed(tables: Iterable[tuple[str, list[str]]]) -> str:
    """Tables, each under its ``###`` heading."""
    return joined(*(x for title, lines in tables for x in (f"### {title}", lines)))


@dataclass
class Read:
    """What the report reads: the runs' statistics and the rule's choice."""

    res: Results
    choice: Choice | None
    gate: tuple[float, float]


def read(ctx: Context[Grid]) -> Read:
    """The rule's choice from the main grid, then every run it implies."""
    choice, gate = gate_of(ctx)
    return Read(analyse(ctx, main_cells(ctx.grid) + chosen_cells(ctx.grid, gate)), choice, gate)


def readouts(grid: Grid) -> list[Readout[Read]]:
    """The gate against ungated KD and FedAvg; what cannot be compared with the paper."""

    def nt(what: str, split: str, other: str | None = None, stat: str = "nt_mean") -> Readout[Read]:
        def value(r: Read) -> Estimate:
            b = ungated(r.gate[1]) if other is None else Variant(other)
            comp, cls = Comparison(gated(*r.gate), b), r.res.classification(grid.presets)
            return _pooled(r.res, comp, cls, split, stat, _tags(grid.settings))

        b = "ungated KD at its λ" if other is None else "FedAvg"
        where = "global test set" if split == "test" else "local test splits"
        return Readout(
            f"FedeKD at the rule's (β, λ) − {b}, {what}-client NT, {where}",
            "paired over seeds",
            "the energy gate lowers negative transfer under heterogeneity",
            +1,
            value,
            scope=TEXT("scope-paper"),
        )

    return [
        nt("mean", "test"),
        nt("worst", "test", stat="nt_worst"),
        nt("mean", "local"),
        nt("mean", "local", "fedavg"),
        untestable(
            "FedeKD here − FedeKD in the paper's tables",
            "the paper's result tables",
            TEXT("scope-tables"),
        ),
    ]


def body(ctx: Context[Grid], r: Read) -> str:
    """The method, setup, statistics, choice of (β, λ), findings, tables and figures."""
    grid, res, gate = ctx.grid, r.res, r.gate
    figs = _figures(grid, res, gate, ctx.figures)
    notes = data_notes(grid)
    comps = comparisons(gate)
    curves = [
        (f"{_name(p)}, {where}", _curve_table(grid, res, p, gate, split))
        for p in grid.long_presets
        for split, where in (("test", "global test set"), ("local", "local test splits"))
    ]
    long = {"setting": grid.long_setting.label, "rounds": grid.long_rounds}
    return TEXT(
        "body",
        vars(grid),
        _setup(ctx, gate),
        sizes=_sizes_table(grid, res),
        data_notes=TEXT("data-notes", notes="; ".join(notes)) if notes else None,
        choice=_choice(grid, res, r.choice),
        findings=_headed((c.label, _findings_table(grid, res, c)) for c in comps),
        own_nt=_own_nt_table(grid, res, gate),
        per_cell=_headed((c.label, _comparison_table(grid, res, c)) for c in comps),
        per_dataset=_headed((_name(p), _dataset_table(grid, res, p, gate)) for p in grid.presets),
        gate_grid=_gate_grid_table(grid, res),
        long=TEXT("long", long, curves=_headed(curves)) if grid.long_presets else None,
        figures=[f"![{f.stem}]({ctx.figures.name}/{f.name})" for f in figs],
    )


STUDY = register(
    __name__,
    "FedeKD vs local, FedAvg, FedProx, ungated KD on six datasets",
    workers=(2, 1),
    later="after the main grid, the rule's (β, λ) adds the control-setting and long runs.",
)
