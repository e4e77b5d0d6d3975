"""FedeKD reproduction study: negative transfer with standard errors, the gate's β × λ grid,
stronger skew, and negative transfer over a longer run.

``fedfm reproduce fedekd`` runs, on the six ``fedekd-*`` presets (four classification sets,
two regression sets):

1. the **main grid**: three heterogeneity settings (Dirichlet α = 0.1 with 4 clients, α = 0.5
   and α = 5 with 10 clients), five seeds, the baselines (local-only with the shared and with
   the private architectures, FedAvg, FedProx, ungated private/proxy KD at every λ) and FedeKD
   at every (β, λ) of β ∈ {1, 2, 4, 8} × λ ∈ {0.5, 1, 2}, 15 rounds, clients evaluated every
   3 rounds;
2. the **choice of β and λ** by the rule below, on each client's validation split;
3. the **long runs**: 60 rounds at α = 0.5 on three presets, five seeds, the baselines and
   FedeKD at the chosen (β, λ) and at β = λ = 1, clients evaluated every 3 rounds, for
   negative transfer over rounds;

and writes ``docs/fedekd.md`` with tables and figures. ``--quick`` runs a small grid and
writes its report under the output folder instead, so it never replaces the committed report.

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
for every (dataset, setting) cell, the 12 gated configurations are ranked by their
mean-client negative transfer on the validation split (primary metric: accuracy, or RMSE for
regression), averaged over seeds (rank 1 = least harmful, ties share the mean rank); the
configuration with the lowest mean rank over all cells is chosen; ties go to the smaller β,
then the smaller λ. FedeKD's default (``FedeKDConfig``) follows the chosen configuration; the
report says whether the two agree.

Resumable: a run whose folder holds a finished run of the same config is skipped, an
unfinished one is resumed from its last checkpoint, one of another config is run afresh; so
rerunning the command after an interruption only runs what is missing, and rerunning it on
a finished grid only rewrites the report.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from fedfm.reproduce import STUDIES
from fedfm.reproduce.stats import Estimate, mean_se, paired, pooled_paired

log = logging.getLogger("fedfm")

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
        workers: Parallel worker processes (one torch thread each).
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
    workers: int = 2

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


class Job(NamedTuple):
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

    def reference(self) -> Job | None:
        """The local-only run of the same seed, setting and partition."""
        ref = self.variant.reference
        return self._replace(variant=ref) if ref else None


def main_jobs(grid: Grid) -> list[Job]:
    """The main grid, seed by seed: an interrupted grid has every cell at fewer seeds."""
    return [
        Job(p, st, s, v)
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


def chosen_jobs(grid: Grid, choice: tuple[float, float]) -> list[Job]:
    """What runs once (β, λ) is chosen: the control settings with the featured variants, then
    the long runs, each seed by seed."""
    control = [
        Job(p, st, s, v)
        for s in grid.seeds
        for st in grid.control_settings
        for p in grid.presets
        for v in featured(choice)
    ]
    return control + [
        Job(p, grid.long_setting, s, v, long=True)
        for s in grid.long_seeds
        for p in grid.long_presets
        for v in long_variants(choice)
    ]


@cache
def _preset_yaml(preset: str) -> str:
    from fedfm.config import load_config

    return json.dumps(load_config(preset).model_dump(mode="json"))


def preset_data(preset: str) -> dict[str, Any]:
    """A preset as a validated, complete config mapping (a fresh copy)."""
    return json.loads(_preset_yaml(preset))


def job_config(job: Job, grid: Grid, out: Path) -> dict[str, Any]:
    """The run config of one job: the preset with the variant, setting, seed and study settings."""
    data = preset_data(job.preset)
    rounds = grid.long_rounds if job.long else (grid.rounds or int(data.get("rounds", 15)))
    st = job.setting
    part = {**data.get("partition", {}), "alpha": st.alpha, "num_clients": st.num_clients}
    if st.min_size is not None:
        part["min_size"] = st.min_size
    clients = dict(data.get("clients", {}))
    clients["min_clients"] = min(int(clients.get("min_clients", st.num_clients)), st.num_clients)
    data.update(
        name=job.name,
        seed=job.seed,
        algorithm=METHODS[job.variant.method].algorithm,
        algo=job.variant.algo(data.get("algo", {})),
        rounds=rounds,
        out_dir=str(out),
        eval_every=grid.long_eval_every if job.long else grid.eval_every,
        eval_before=False,
        plots=False,
        threads=1,
        partition=part,
        clients=clients,
    )
    data["task"] = {**data["task"], "local_val_fraction": grid.val_fraction}
    data["train"] = {**data.get("train", {}), **grid.train}
    return data


# ----------------------------------------------------------------------------- running


def _comparable(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config without the output folder (moving the study's folder keeps its runs)."""
    return {k: v for k, v in cfg.items() if k != "out_dir"}


