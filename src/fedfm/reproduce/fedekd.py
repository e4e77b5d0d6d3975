"""FedeKD reproduction study: negative transfer with standard errors, the gate's β × λ grid,
stronger skew, and negative transfer over a longer run.

``fedfm reproduce fedekd`` runs, on the six ``fedekd-*`` presets (four classification sets,
two regression sets):

1. the **main grid**: two skewed settings (Dirichlet α = 0.1 with 4 clients, α = 0.5 with 10
   clients), five seeds, the baselines (local-only with the shared and with
   the private architectures, FedAvg, FedProx, ungated private/proxy KD at every λ) and FedeKD
   at every (β, λ) of β ∈ {1, 2, 4, 8} × λ ∈ {0.5, 1, 2}, 15 rounds, clients evaluated every
   3 rounds;
2. the **choice of β and λ** by the rule below, on each client's validation split;
3. with the chosen (β, λ): the **control** setting (α = 5, 10 clients, near-IID) with the
   baselines, FedeKD at the chosen (β, λ) and at β = λ = 1 and ungated KD at their λ; and the
   **long runs**: 60 rounds at α = 0.5 on three presets, five seeds, the same variants,
   clients evaluated every 3 rounds, for negative transfer over rounds;

and writes ``docs/fedekd.md`` with tables and figures (:mod:`fedfm.reproduce.fedekd_report`,
which also declares the study on :mod:`fedfm.reproduce.framework`: the main grid's runs, then,
once they have run, the runs that the rule's (β, λ) decides).
``--quick`` runs a small grid in one process and writes its report under the output folder
instead, so it never replaces the committed report.

Splits (ours). Each client's partition is split once per seed into a local test split
(``task.local_test_fraction`` = 25 %), a validation split (``local_val_fraction`` = 15 %, for
every method, so all train on the same rows) and training rows. Metrics are read on three
sets: the client's local test split (``local``: its own distribution, but a few rows on the
smallest clients), the global test set shared by all clients (``test``: hundreds of rows, the
powered measure; for FedAvg and FedProx every client's model is the global model), and the
validation split (``val``, only to choose β and λ).

Negative transfer references (ours): FedAvg and FedProx train the shared architecture
(``task.model_args``) and are compared with ``local`` (that architecture trained alone); the
private/proxy methods are compared with ``local-private`` (each client's own private
architecture trained alone for the same budget), so architecture and federation are not
confounded. Statistics: :mod:`fedfm.reproduce.stats`.

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
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from fedfm.reproduce.framework import Context, Run, RunView, preset

# The gate setting FedeKD had as its default before the selection rule was first applied; the
# study always runs it, so the report can compare it with the rule's choice.
REFERENCE_GATE = (1.0, 1.0)

# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Method:
    """A family of rows of the study.

    Attributes:
        label: Name in the report.
        algorithm: Registered algorithm.
        reference: Method whose run is the local-only reference (None for local-only itself).
    """

    label: str
    algorithm: str
    reference: str | None


METHODS: dict[str, Method] = {
    "local": Method("local-only (shared arch)", "local", None),
    "local-private": Method("local-only (private archs)", "local-private", None),
    "fedavg": Method("FedAvg", "fedavg", "local"),
    "fedprox": Method("FedProx (μ=0.01)", "fedprox", "local"),
    "fedkd-ungated": Method("ungated KD", "fedkd-ungated", "local-private"),
    "fedekd": Method("FedeKD", "fedekd", "local-private"),
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
        """The run's ``algo`` section, every gate field explicit (so that a later change of
        FedeKD's defaults or of a preset's β does not change a finished run's config)."""
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
    """A heterogeneity setting: Dirichlet α over this many clients.

    Attributes:
        alpha: Dirichlet concentration (label skew; quantile bins of the target for regression).
        num_clients: Clients.
        min_size: Smallest partition the partitioner accepts (None: the preset's).
    """

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
        control_settings: Settings run after the choice with the featured variants only (the
            near-IID control).
        seeds: Seeds of the main grid (each also draws the partition and the splits).
        betas: Gate scales of the main grid.
        lams: Backward-distillation weights of the main grid (ungated KD runs at each).
        rounds: Rounds of the main grid (None: the preset's).
        eval_every: Clients are evaluated every this many rounds (and after the last).
        val_fraction: Share of each client's partition held out for validation.
        long_presets: Presets of the long runs.
        long_setting: Setting of the long runs.
        long_seeds: Seeds of the long runs.
        long_rounds: Rounds of the long runs.
        long_eval_every: Evaluation interval of the long runs.
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


FULL = Grid(
    presets=(
        "fedekd-breast-cancer",
        "fedekd-credit",
        "fedekd-covid",
        "fedekd-digits",
        "fedekd-concrete",
        "fedekd-diabetes",
    ),
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
        data = self.preset.removeprefix("fedekd-")
        return f"{head}{data}-{self.setting.tag}-s{self.seed}-{self.variant.key}"

    def reference(self) -> Cell | None:
        """The local-only run of the same seed, setting and partition."""
        ref = self.variant.reference
        return self._replace(variant=ref) if ref else None


def main_cells(grid: Grid) -> list[Cell]:
    """The main grid, seed by seed: an interrupted grid has every cell at fewer seeds."""
    return [
        Cell(p, st, s, v)
        for s in grid.seeds
        for st in grid.settings
        for p in grid.presets
        for v in grid.main_variants()
    ]


def long_variants(choice: tuple[float, float]) -> list[Variant]:
    """Variants of the long runs: the baselines, the chosen gate and the reference gate, each
    with ungated KD at its λ."""
    out = [Variant(m) for m in BASELINES]
    for b, lam in (choice, REFERENCE_GATE):
        for v in (ungated(lam), gated(b, lam)):
            if v not in out:
                out.append(v)
    return out


def featured(choice: tuple[float, float]) -> list[Variant]:
    """The variants of the control settings and the rows of the per-dataset tables."""
    return long_variants(choice)


def chosen_cells(grid: Grid, choice: tuple[float, float]) -> list[Cell]:
    """What runs once (β, λ) is chosen: the control settings with the featured variants, then
    the long runs, each seed by seed."""
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
        for v in long_variants(choice)
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
        algorithm=METHODS[job.variant.method].algorithm,
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


# ----------------------------------------------------------------------------- reading runs


def client_curves(run: RunView, split: str, metric: str) -> dict[int, dict[str, float]]:
    """Round -> client id -> ``metric`` on ``split`` at every evaluated round of a run.

    ``split`` is ``local`` (the client's own test split), ``test`` (the global test set) or
    ``val`` (its validation split), read as ``<split>/<metric>`` from ``client_metrics.jsonl``.
    FedAvg-family runs log only ``local/`` per client; on ``test`` their clients all hold the
    global model, whose value is read from the same round of ``metrics.jsonl``.
    """
    glob = run.rounds
    out: dict[int, dict[str, float]] = {}
    for row in run.client_metrics:
        rnd, vals = row["round"], {}
        for cid, m in row["clients"].items():
            key = f"{split}/{metric}"
            if key in m:
                vals[cid] = float(m[key])
            elif split == "test" and f"local/{metric}" in m and metric in glob.get(rnd, {}):
                vals[cid] = float(glob[rnd][metric])
        if vals:
            out[rnd] = vals
    return out


def nt_stats(
    mine: Mapping[str, float], ref: Mapping[str, float], higher_is_better: bool
) -> dict[str, float]:
    """Mean and worst negative transfer over clients, and the number of clients harmed.

    A client is harmed when its NT is below zero (federated worse than local-only).
    """
    from fedfm.algorithms.fedekd import negative_transfer

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
    """Everything the report reads, per cell and seed.

    Attributes:
        kinds: Preset -> ``classification`` or ``regression``.
        final: (cell, split, metric, stat) -> seed -> value at the last round; stat is
            ``value`` (mean client metric), ``nt_mean``, ``nt_worst``, ``harmed``, ``clients``.
        curves: (cell, split, metric) -> seed -> round -> mean-client NT.
        sizes: (preset, setting tag) -> seed -> partition statistics of the task.
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

    def kind(self, preset: str) -> str:
        return self.kinds.get(preset, "classification")

    def primary(self, preset: str) -> str:
        return metrics_of(self.kind(preset))[0][0]


def _kind_of(run: RunView) -> str:
    return "regression" if (run.summary or {})["primary"] == "rmse" else "classification"


def _finished(run: RunView) -> bool:
    return run.finished and bool(run.client_metrics)


def analyse(ctx: Context[Grid], jobs: Iterable[Cell]) -> Results:
    """Reads every finished run of ``jobs`` and its local-only reference."""
    res = Results()
    cache: dict[tuple[str, str, str], dict[int, dict[str, float]]] = {}

    def curve(run: RunView, split: str, metric: str) -> dict[int, dict[str, float]]:
        key = (run.name, split, metric)
        if key not in cache:
            cache[key] = client_curves(run, split, metric)
        return cache[key]

    for job in jobs:
        run = ctx.run(job.name)
        if not _finished(run):
            continue
        kind = res.kinds.setdefault(job.preset, _kind_of(run))
        cell = CellKey(job.preset, job.setting.tag, job.variant.key, job.long)
        if job.variant.reference is None and not job.long:
            res.sizes.setdefault((job.preset, job.setting.tag), {})[job.seed] = run.partition
        ref_job = job.reference()
        ref = ctx.run(ref_job.name) if ref_job else None
        for metric, hib in metrics_of(kind):
            for split in SPLITS:
                mine = curve(run, split, metric)
                if not mine:
                    continue
                last = max(mine)
                res.final.setdefault((cell, split, metric, "value"), {})[job.seed] = float(
                    np.mean(list(mine[last].values()))
                )
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


# ----------------------------------------------------------------------------- the rule


@dataclass
class Choice:
    """The (β, λ) the selection rule picks.

    Attributes:
        beta: Chosen gate scale.
        lam: Chosen distillation weight.
        mean_rank: (β, λ) -> mean rank over the cells (1 = best).
        cells: (preset, setting tag) cells that entered the ranking.
        missing: Cells left out because a configuration had no validation value.
    """

    beta: float
    lam: float
    mean_rank: dict[tuple[float, float], float]
    cells: list[tuple[str, str]]
    missing: list[tuple[str, str]]

    @property
    def gate(self) -> tuple[float, float]:
        return (self.beta, self.lam)


def rank_configs(scores: Mapping[tuple[float, float], float]) -> dict[tuple[float, float], float]:
    """Ranks of configurations by score, higher score = rank 1; ties share the mean rank."""
    from scipy.stats import rankdata

    keys = list(scores)
    ranks = rankdata([-scores[k] for k in keys], method="average")
    return {k: float(r) for k, r in zip(keys, ranks, strict=True)}


def choose_gate(
    configs: Sequence[tuple[float, float]],
    cells: Mapping[tuple[str, str], Mapping[tuple[float, float], float]],
) -> Choice | None:
    """The selection rule: the configuration with the lowest mean rank over the cells.

    Args:
        configs: Candidate (β, λ) configurations.
        cells: (preset, setting) -> (β, λ) -> mean-client validation NT averaged over seeds
            (signed so that higher is better). A cell lacking a configuration is left out.

    Returns:
        The choice (ties to the smaller β, then the smaller λ), or None when no cell is complete.
    """
    complete = {c: s for c, s in cells.items() if all(k in s for k in configs)}
    missing = [c for c in cells if c not in complete]
    if not complete:
        return None
    ranks = [rank_configs({k: s[k] for k in configs}) for s in complete.values()]
    mean_rank = {k: float(np.mean([r[k] for r in ranks])) for k in configs}
    best = min(configs, key=lambda k: (mean_rank[k], k[0], k[1]))
    return Choice(best[0], best[1], mean_rank, list(complete), missing)


def config_scores(
    grid: Grid, res: Results, split: str = "val"
) -> dict[tuple[str, str], dict[tuple[float, float], float]]:
    """(preset, setting) -> (β, λ) -> mean over seeds of the mean-client NT on ``split``
    (primary metric); on the validation split these are the numbers the rule ranks."""
    out: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
    for p in grid.presets:
        for st in grid.settings:
            scores = {}
            for b, lam in grid.configs():
                cell = CellKey(p, st.tag, gated(b, lam).key)
                vals = res.get(cell, split, res.primary(p), "nt_mean")
                if vals:
                    scores[(b, lam)] = float(np.mean(list(vals.values())))
            out[(p, st.tag)] = scores
    return out


def default_gate() -> tuple[float, float]:
    """FedeKD's default (β, λ) in the code."""
    from fedfm.algorithms.fedekd import FedeKDConfig

    d = FedeKDConfig()
    return (d.beta, d.lam)


# ----------------------------------------------------------------------------- the jobs


def gate_of(ctx: Context[Grid]) -> tuple[Choice | None, tuple[float, float]]:
    """The rule's choice on the main grid's validation numbers, and the gate the runs after
    it use (the reference gate when nothing could be chosen)."""
    grid = ctx.grid
    choice = choose_gate(grid.configs(), config_scores(grid, analyse(ctx, main_cells(grid))))
    return choice, choice.gate if choice else REFERENCE_GATE


def jobs(ctx: Context[Grid]) -> list[Run]:
    """The main grid; once none of it is left to run, the runs of the rule's (β, λ)."""
    grid = ctx.grid
    main = [Run(c.name, job_config(c, grid), group=c.variant.method) for c in main_cells(grid)]
    if not ctx.settled(r.name for r in main):
        return main
    after = chosen_cells(grid, gate_of(ctx)[1])
    return main + [Run(c.name, job_config(c, grid), group=c.variant.method) for c in after]


def data_notes(grid: Grid) -> list[str]:
    """Rows the sources dropped (missing numeric feature or target), captured from their log
    (the loaders are called afresh: a cached source would not log again)."""
    from fedfm.data.sources import SOURCES

    notes: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    handler = Grab(logging.WARNING)
    data_log = logging.getLogger("fedfm.data")
    data_log.addHandler(handler)
    try:
        for p in grid.presets:
            task = preset(p)["task"]
            SOURCES.get(task["dataset"])(**task.get("source_options", {}))
    finally:
        data_log.removeHandler(handler)
    return notes