def run_status(cfg: dict[str, Any]) -> str:
    """``new`` (no run), ``changed`` (a run of another config), ``partial`` (unfinished run of
    this config) or ``done`` (finished run of this config)."""
    from fedfm.config import load_config

    root = Path(cfg["out_dir"]) / cfg["name"]
    saved = root / "config.yaml"
    if not saved.exists():
        return "new"
    try:
        old = yaml.safe_load(saved.read_text())
    except yaml.YAMLError:
        return "changed"
    if not isinstance(old, dict) or _comparable(old) != _comparable(
        load_config(cfg).model_dump(mode="json")
    ):
        return "changed"
    try:
        summary = json.loads((root / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "partial"
    return "done" if summary.get("rounds") == cfg["rounds"] else "partial"


def run_job(cfg: dict[str, Any]) -> tuple[str, str | None]:
    """Runs one config (in a worker process); returns (run name, error or None).

    An unfinished run of the same config resumes from its last checkpoint; any other folder
    of that name is replaced.
    """
    import fedfm.algorithms.fedekd  # noqa: F401  (registers fedekd, fedkd-ungated, local-private)
    from fedfm.config import load_config
    from fedfm.engine import Engine

    try:
        status = run_status(cfg)
        if status == "done":
            return cfg["name"], None
        resume = status == "partial"
        Engine(load_config(cfg), resume=resume, overwrite=not resume, progress=False).run()
        return cfg["name"], None
    except Exception as e:  # a failed run is reported in the study, not fatal to it
        return cfg["name"], f"{type(e).__name__}: {e}"


def _run_all(cfgs: list[dict[str, Any]], workers: int) -> tuple[dict[str, str], int]:
    """Runs the configs that are not done; returns (errors by run name, runs executed)."""
    todo = [c for c in cfgs if run_status(c) != "done"]
    if not todo:
        return {}, 0
    if workers <= 1:
        results = [run_job(c) for c in todo]
    else:
        # spawn: fresh interpreters, no forked torch thread pools.
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            results = list(pool.map(run_job, todo, chunksize=1))
    return {name: err for name, err in results if err}, len(todo)


# ----------------------------------------------------------------------------- reading runs


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines log (a torn last line from a killed write is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def client_curves(run: Path, split: str, metric: str) -> dict[int, dict[str, float]]:
    """Round -> client id -> ``metric`` on ``split`` at every evaluated round of a run.

    ``split`` is ``local`` (the client's own test split), ``test`` (the global test set) or
    ``val`` (its validation split), read as ``<split>/<metric>`` from ``client_metrics.jsonl``.
    FedAvg-family runs log only ``local/`` per client; on ``test`` their clients all hold the
    global model, whose value is read from the same round of ``metrics.jsonl``.
    """
    glob = {r["round"]: r for r in _jsonl(run / "metrics.jsonl")}
    out: dict[int, dict[str, float]] = {}
    for row in _jsonl(run / "client_metrics.jsonl"):
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


def _kind_of(run: Path) -> str:
    summary = json.loads((run / "summary.json").read_text())
    return "regression" if summary["primary"] == "rmse" else "classification"


def _finished(run: Path) -> bool:
    return (run / "summary.json").exists() and (run / "client_metrics.jsonl").exists()


def analyse(out: Path, jobs: Iterable[Job]) -> Results:
    """Reads every finished run of ``jobs`` and its local-only reference."""
    res = Results()
    cache: dict[tuple[Path, str, str], dict[int, dict[str, float]]] = {}

    def curve(run: Path, split: str, metric: str) -> dict[int, dict[str, float]]:
        key = (run, split, metric)
        if key not in cache:
            cache[key] = client_curves(run, split, metric)
        return cache[key]

    for job in jobs:
        run = out / job.name
        if not _finished(run):
            continue
        kind = res.kinds.setdefault(job.preset, _kind_of(run))
        cell = CellKey(job.preset, job.setting.tag, job.variant.key, job.long)
        if job.variant.reference is None and not job.long:
            stats = json.loads((run / "partition.json").read_text())
            res.sizes.setdefault((job.preset, job.setting.tag), {})[job.seed] = stats
        ref_job = job.reference()
        ref = out / ref_job.name if ref_job else None
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


def validation_scores(
    grid: Grid, res: Results
) -> dict[tuple[str, str], dict[tuple[float, float], float]]:
    """(preset, setting) -> (β, λ) -> mean over seeds of the mean-client validation NT."""
    out: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
    for p in grid.presets:
        for st in grid.settings:
            m = res.primary(p)
            scores = {}
            for b, lam in grid.configs():
                vals = res.get(CellKey(p, st.tag, gated(b, lam).key), "val", m, "nt_mean")
                if vals:
                    scores[(b, lam)] = float(np.mean(list(vals.values())))
            out[(p, st.tag)] = scores
    return out


def default_gate() -> tuple[float, float]:
    """FedeKD's default (β, λ) in the code."""
    from fedfm.algorithms.fedekd import FedeKDConfig

    d = FedeKDConfig()
    return (d.beta, d.lam)


# ----------------------------------------------------------------------------- report pieces


def _name(preset: str) -> str:
    return preset.removeprefix("fedekd-")


def _digits(metric: str) -> int:
    return 2 if metric == "rmse" else 3


def _unit(metric: str) -> str:
    return {"acc": "accuracy", "macro_f1": "macro-F1", "rmse": "RMSE"}[metric]


def _est(values: Mapping[int, float]) -> Estimate:
    return mean_se(list(values.values()))


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _head(cells: Sequence[str]) -> list[str]:
    return [_row(cells), "|" + "---|" * len(cells)]


def _dataset_table(grid: Grid, res: Results, preset: str, choice: tuple[float, float]) -> list:
    metrics = metrics_of(res.kind(preset))
    m = metrics[0][0]
    u = _unit(m)
    head = ["setting", "method"]
    for where in ("global test", "local split"):
        head += [f"{u} {where}", f"NT mean {where}", f"NT worst {where}", f"harmed {where}"]
    if len(metrics) > 1:
        head += ["NT macro-F1 mean global test", "NT macro-F1 mean local split"]
    lines = _head(head)
    d = _digits(m)
    for st in grid.all_settings():
        for v in featured(choice):
            cell = CellKey(preset, st.tag, v.key)
            row = [st.label, v.label]
            for split in ("test", "local"):
                row.append(_est(res.get(cell, split, m, "value")).fmt(d))
                if v.reference is None:
                    row += ["—"] * 3
                    continue
                row += [
                    _est(res.get(cell, split, m, "nt_mean")).fmt(d),
                    _est(res.get(cell, split, m, "nt_worst")).fmt(d),
                    _est(res.get(cell, split, m, "harmed")).fmt(1),
                ]
            if len(metrics) > 1:
                for split in ("test", "local"):
                    vals = res.get(cell, split, "macro_f1", "nt_mean")
                    row.append(_est(vals).fmt(3) if v.reference else "—")
            lines.append(_row(row))
    return lines


# Statistics of a comparison: (split, stat, column title).
DIFF_STATS = (
    ("test", "nt_mean", "Δ NT mean, global test"),
    ("test", "nt_worst", "Δ NT worst, global test"),
    ("test", "harmed", "Δ harmed, global test"),
    ("local", "nt_mean", "Δ NT mean, local split"),
    ("local", "nt_worst", "Δ NT worst, local split"),
    ("local", "harmed", "Δ harmed, local split"),
)


@dataclass(frozen=True)
class Comparison:
    """A paired comparison of two variants (a − b)."""

    a: Variant
    b: Variant

    @property
    def label(self) -> str:
        return f"{self.a.label} − {self.b.label}"


def comparisons(choice: tuple[float, float]) -> list[Comparison]:
    """The study's headline comparisons, the chosen gate first."""
    sel = gated(*choice)
    out = [Comparison(sel, ungated(choice[1]))]
    if choice != REFERENCE_GATE:
        out.append(Comparison(gated(*REFERENCE_GATE), ungated(REFERENCE_GATE[1])))
    out += [Comparison(sel, Variant("fedavg")), Comparison(sel, Variant("fedprox"))]
    return out


def _pair(res: Results, comp: Comparison, preset: str, tag: str, split: str, stat: str) -> tuple:
    m = res.primary(preset)
    a = res.get(CellKey(preset, tag, comp.a.key), split, m, stat)
    b = res.get(CellKey(preset, tag, comp.b.key), split, m, stat)
    return a, b


def _pooled_classification(
    grid: Grid, res: Results, comp: Comparison, split: str, stat: str, tags: Sequence[str]
) -> Estimate:
    pairs = [
        _pair(res, comp, p, t, split, stat)
        for p in grid.presets
        if res.kind(p) == "classification"
        for t in tags
    ]
    pairs = [(a, b) for a, b in pairs if a and b]
    return pooled_paired(pairs)


def _tags(settings: Sequence[Setting]) -> list[str]:
    return [st.tag for st in settings]


def _comparison_table(grid: Grid, res: Results, comp: Comparison) -> list[str]:
    """Per (dataset, setting) paired differences, then classification pooled per setting."""
    lines = _head(["dataset", "setting", *[t for _, _, t in DIFF_STATS]])
    for p in grid.presets:
        d = _digits(res.primary(p))
        for st in grid.all_settings():
            row = [_name(p), st.label]
            for split, stat, _ in DIFF_STATS:
                a, b = _pair(res, comp, p, st.tag, split, stat)
                row.append(paired(a, b).fmt(1 if stat == "harmed" else d, signed=True))
            lines.append(_row(row))
    if any(res.kind(p) == "classification" for p in grid.presets):
        groups = [(st.label, [st.tag]) for st in grid.all_settings()]
        if len(grid.settings) > 1:
            groups.append(("skewed settings", _tags(grid.settings)))
        for label, tags in groups:
            row = ["**classification pooled**", label]
            for split, stat, _ in DIFF_STATS:
                est = _pooled_classification(grid, res, comp, split, stat, tags)
                row.append(est.fmt(1 if stat == "harmed" else 3, signed=True))
            lines.append(_row(row))
    return lines


def _better(est: Estimate, stat: str) -> int:
    """+1 when a is better than b by more than 2 SE, −1 when worse, 0 otherwise (for the count
    of harmed clients, fewer is better)."""
    r = est.resolved()
    return -r if stat == "harmed" else r


def _verdict(est: Estimate, stat: str) -> str:
    if est.n < 2:
        return "no SE (fewer than 2 seeds)"
    return {1: "a better (> 2 SE)", -1: "b better (> 2 SE)", 0: "not resolved (≤ 2 SE)"}[
        _better(est, stat)
    ]


def _cell_counts(
    grid: Grid, res: Results, comp: Comparison, split: str, stat: str, tags: Sequence[str]
) -> tuple[int, int, int]:
    """Cells where a is better, where b is better (each by more than 2 SE), and cells."""
    up = down = n = 0
    for p in grid.presets:
        for t in tags:
            est = paired(*_pair(res, comp, p, t, split, stat))
            if est.n < 2:
                continue
            n += 1
            up += _better(est, stat) > 0
            down += _better(est, stat) < 0
    return up, down, n


def _regression_pooled(
    res: Results, comp: Comparison, preset: str, split: str, stat: str, tags: Sequence[str]
) -> Estimate:
    pairs = [_pair(res, comp, preset, t, split, stat) for t in tags]
    return pooled_paired([(a, b) for a, b in pairs if a and b])


def _findings_table(grid: Grid, res: Results, comp: Comparison) -> list[str]:
    """Per statistic: pooled estimates with SE, cell counts and the verdict."""
    skew, ctrl = _tags(grid.settings), _tags(grid.control_settings)
    regs = [p for p in grid.presets if res.kind(p) == "regression"]
    head = ["statistic", "classification pooled, skewed settings", "verdict"]
    head += ["classification pooled, control"] if ctrl else []
    head += [f"{_name(p)}, skewed settings pooled" for p in regs]
    head += ["cells a better / b better / cells (skewed settings, > 2 SE)"]
    lines = _head(head)
    for split, stat, title in DIFF_STATS:
        dig = 1 if stat == "harmed" else 3
        est = _pooled_classification(grid, res, comp, split, stat, skew)
        row = [title, est.fmt(dig, signed=True), _verdict(est, stat)]
        if ctrl:
            row.append(_pooled_classification(grid, res, comp, split, stat, ctrl).fmt(dig, True))
        for p in regs:
            reg = _regression_pooled(res, comp, p, split, stat, skew)
            row.append(reg.fmt(1 if stat == "harmed" else 2, signed=True))
        up, down, n = _cell_counts(grid, res, comp, split, stat, skew)
        row.append(f"{up} / {down} / {n}")
        lines.append(_row(row))
    return lines


def _headline(grid: Grid, res: Results, comp: Comparison) -> str:
    """One bullet: the comparison's main statistics, pooled, each with its SE and verdict."""
    skew = _tags(grid.settings)
    parts = []
    for split, stat in (("test", "nt_mean"), ("test", "nt_worst"), ("local", "nt_mean")):
        est = _pooled_classification(grid, res, comp, split, stat, skew)
        what = "mean-client" if stat == "nt_mean" else "worst-client"
        where = "global test set" if split == "test" else "local test splits"
        parts.append(f"{what} NT on the {where} Δ = {est.fmt(3, True)} ({_verdict(est, stat)})")
    regs = [
        f"{_name(p)} {_regression_pooled(res, comp, p, 'test', 'nt_mean', skew).fmt(2, True)}"
        for p in grid.presets
        if res.kind(p) == "regression"
    ]
    tail = f"; regression, mean-client NT on the global test set (RMSE): {', '.join(regs)}"
    return (
        f"- **{comp.label}**, classification sets pooled over the skewed settings (accuracy,"
        f" paired SE over seeds): " + "; ".join(parts) + (tail if regs else "") + "."
    )


def _own_nt_table(grid: Grid, res: Results, choice: tuple[float, float]) -> list[str]:
    """Whether each featured method harms the mean client relative to local-only training."""
    groups = [("skewed settings", _tags(grid.settings))]
    if grid.control_settings:
        groups.append(("control", _tags(grid.control_settings)))
    head = ["method"]
    for label, _ in groups:
        head += [
            f"classification pooled NT mean, global test, {label}",
            f"cells NT > 0 / < 0 / cells, global test, {label}",
            f"classification pooled NT mean, local split, {label}",
            f"cells NT > 0 / < 0 / cells, local split, {label}",
        ]
    lines = _head(head)
    for v in featured(choice):
        if v.reference is None:
            continue
        row = [v.label]
        for _, tags in groups:
            for split in ("test", "local"):
                pos = neg = n = 0
                pooled = []
                for p in grid.presets:
                    for t in tags:
                        vals = res.get(CellKey(p, t, v.key), split, res.primary(p), "nt_mean")
                        if res.kind(p) == "classification" and vals:
                            pooled.append((vals, dict.fromkeys(vals, 0.0)))
                        est = _est(vals)
                        if est.n < 2:
                            continue
                        n += 1
                        pos += est.resolved() > 0
                        neg += est.resolved() < 0
                row += [pooled_paired(pooled).fmt(3, True), f"{pos} / {neg} / {n}"]
        lines.append(_row(row))
    return lines


def _validation_lines(grid: Grid, res: Results, choice: Choice | None) -> list[str]:
    scores = validation_scores(grid, res)
    lams = [float(x) for x in grid.lams]
    lines = [
        "Mean rank of each (β, λ) over the (dataset, setting) cells, by mean-client NT on the"
        " validation split (1 = least harmful of the "
        f"{len(grid.configs())} configurations):",
        "",
        *_head(["β \\ λ", *[f"λ={x:g}" for x in lams]]),
    ]
    for b in grid.betas:
        row = [f"β={b:g}"]
        for lam in lams:
            r = choice.mean_rank.get((float(b), lam)) if choice else None
            row.append("—" if r is None else f"{r:.2f}")
        lines.append(_row(row))
    lines += [
        "",
        "Validation NT per cell (mean-client, primary metric, mean over seeds; the numbers the"
        " rule ranks):",
        "",
    ]
    configs = grid.configs()
    lines += _head(["dataset", "setting", *[f"β={b:g} λ={lam:g}" for b, lam in configs]])
    for p in grid.presets:
        d = _digits(res.primary(p))
        for st in grid.settings:
            s = scores.get((p, st.tag), {})
            row = [_name(p), st.label]
            row += [f"{s[c]:+.{d}f}" if c in s else "—" for c in configs]
            lines.append(_row(row))
    return lines


def _gate_grid_table(grid: Grid, res: Results) -> list[str]:
    """Every gated configuration against ungated KD at its λ, on the global test set."""
    head = [
        "configuration",
        "Δ NT mean, classification pooled",
        "Δ NT worst, classification pooled",
    ]
    regs = [p for p in grid.presets if res.kind(p) == "regression"]
    head += [f"Δ NT mean, {_name(p)}, settings pooled" for p in regs]
    head += ["cells a better / b better (NT mean, > 2 SE)"]
    lines = _head(head)
    tags = [st.tag for st in grid.settings]
    for b, lam in grid.configs():
        comp = Comparison(gated(b, lam), ungated(lam))
        row = [comp.label]
        for stat in ("nt_mean", "nt_worst"):
            row.append(_pooled_classification(grid, res, comp, "test", stat, tags).fmt(3, True))
        for p in regs:
            pairs = [_pair(res, comp, p, t, "test", "nt_mean") for t in tags]
            row.append(pooled_paired([(a, b_) for a, b_ in pairs if a and b_]).fmt(2, True))
        up, down, n = _cell_counts(grid, res, comp, "test", "nt_mean", tags)
        row.append(f"{up} / {down} of {n}")
        lines.append(_row(row))
    return lines


def _common_rounds(curves: Sequence[Mapping[int, float]]) -> list[int]:
    """Rounds present in every curve (none for no curves)."""
    if not curves:
        return []
    return sorted(set.intersection(*(set(c) for c in curves)))


def _curve_rounds(rounds: Sequence[int], k: int = 6) -> list[int]:
    """About ``k`` rounds spread over ``rounds`` (first and last included)."""
    if len(rounds) <= k:
        return list(rounds)
    idx = np.unique(np.linspace(0, len(rounds) - 1, k).round().astype(int))
    return [rounds[i] for i in idx]


def _curve_table(grid: Grid, res: Results, preset: str, choice: tuple[float, float], split: str):
    m = res.primary(preset)
    d = _digits(m)
    tag = grid.long_setting.tag
    fed = [v for v in long_variants(choice) if v.reference is not None]
    cuts = [Comparison(gated(*choice), ungated(choice[1])), Comparison(gated(*choice), fed[0])]

    def seeds_at(v: Variant, r: int) -> dict[int, float]:
        per = res.curves.get((CellKey(preset, tag, v.key, True), split, m), {})
        return {s: c[r] for s, c in per.items() if r in c}

    rounds = sorted(
        {
            r
            for v in fed
            for c in res.curves.get((CellKey(preset, tag, v.key, True), split, m), {}).values()
            for r in c
        }
    )
    head = ["round", *[f"NT {v.label}" for v in fed], *[f"Δ {c.label}" for c in cuts]]
    lines = _head(head)
    for r in _curve_rounds(rounds):
        row = [str(r)]
        row += [_est(seeds_at(v, r)).fmt(d) for v in fed]
        row += [paired(seeds_at(c.a, r), seeds_at(c.b, r)).fmt(d, signed=True) for c in cuts]
        lines.append(_row(row))
    return lines


def _curve_findings(grid: Grid, res: Results, choice: tuple[float, float]) -> list[str]:
    """Gate effect early and late in the long runs, with standard errors."""
    lines = []
    comp = Comparison(gated(*choice), ungated(choice[1]))
    tag = grid.long_setting.tag
    for p in grid.long_presets:
        m = res.primary(p)
        a = res.curves.get((CellKey(p, tag, comp.a.key, True), "test", m), {})
        b = res.curves.get((CellKey(p, tag, comp.b.key, True), "test", m), {})
        rounds = _common_rounds([*a.values(), *b.values()])
        if len(rounds) < 2:
            continue
        parts = []
        for r in (rounds[0], rounds[len(rounds) // 4], rounds[-1]):
            est = paired({s: c[r] for s, c in a.items()}, {s: c[r] for s, c in b.items()})
            parts.append(f"round {r}: {est.fmt(_digits(m), signed=True)}")
        lines.append(
            f"- {_name(p)} ({_unit(m)}, mean-client NT on the global test set), {comp.label}: "
            + "; ".join(parts)
            + "."
        )
    return lines


def _sizes_table(grid: Grid, res: Results) -> list[str]:
    lines = _head(
        [
            "dataset",
            "setting",
            "partition rows, min / median",
            "local test rows, min / median",
            "validation rows, min / median",
        ]
    )
    for p in grid.presets:
        for st in grid.all_settings():
            per = res.sizes.get((p, st.tag), {})
            if not per:
                continue
            row = [_name(p), st.label]
            for key in ("sizes", "local_test_sizes", "local_val_sizes"):
                vals = [x for s in per.values() for x in s.get(key, [])]
                row.append(f"{min(vals)} / {np.median(vals):g}" if vals else "—")
            lines.append(_row(row))
    return lines


def _preset_summary(preset: str) -> str:
    d = preset_data(preset)
    t, a, p, tr = d["task"], d.get("algo", {}), d["partition"], d.get("train", {})
    skew = f"{p['scheme']} by {p.get('by', 'label')}" + (
        f" ({p['bins']} bins)" if p.get("bins") else ""
    )
    return _row(
        [
            _name(preset),
            f"{t['dataset']} ({t['kind']})",
            f"{t.get('model', 'mlp')} {t.get('model_args', {})}",
            str(a.get("private_archs")),
            str(a.get("proxy_arch")),
            f"{skew}, min {p.get('min_size')}",
            str(d.get("rounds")),
            f"{tr.get('steps')} steps per stage, bs {tr.get('batch_size')},"
            f" {tr.get('optimizer')} lr {tr.get('lr')}",
        ]
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


# ----------------------------------------------------------------------------- figures


def _groups(grid: Grid, res: Results) -> list[tuple[str, list[str]]]:
    """Presets by task kind: accuracy and RMSE get their own panels (their scales differ)."""
    out = []
    for kind, label in (("classification", "accuracy"), ("regression", "RMSE")):
        ps = [p for p in grid.presets if res.kind(p) == kind]
        if ps:
            out.append((label, ps))
    return out


def _figures(grid: Grid, res: Results, choice: tuple[float, float], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    groups = _groups(grid, res)
    fed = [v for v in featured(choice) if v.reference is not None]
    width = 0.8 / max(len(fed), 1)
    panels = [(label, ps, split) for label, ps in groups for split in ("test", "local")]
    fig, axes = plt.subplots(
        len(grid.all_settings()),
        len(panels),
        figsize=(3.6 * len(panels) + 1, 3.0 * len(grid.all_settings())),
        squeeze=False,
    )
    for r, st in enumerate(grid.all_settings()):
        for c, (label, presets, split) in enumerate(panels):
            ax = axes[r, c]
            for j, v in enumerate(fed):
                means, ses, worsts = [], [], []
                for p in presets:
                    cell = CellKey(p, st.tag, v.key)
                    est = _est(res.get(cell, split, res.primary(p), "nt_mean"))
                    means.append(est.mean)
                    ses.append(est.se if est.n > 1 else 0.0)
                    worsts.append(_est(res.get(cell, split, res.primary(p), "nt_worst")).mean)
                x = np.arange(len(presets)) + (j - (len(fed) - 1) / 2) * width
                bars = ax.bar(x, means, width, yerr=ses, capsize=2, label=v.label)
                ax.scatter(x, worsts, marker="v", s=12, color=bars.patches[0].get_facecolor())
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xticks(np.arange(len(presets)))
            ax.set_xticklabels([_name(p) for p in presets], fontsize=8)
            where = "global test" if split == "test" else "local split"
            ax.set_ylabel(f"NT, {label}")
            ax.set_title(f"{st.label}, {where}", fontsize=9)
    axes[0, 0].legend(fontsize=6, ncols=1)
    fig.suptitle(
        "Negative transfer: bar = mean client ± SE over seeds, ▼ = worst client", fontsize=10
    )
    fig.tight_layout()
    paths.append(folder / "negative_transfer.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # The rule's ranks on validation, and the same ranking on the global test set for contrast.
    scores = validation_scores(grid, res)
    test_scores: dict[tuple[str, str], dict[tuple[float, float], float]] = {}
    for p in grid.presets:
        for st in grid.settings:
            s = {}
            for b, lam in grid.configs():
                vals = res.get(
                    CellKey(p, st.tag, gated(b, lam).key), "test", res.primary(p), "nt_mean"
                )
                if vals:
                    s[(b, lam)] = float(np.mean(list(vals.values())))
            test_scores[(p, st.tag)] = s
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), squeeze=False)
    for ax, (title, sc) in zip(
        axes[0],
        (("validation split (the rule)", scores), ("global test set", test_scores)),
        strict=True,
    ):
        ch = choose_gate(grid.configs(), sc)
        mat = np.full((len(grid.betas), len(grid.lams)), np.nan)
        if ch:
            for i, b in enumerate(grid.betas):
                for j, lam in enumerate(grid.lams):
                    mat[i, j] = ch.mean_rank[(float(b), float(lam))]
        im = ax.imshow(mat, cmap="viridis_r", aspect="auto")
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                if np.isfinite(mat[i, j]):
                    ax.text(
                        j, i, f"{mat[i, j]:.1f}", ha="center", va="center", fontsize=8, color="w"
                    )
        ax.set_xticks(range(len(grid.lams)), [f"λ={x:g}" for x in grid.lams])
        ax.set_yticks(range(len(grid.betas)), [f"β={x:g}" for x in grid.betas])
        ax.set_title(f"mean rank of mean-client NT, {title}", fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    paths.append(folder / "gate_grid.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    if grid.long_presets:
        tag = grid.long_setting.tag
        lv = [v for v in long_variants(choice) if v.reference is not None]
        fig, axes = plt.subplots(
            2, len(grid.long_presets), figsize=(4.2 * len(grid.long_presets), 6.0), squeeze=False
        )
        for c, p in enumerate(grid.long_presets):
            m = res.primary(p)
            for r, split in enumerate(("test", "local")):
                ax = axes[r, c]
                for v in lv:
                    per = res.curves.get((CellKey(p, tag, v.key, True), split, m), {})
                    rounds = _common_rounds(list(per.values()))
                    if not rounds:
                        continue
                    ests = [mean_se([x[rr] for x in per.values()]) for rr in rounds]
                    mu = np.array([e.mean for e in ests])
                    se = np.array([e.se if e.n > 1 else 0.0 for e in ests])
                    ax.plot(rounds, mu, label=v.label, lw=1.2)
                    ax.fill_between(rounds, mu - se, mu + se, alpha=0.2)
                ax.axhline(0, color="k", lw=0.8)
                where = "global test" if split == "test" else "local split"
                ax.set_title(f"{_name(p)}, {where}", fontsize=9)
                ax.set_xlabel("round")
                ax.set_ylabel(f"mean-client NT, {_unit(m)}")
        axes[0, 0].legend(fontsize=6)
        fig.suptitle(
            f"Negative transfer over rounds, {grid.long_setting.label} (mean ± SE over seeds)",
            fontsize=10,
        )
        fig.tight_layout()
        paths.append(folder / "nt_curves.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """One invocation's cost: wall clock, CPU of every process, and the machine's load.

    The load averages say how much other work shared the cores: wall time on a busy machine
    overstates the study's own cost, which the CPU time measures.
    """

    wall_s: float
    cpu_s: float
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    runs: int = 0

    def line(self) -> str:
        """One report line."""
        ls, le = (f"{x[0]:.1f}" for x in (self.load_start, self.load_end))
        return (
            f"wall time {self.wall_s / 60:.1f} min, CPU time of all processes"
            f" {self.cpu_s / 60:.1f} min, {self.runs} runs executed; 1-minute load average"
            f" {ls} at the start, {le} at the end"
        )


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the worker processes)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timings(out: Path) -> list[Timing]:
    """Every invocation that executed runs, from the study folder's ``timing.jsonl``."""
    return [
        Timing(r["wall_s"], r["cpu_s"], tuple(r["load_start"]), tuple(r["load_end"]), r["runs"])
        for r in _jsonl(out / "timing.jsonl")
    ]


def _timing_lines(timings: Sequence[Timing]) -> list[str]:
    machine = (
        f"{os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()})"
    )
    if not timings:
        return [f"- Time: not recorded (no invocation that executed runs), on {machine}."]
    wall = sum(t.wall_s for t in timings) / 60
    cpu = sum(t.cpu_s for t in timings) / 60
    lines = [
        f"- Time, over {len(timings)} invocation(s) that executed runs: wall {wall:.1f} min, CPU"
        f" time of all processes {cpu:.1f} min, on {machine}, shared with other work:"
    ]
    lines += [f"  - {t.line()}." for t in timings]
    return lines


# ----------------------------------------------------------------------------- the report

INTRO = """\
# FedeKD: energy-gated federated knowledge distillation — reproduction

Paper: Nguyen, Wang, Ku, *FedeKD: Energy-Based Gating for Robust Federated Knowledge
Distillation under Heterogeneity*, arXiv:2605.05553. Code: `src/fedfm/algorithms/fedekd.py`
(algorithm), `src/fedfm/core/kd.py` (losses, energies, gates), this study:
`src/fedfm/reproduce/fedekd.py` (statistics: `src/fedfm/reproduce/stats.py`). This page is
written by the study; do not edit it by hand.

## What the paper's text gives, and what is ours

The paper's text available here stops inside section 3.5, after eq. (2) and the first lines of
its design rationale. **Eq. (3) (the gated backward objective), Algorithm 1, the experimental
setup and the result tables are not available.** So the gate's form (below), β and λ, the
settings of the datasets and baselines, and every number on this page are ours; nothing here
is compared with numbers the paper reports, and the study cannot say whether it reproduces
them. What the text does fix: the private/proxy split, the forward and backward distillation
stages, the two energies (eqs. 1–2), that the gate is "batch-normalised" and lowers the trust
of high-energy samples, and the claim under test (less negative transfer, mean and worst
client, under heterogeneity).

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

The gate is pluggable (`algo.gate`, registry `fedfm.core.kd.GATES`). **The gate's form is
ours** (the text only says "batch-normalised"): `w = sigmoid(−β·z)`, z the batch-standardised
energy, weights detached. `fedkd-ungated` uses w = 1 (FML/FedKD style). With β = 0 every
weight is ½, so after the Σw normalisation β = 0 is the ungated baseline (`tests/test_fedekd.py`
checks the two agree). Only the proxy travels: in every run's audit ledger `proxy` is the
only array field.
"""

STATISTICS = """\
**Negative transfer** (NT) per client = federated − local-only for accuracy and macro-F1,
local-only − federated for RMSE, so a negative value always means the federation hurt that
client; "mean" averages the clients, "worst" is the most harmed client, "harmed" counts the
clients with NT < 0. References: FedAvg and FedProx against the shared architecture trained
alone (`local`), the private/proxy methods against each client's private architecture trained
alone (`local-private`, same budget as FedeKD's backward stage); a reference run has the same
seed, partition and splits. NT is measured at the last round on two sets: the **global test
set** (each client's model on the shared test set against its local-only counterpart on the
same set; for FedAvg and FedProx every client's model is the global model; hundreds of rows,
so NT moves in fine steps), and each client's **local test split** (its own distribution, but
only a few rows on the smallest clients, see the table above).

**Standard errors.** Every ± on this page is a standard error over seeds: the sample standard
deviation (ddof = 1) over the per-seed values divided by √n. A difference between two methods
(Δ = a − b) is *paired*: per seed (same partition, same splits) d_s = a_s − b_s, and Δ is the
mean of d_s with SE = sd(d_s)/√n. "Classification pooled" averages, per seed, the d_s of the
four classification sets (and of the settings named) before taking mean and SE over seeds, so
its unit is accuracy and its SE still comes from the spread over seeds; the regression sets
have different units and are never pooled. "Resolved" means more than 2 SE from zero (with 5
seeds the 95 % t quantile is 2.78, so 2 SE is a lenient screen, not a test).
"""

RULE = """\
**The rule, stated before the grid ran** (module docstring of `src/fedfm/reproduce/fedekd.py`;
it never reads a test number): for every (dataset, setting) cell, the gated configurations
(β, λ) are ranked by their mean-client NT on the **validation split** (primary metric, mean
over seeds; rank 1 = least harmful, ties share the mean rank); the configuration with the
lowest mean rank over all cells is chosen, ties going to the smaller β, then the smaller λ.
FedeKD's default in the code follows the chosen configuration. The validation split is 15 % of
each client's partition, disjoint from its training rows and local test split, held out in
every run of every method.
"""


def write_report(
    grid: Grid,
    out: Path,
    report: Path,
    command: str,
    failed: Mapping[str, str],
    notes: Sequence[str] = (),
) -> Path:
    """Writes the markdown report with its figures (in a folder next to it)."""
    main = main_jobs(grid)
    res0 = analyse(out, main)
    choice = choose_gate(grid.configs(), validation_scores(grid, res0))
    gate = choice.gate if choice else REFERENCE_GATE
    after = chosen_jobs(grid, gate)
    res = analyse(out, main + after)
    figs = _figures(grid, res, gate, report.parent / report.stem)
    n_long = sum(j.long for j in after)

    def settings(sts: Sequence[Setting]) -> str:
        return "; ".join(
            st.label + (f" (min partition {st.min_size})" if st.min_size else "") for st in sts
        )

    lines = [
        INTRO,
        "## How to reproduce",
        "",
        "```",
        command,
        "```",
        "",
        f"- Main grid: {len(main)} runs = {len(grid.presets)} datasets × {len(grid.settings)}"
        f" skewed settings × {len(grid.seeds)} seeds × {len(grid.main_variants())} variants"
        " (local-only"
        f" with shared and with private archs, FedAvg, FedProx, ungated KD at λ ∈"
        f" {{{', '.join(f'{x:g}' for x in grid.lams)}}}, FedeKD at β ∈"
        f" {{{', '.join(f'{x:g}' for x in grid.betas)}}} × λ ∈"
        f" {{{', '.join(f'{x:g}' for x in grid.lams)}}});"
        f" {grid.rounds or 'the presets’'} rounds, clients evaluated every {grid.eval_every}.",
        "- Settings (Dirichlet label skew; for regression over quantile bins of the target):"
        f" skewed, in the main grid: {settings(grid.settings)}"
        + (
            f"; control, run after the choice with the rows of the per-dataset tables only"
            f" ({len(after) - n_long} runs): {settings(grid.control_settings)}."
            if grid.control_settings
            else "."
        ),
        f"- Seeds: {', '.join(map(str, grid.seeds))}; a seed draws the partition, the splits and"
        " the initialisations, so every method of a seed sees the same clients and rows.",
        f"- Long runs: {n_long} runs = {len(grid.long_presets)} datasets"
        f" ({', '.join(_name(p) for p in grid.long_presets)}) × {len(grid.long_seeds)} seeds ×"
        f" {len(long_variants(gate))} variants, {grid.long_setting.label}, {grid.long_rounds}"
        f" rounds, clients evaluated every {grid.long_eval_every}.",
        f"- {grid.workers} worker process(es) with one torch thread each; finished runs are"
        " skipped and unfinished ones resumed when the command is run again.",
        *_timing_lines(_timings(out)),
        *([f"- Local training overridden: {grid.train}."] if grid.train else []),
        "",
        _row(
            [
                "preset",
                "data",
                "shared arch (FedAvg, FedProx, local)",
                "private archs (cycled)",
                "proxy",
                "skew (preset)",
                "rounds (preset)",
                "local training",
            ]
        ),
        "|---|---|---|---|---|---|---|---|",
        *[_preset_summary(p) for p in grid.presets],
        "",
        "Rows per client (over all seeds; a partition is split into local test 25 %, validation"
        f" {grid.val_fraction:.0%} and training rows):",
        "",
        *_sizes_table(grid, res),
        "",
    ]
    if notes:
        lines += ["**Data notes.** " + "; ".join(notes) + ".", ""]
    lines += ["## Statistics", "", STATISTICS, "## Choosing β and λ", "", RULE]
    d_beta, d_lam = default_gate()
    if choice:
        agree = (d_beta, d_lam) == choice.gate
        lines += [
            f"**Chosen: β = {choice.beta:g}, λ = {choice.lam:g}** (mean rank"
            f" {choice.mean_rank[choice.gate]:.2f} over {len(choice.cells)} cells"
            + (f"; {len(choice.missing)} incomplete cells left out" if choice.missing else "")
            + f"). FedeKD's default in the code is β = {d_beta:g}, λ = {d_lam:g}: "
            + ("it agrees with the rule." if agree else "**it differs from the rule's choice**.")
            + f" Before the rule was applied the default was β = {REFERENCE_GATE[0]:g},"
            f" λ = {REFERENCE_GATE[1]:g}"
            + (
                " (unchanged)."
                if choice.gate == REFERENCE_GATE
                else "; it changed to the rule's choice."
            ),
            "",
        ]
    else:
        lines += ["No cell has every configuration's validation value: nothing was chosen.", ""]
    lines += [*_validation_lines(grid, res, choice), ""]
    comps = comparisons(gate)
    lines += [
        "## Findings",
        "",
        "Each finding is a paired comparison a − b with its standard error over seeds (higher"
        " NT is better; fewer harmed clients is better; the verdicts account for the"
        " direction). Classification sets are pooled per seed (accuracy units); the regression"
        " sets are given one by one (RMSE units).",
        "",
        *[_headline(grid, res, c) for c in comps],
        "",
    ]
    for c in comps:
        lines += [f"### {c.label}", "", *_findings_table(grid, res, c), ""]
    lines += [
        "### Against local-only training",
        "",
        "Is the method itself harmful for the mean client? Mean-client NT against the"
        " method's local-only reference, classification pooled (± SE over seeds), and the"
        " cells where it is above or below zero by more than 2 SE.",
        "",
        *_own_nt_table(grid, res, gate),
        "",
    ]
    curve_lines = _curve_findings(grid, res, gate)
    if curve_lines:
        lines += [
            "Over training (long runs, paired Δ of mean-client NT with SE at the first"
            " evaluated round, a quarter of the way and the last round):",
            "",
            *curve_lines,
            "",
        ]
    lines += ["## Paired differences per cell", ""]
    for comp in comps:
        lines += [f"### {comp.label}", "", *_comparison_table(grid, res, comp), ""]
    lines += [
        "## Results per dataset",
        "",
        "Mean ± SE over seeds at the last round; primary metric (accuracy or RMSE) of the mean"
        " client, its NT (mean and worst client) and the number of clients harmed, on the global"
        " test set and on the local test splits.",
        "",
    ]
    for p in grid.presets:
        lines += [f"### {_name(p)}", "", *_dataset_table(grid, res, p, gate), ""]
    lines += [
        "## The gate grid on the global test set",
        "",
        "Every gated configuration against ungated KD at the same λ (paired over seeds;"
        " classification pooled over datasets and settings, each regression set pooled over"
        " settings). The rule did not see these numbers.",
        "",
        *_gate_grid_table(grid, res),
        "",
    ]
    if grid.long_presets:
        lines += [
            f"## Negative transfer over rounds ({grid.long_setting.label},"
            f" {grid.long_rounds} rounds)",
            "",
            "Mean-client NT (primary metric) ± SE over seeds at evaluated rounds, and paired"
            " differences. The figure `nt_curves.png` shows every evaluated round.",
            "",
        ]
        for p in grid.long_presets:
            for split, where in (("test", "global test set"), ("local", "local test splits")):
                lines += [
                    f"### {_name(p)}, {where}",
                    "",
                    *_curve_table(grid, res, p, gate, split),
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
    """Runs what is missing of the grid into ``out`` and writes ``report``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    t0, cpu0, load0 = time.perf_counter(), _cpu_seconds(), os.getloadavg()
    notes = _data_notes(grid)  # before the runs: sources log their dropped rows on first load
    failed, ran = _run_all([job_config(j, grid, out) for j in main_jobs(grid)], grid.workers)
    res = analyse(out, main_jobs(grid))
    choice = choose_gate(grid.configs(), validation_scores(grid, res))
    gate = choice.gate if choice else REFERENCE_GATE
    more, ran_long = _run_all(
        [job_config(j, grid, out) for j in chosen_jobs(grid, gate)], grid.workers
    )
    failed.update(more)
    if ran + ran_long:
        t = Timing(
            time.perf_counter() - t0,
            _cpu_seconds() - cpu0,
            tuple(load0),
            tuple(os.getloadavg()),
            ran + ran_long,
        )
        with (out / "timing.jsonl").open("a") as f:
            f.write(json.dumps(dataclasses.asdict(t)) + "\n")
    return write_report(grid, out, report, command, failed, notes)


@STUDIES.register("fedekd", "FedeKD vs local, FedAvg, FedProx, ungated KD on six datasets")
def fedekd_study(out: Path, quick: bool) -> Path:
    """The registered study: the full grid into docs/fedekd.md, or the quick one into ``out``."""
    out = Path(out) / ("fedekd-quick" if quick else "fedekd")
    if quick:  # one process: starting worker interpreters costs more than the quick grid
        grid = dataclasses.replace(QUICK, workers=1)
        return run_study(grid, out, out / "fedekd-quick.md", "fedfm reproduce fedekd --quick")
    grid = dataclasses.replace(FULL, workers=min(2, os.cpu_count() or 1))
    return run_study(grid, out, Path("docs") / "fedekd.md", "fedfm reproduce fedekd")
