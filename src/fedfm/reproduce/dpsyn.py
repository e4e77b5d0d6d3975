"""DP federated text generation study: DP noise, strong-client share and weak clients' votes.

``fedfm reproduce dpsyn`` runs :mod:`fedfm.algorithms.dpsyn` ("Resource-Adaptive Federated
Text Generation with Differential Privacy", ICLR 2026, arXiv:2603.07027) on the presets'
stand-ins for the paper's data sets, Rotten Tomatoes (``dpsyn-rotten-tomatoes``: fresh/rotten
as codes, for the paper's Yelp ratings) and drugs.com reviews (``dpsyn-drug-reviews``:
sentiment as codes, the medical stand-in), over a grid of

* code distributions: IID, and non-IID (Dirichlet over the label, α = 0.5);
* strong-client fractions (``clients.roles.strong``): 10 % and 50 %, and 5 % where there are
  20 clients;
* ``epsilon_train`` ∈ {1, 8, ∞};
* with and without voting: **one run gives both**. Round ``R + 1`` evaluates the generated
  set (``synthetic_initial.jsonl``: without voting), round ``R + 2`` the set resampled by the
  weak clients' votes (``synthetic.jsonl``: with voting), so the two are paired by
  construction (same model, same generated samples, same test rows).

Per (data set, code distribution, seed) the grid adds a **floor** run, ``train_rounds: 0``
(the un-fine-tuned base model generates; its voting row is the floor with voting), which also
computes the **ceiling** (``algo.eval.references``: the same classifiers trained on every
client's real training rows). It uses the smallest strong fraction of its data set, so its
voters are the weak clients of that fraction (strong clients never vote).

The report (``docs/dpsyn-study.md``, or ``docs/dpsyn-quick.md`` for ``--quick``) reads every
number from the runs' folders: downstream accuracy and macro-F1 of both classifiers (logistic
regression on MiniLM embeddings, fedfm's small text classifier), the Fréchet distance of
MiniLM embeddings, each mechanism's ε and their composition per role, bytes and wall time
per stage, beside the paper's findings.

Statistics (ours): every set of a data set and code distribution is scored on the same real
held-out rows, and each run keeps every classifier's prediction per row (``eval_items.jsonl``),
so a difference between two sets is **paired over test rows**: for accuracy, the mean and SE
(sd / √n) of the per-row differences of correctness; for macro-F1, the SE of the difference
over 1,000 paired bootstrap resamples of the test rows (seeded). These SEs say what the test
rows can resolve for these particular synthetic sets; they do not include the spread over
seeds (another draw of DP noise, sampling and generation), which is larger; with several
seeds, the report also gives the paired SE over seeds (:mod:`fedfm.reproduce.stats`). A
difference is marked ``*`` when it is more than 2 SE from zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfm.reproduce.framework import Context, Readout, Run, RunView, Study, merge, preset, register
from fedfm.reproduce.stats import BOOTSTRAP, NONE, Estimate, macro_f1_diff, paired
from fedfm.reproduce.tables import head, marked, num, row

PRESETS = {"rotten_tomatoes": "dpsyn-rotten-tomatoes", "drug_reviews": "dpsyn-drug-reviews"}
NAMES = {"rotten_tomatoes": "Rotten Tomatoes", "drug_reviews": "drugs.com reviews"}
PARTITIONS: dict[str, dict[str, Any]] = {
    "iid": {"scheme": "iid"},
    # min_size 5: no Dirichlet(0.5) split of 20 clients × 50 rows gave every client 10 rows.
    "noniid": {"scheme": "dirichlet", "by": "label", "alpha": 0.5, "min_size": 5},
}
FLOOR = "floor"
# (metric, label, higher is better): what the report tabulates per set.
METRICS = (
    ("acc", "logreg acc", True),
    ("macro_f1", "logreg F1", True),
    ("clf/acc", "clf acc", True),
    ("clf/macro_f1", "clf F1", True),
    ("frechet", "Fréchet", False),
)
CLASSIFIERS = (("logreg", ""), ("clf", "clf/"))


@dataclass(frozen=True)
class Data:
    """A data set of the grid.

    Attributes:
        name: The text source (``rotten_tomatoes`` or ``drug_reviews``; its preset is used).
        clients: Clients of the federation.
        rows: Training rows per client (``None``: the source's whole training split).
        strong: Strong-client fractions of its cells.
    """

    name: str
    clients: int
    rows: int | None
    strong: tuple[float, ...]


@dataclass(frozen=True)
class Cell:
    """One run: a data set, a code distribution, a seed and a (strong, ε) setting.

    ``epsilon`` is ``None`` for the floor run (no fine-tuning).
    """

    data: str
    partition: str
    seed: int
    strong: float
    epsilon: float | None

    @property
    def setting(self) -> str:
        """``floor`` or e.g. ``s0.1-e8`` / ``s0.5-einf``."""
        if self.epsilon is None:
            return FLOOR
        return f"s{self.strong:g}-e{self.epsilon:g}"

    @property
    def name(self) -> str:
        """Run folder name, e.g. ``rotten_tomatoes-iid-s0.1-e8-seed0``."""
        return f"{self.data}-{self.partition}-{self.setting}-seed{self.seed}"


@dataclass(frozen=True)
class Grid:
    """A study grid (every run has ``train_rounds + 2`` rounds after profiling).

    Attributes:
        data: Data sets with their clients and strong fractions.
        partitions: Code distributions (keys of :data:`PARTITIONS`).
        epsilons: ``epsilon_train`` values (``math.inf``: no noise, no clipping).
        seeds: Run seeds (each fixes partition, roles, noise, sampling).
        settings: When set, only these (strong, ε) settings (a subset of the product).
        groups: When set, only these (data set, distribution) groups, each with its own
            settings (``None``: ``settings``), in this order; otherwise every data set with
            every distribution.
        test_rows: Real held-out rows (``task.max_test``).
        train_rounds: Fine-tuning rounds ``R``.
        steps: DP-SGD steps per round.
        batch_size: Expected Poisson batch of DP-SGD.
        num_samples: Synthetic samples ``s``.
        max_new_tokens: Tokens per generated review.
        max_length: Tokens per training row (prompt and review).
        k: Votes per private sample.
        clf_steps: Adam steps of the small downstream text classifier.
        task: Fields replacing the preset's ``task`` fields (e.g. a tiny model in tests).
        algo: Fields replacing the preset's ``algo`` fields (e.g. a small embedder in tests).
        label: Which grid it is, for the report's title.
    """

    data: tuple[Data, ...]
    partitions: tuple[str, ...] = ("iid", "noniid")
    epsilons: tuple[float, ...] = (1.0, 8.0, math.inf)
    seeds: tuple[int, ...] = (0,)
    settings: tuple[tuple[float, float], ...] | None = None
    groups: tuple[tuple[str, str, tuple[tuple[float, float], ...] | None], ...] | None = None
    test_rows: int = 200
    train_rounds: int = 3
    steps: int = 10
    batch_size: int = 8
    num_samples: int = 200
    max_new_tokens: int = 32
    max_length: int = 64
    k: int = 4
    clf_steps: int = 200
    task: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    algo: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    label: str = "full grid"

    def cells(self) -> list[Cell]:
        """Every run: per (seed, data set, distribution) the floor first, then the settings
        (in ``settings``' order when given, so a grid cut short has run the first ones)."""
        out: list[Cell] = []
        for seed in self.seeds:
            for d, part, settings in self._groups():
                pairs = [(s, e) for s in d.strong for e in self.epsilons]
                if settings is not None:
                    pairs = [p for p in settings if p in pairs]
                out.append(Cell(d.name, part, seed, min(d.strong), None))
                out += [Cell(d.name, part, seed, s, e) for s, e in pairs]
        return out

    def _groups(self) -> list[tuple[Data, str, tuple[tuple[float, float], ...] | None]]:
        if self.groups is None:
            return [(d, part, self.settings) for d in self.data for part in self.partitions]
        return [(self.spec(name), part, st) for name, part, st in self.groups]

    def pairs(self) -> list[tuple[Data, str]]:
        """The (data set, distribution) groups of the grid, in run order."""
        return [(d, part) for d, part, _ in self._groups()]

    def spec(self, name: str) -> Data:
        """The :class:`Data` of source ``name``."""
        return next(d for d in self.data if d.name == name)


# Sized for about 20 minutes on 2 idle cores from one profiled run (docs/dpsyn.md: time by stage):
# Rotten Tomatoes, IID, 10 clients of 100 reviews; 1 strong client (10 %) at ε = 8, ∞ and 1,
# 5 strong clients (50 %) at ε = 8; plus the floor run (which also computes the ceiling). Then
# the same 10 % at ε = 8 (and its floor) on non-IID Rotten Tomatoes and on IID drugs.com
# reviews, so that voting and fine-tuning are seen on both data sets and both distributions.
QUICK = Grid(
    data=(
        Data("rotten_tomatoes", clients=10, rows=100, strong=(0.1, 0.5)),
        Data("drug_reviews", clients=10, rows=100, strong=(0.1,)),
    ),
    partitions=("iid", "noniid"),
    epsilons=(1.0, 8.0, math.inf),
    groups=(
        ("rotten_tomatoes", "iid", ((0.1, 8.0), (0.1, math.inf), (0.5, 8.0), (0.1, 1.0))),
        ("rotten_tomatoes", "noniid", ((0.1, 8.0),)),
        ("drug_reviews", "iid", ((0.1, 8.0),)),
    ),
    label="quick grid",
)
FULL = Grid(
    data=(
        Data("rotten_tomatoes", clients=20, rows=50, strong=(0.05, 0.1, 0.5)),
        Data("drug_reviews", clients=10, rows=None, strong=(0.1, 0.5)),
    ),
)


def job_config(grid: Grid, cell: Cell) -> dict[str, Any]:
    """The run config of one cell (its data set's preset with the grid's sizes)."""
    spec = grid.spec(cell.data)
    cfg = preset(PRESETS[cell.data])
    rounds = 0 if cell.epsilon is None else grid.train_rounds
    cfg.update(seed=cell.seed, rounds=rounds + 2, plots=False, eval_every=1, eval_before=False)
    algo = cfg["algo"]
    algo.update(
        train_rounds=rounds,
        num_samples=grid.num_samples,
        k=grid.k,
        physical_batch_size=grid.batch_size,
        eval={"clf_steps": grid.clf_steps, "references": cell.epsilon is None, "floor": False},
    )
    algo["epsilon_train"] = (
        "inf" if cell.epsilon is None or math.isinf(cell.epsilon) else cell.epsilon
    )
    algo["generation"]["max_new_tokens"] = grid.max_new_tokens
    task = cfg["task"]
    task["max_train"] = None if spec.rows is None else spec.rows * spec.clients
    task["max_test"] = grid.test_rows
    task["prompt"] = {"max_length": grid.max_length, "max_prompt_length": grid.max_length // 2}
    cfg["partition"] = {**PARTITIONS[cell.partition], "num_clients": spec.clients}
    cfg["clients"] = {"roles": {"strong": cell.strong}}
    cfg["train"].update(steps=grid.steps, batch_size=grid.batch_size)
    cfg["task"], cfg["algo"] = merge(task, grid.task), merge(algo, grid.algo)
    return cfg


def jobs(ctx: Context[Grid]) -> list[Run]:
    """Every cell, floor first per group (:meth:`Grid.cells`)."""
    return [Run(c.name, job_config(ctx.grid, c), group=c.setting) for c in ctx.grid.cells()]


# ----------------------------------------------------------------------------- reading runs


@dataclass
class RunResult:
    """What the report reads of one finished run.

    Attributes:
        cell: The cell.
        rows: ``metrics.jsonl`` by round.
        items: Per-test-row predictions by set (``gen``, ``vote``, ``real``).
        summary: ``summary.json``.
        privacy: ``privacy.json``.
        config: ``config.yaml`` (every default filled in).
    """

    cell: Cell
    rows: dict[int, dict[str, Any]]
    items: dict[str, list[dict[str, Any]]]
    summary: dict[str, Any]
    privacy: dict[str, Any]
    config: dict[str, Any]

    @property
    def train_rounds(self) -> int:
        """``R``."""
        return int(self.config["algo"]["train_rounds"])

    @property
    def steps(self) -> int:
        """DP-SGD steps per round."""
        return int(self.config["train"]["steps"])

    @property
    def num_samples(self) -> int:
        """Synthetic samples ``s``."""
        return int(self.config["algo"]["num_samples"])

    @property
    def strong_clients(self) -> int:
        """Clients with the strong role (as :func:`fedfm.core.federation.assign_roles`)."""
        return math.floor(
            float(self.config["clients"]["roles"]["strong"])
            * int(self.config["partition"]["num_clients"])
        )

    @property
    def gen(self) -> dict[str, Any]:
        """The row of the generated set (without voting)."""
        return self.rows.get(self.train_rounds + 1, {})

    @property
    def vote(self) -> dict[str, Any]:
        """The row of the voted set (with voting)."""
        return self.rows.get(self.train_rounds + 2, {})

    def stage_seconds(self) -> dict[str, float]:
        """Wall seconds of profiling, fine-tuning, generation (+ evaluation), voting (+ eval)."""
        r = self.train_rounds
        return {
            "profile": float(self.rows.get(0, {}).get("time_s", 0.0)),
            "train": sum(float(self.rows.get(i, {}).get("time_s", 0.0)) for i in range(1, r + 1)),
            "generate": float(self.gen.get("time_s", 0.0)),
            "vote": float(self.vote.get("time_s", 0.0)),
        }

    @property
    def wall_s(self) -> float:
        """Wall seconds summed over the run's rounds."""
        return sum(self.stage_seconds().values())


def read_run(view: RunView, cell: Cell) -> RunResult | None:
    """The run's logs, items, summary and ledger (``None`` when it has not finished)."""
    s = view.summary
    if s is None or len(view.rounds) < int(s["rounds"]) + 1:
        return None
    items: dict[str, list[dict[str, Any]]] = {}
    for rnd in sorted(view.rounds):
        for it in view.items(rnd):
            items.setdefault(str(it["set"]), []).append(it)
    return RunResult(cell, view.rounds, items, s, view.privacy, view.config)


def read(ctx: Context[Grid]) -> dict[str, RunResult]:
    """Every finished run of the grid, by run name."""
    res: dict[str, RunResult] = {}
    for cell in ctx.grid.cells():
        r = read_run(ctx.run(cell.name), cell)
        if r is not None:
            res[cell.name] = r
    return res


# ----------------------------------------------------------------------------- statistics


def _correct(items: Sequence[Mapping[str, Any]], clf: str) -> dict[int, float]:
    return {int(it["id"]): float(int(it[clf]) == int(it["y"])) for it in items if clf in it}


def acc_diff(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], clf: str) -> Estimate:
    """Accuracy of ``a`` minus that of ``b`` over their shared test rows, with the paired SE
    (sd / √n of the per-row differences of correctness)."""
    return paired(_correct(a, clf), _correct(b, clf))


def f1_diff(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], clf: str, seed: int = 0
) -> Estimate:
    """Macro-F1 of ``a`` minus that of ``b`` over their shared test rows, with the SE of a
    paired bootstrap of the rows (:func:`fedfm.reproduce.stats.macro_f1_diff`)."""
    pa = {int(it["id"]): (int(it[clf]), int(it["y"])) for it in a if clf in it}
    pb = {int(it["id"]): int(it[clf]) for it in b if clf in it}
    ids = sorted(set(pa) & set(pb))
    y, xa, xb = [pa[i][1] for i in ids], [pa[i][0] for i in ids], [pb[i] for i in ids]
    return macro_f1_diff(y, xa, xb, seed)


def macro_f1_of(items: Sequence[Mapping[str, Any]], clf: str) -> float:
    """Macro-F1 of one set's predictions (as the run computed it)."""
    import torch

    from fedfm.tasks.base import macro_f1

    got = [(int(it[clf]), int(it["y"])) for it in items if clf in it]
    return macro_f1(torch.tensor([p for p, _ in got]), torch.tensor([t for _, t in got]))


# ----------------------------------------------------------------------------- the report


def _eps(x: Any) -> str:
    if x is None:
        return "—"
    return "∞" if not math.isfinite(float(x)) else f"{float(x):.2f}"


def _eps_name(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:g}"


def _setting(cell: Cell, spec: Data) -> str:
    if cell.epsilon is None:
        return "base model (floor)"
    strong = math.floor(cell.strong * spec.clients)
    eps = "∞" if math.isinf(cell.epsilon) else f"{cell.epsilon:g}"
    return f"{100 * cell.strong:g}% strong ({strong}), ε_train {eps}"


def _metric_row(name: str, label: str, vals: Mapping[str, Any], prefix: str, last: Any) -> str:
    return row([f"`{name}`", label, *(num(vals.get(f"{prefix}{m}")) for m, _, _ in METRICS), last])


def _results_table(grid: Grid, res: Mapping[str, RunResult], data: str, part: str) -> list[str]:
    lines = head(["run", "set", *[lab for _, lab, _ in METRICS], "distinct samples"])
    spec = grid.spec(data)
    for cell in grid.cells():
        if (cell.data, cell.partition) != (data, part) or cell.name not in res:
            continue
        r = res[cell.name]
        if cell.epsilon is None and "real/acc" in r.gen:
            n_real = int(r.gen.get("real/n", 0))
            label = f"real training rows (ceiling, {n_real})"
            lines.append(_metric_row(cell.name, label, r.gen, "real/", "—"))
        label = _setting(cell, spec)
        synthetic, kept = int(r.gen["synthetic"]), int(r.vote["distinct_kept"])
        lines.append(_metric_row(cell.name, f"{label}: generated", r.gen, "", synthetic))
        lines.append(_metric_row(cell.name, f"{label}: after voting", r.vote, "", kept))
    return lines


Comparison = tuple[str, str, Any, Any]


def comparisons(grid: Grid, res: Mapping[str, RunResult]) -> list[Comparison]:
    """The differences the report states: (group, comparison, items of a, items of b).

    Per (data set, distribution, seed): voting in each run (after − before); DP (ε − ∞ at
    the same strong share, without voting); more strong clients (largest − smallest share at
    ε 8); the paper's two claims (fewest strong with voting − most strong without, at ε 8;
    ε 8 with voting − ε ∞ without, at the smallest share); fine-tuning over the floor.
    """
    out: list[Comparison] = []
    for d, part in grid.pairs():
        for seed in grid.seeds:
            out += _group(grid, res, d, part, seed)
    return out


def _group(
    grid: Grid, res: Mapping[str, RunResult], d: Data, part: str, seed: int
) -> list[Comparison]:
    group = f"{NAMES[d.name]}, {part}, seed {seed}"

    def get(strong: float, eps: float | None) -> RunResult | None:
        return res.get(Cell(d.name, part, seed, strong, eps).name)

    def gen(r: RunResult) -> Any:
        return r.items.get("gen")

    def vote(r: RunResult) -> Any:
        return r.items.get("vote")

    lo, hi = min(d.strong), max(d.strong)
    cells = [c for c in grid.cells() if (c.data, c.partition, c.seed) == (d.name, part, seed)]
    runs = [(c, res[c.name]) for c in cells if c.name in res]
    out: list[Comparison] = [(group, f"voting: {_setting(c, d)}", vote(r), gen(r)) for c, r in runs]
    for strong in d.strong:
        inf = get(strong, math.inf)
        for eps in (e for e in grid.epsilons if math.isfinite(e)):
            r = get(strong, eps)
            if r is not None and inf is not None:
                label = f"DP: ε {eps:g} − ε ∞, {100 * strong:g}% strong, generated"
                out.append((group, label, gen(r), gen(inf)))
    a, b = get(hi, 8.0), get(lo, 8.0)
    if a is not None and b is not None and hi != lo:
        label = f"strong share: {100 * hi:g}% − {100 * lo:g}%, ε 8, generated"
        out.append((group, label, gen(a), gen(b)))
        label = f"paper claim 1: {100 * lo:g}% + voting − {100 * hi:g}% without, ε 8"
        out.append((group, label, vote(b), gen(a)))
    a, b = get(lo, 8.0), get(lo, math.inf)
    if a is not None and b is not None:
        label = f"paper claim 2: ε 8 + voting − ε ∞ without, {100 * lo:g}% strong"
        out.append((group, label, vote(a), gen(b)))
    floor = get(lo, None)
    if floor is not None:
        for c, r in runs:
            if c.epsilon is not None:
                label = f"fine-tuning: {_setting(c, d)} − floor, generated"
                out.append((group, label, gen(r), gen(floor)))
    return out


def _diff_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    lines = head(["group", "comparison", "Δ logreg acc", "Δ logreg F1", "Δ clf acc", "Δ clf F1"])
    for group, label, a, b in comparisons(grid, res):
        if not a or not b:
            continue
        cells = []
        for clf, _ in CLASSIFIERS:
            cells += [marked(acc_diff(a, b, clf)), marked(f1_diff(a, b, clf))]
        lines.append(row([group, label, *cells]))
    return lines


def _seed_table(grid: Grid, res: Mapping[str, RunResult]) -> list[str]:
    """Voting's effect paired over seeds (only with two seeds or more)."""
    if len(grid.seeds) < 2:
        return []
    lines = [
        "### Voting over seeds",
        "",
        "Mean over seeds of (after − before voting), ± the paired SE over seeds.",
        "",
        *head(
            "data set | distribution | setting | Δ logreg acc | Δ logreg F1 | Δ clf acc | Δ clf F1"
        ),
    ]
    keys = {(c.data, c.partition, c.strong, c.epsilon) for c in grid.cells()}
    for data, part, strong, eps in sorted(keys, key=lambda k: (k[0], k[1], k[2], k[3] or -1.0)):
        runs = {s: res.get(Cell(data, part, s, strong, eps).name) for s in grid.seeds}
        cells = []
        for m in ("acc", "macro_f1", "clf/acc", "clf/macro_f1"):
            after = {s: float(r.vote[m]) for s, r in runs.items() if r is not None and m in r.vote}
            before = {s: float(r.gen[m]) for s, r in runs.items() if r is not None and m in r.gen}
            cells.append(paired(after, before).fmt(signed=True))
        setting = _setting(Cell(data, part, 0, strong, eps), grid.spec(data))
        lines.append(row([NAMES[data], part, setting, *cells]))
    return [*lines, ""]


def _privacy_table(res: Mapping[str, RunResult]) -> list[str]:
    header = (
        "run | σ DP-SGD | ε DP-SGD | ε profiling | ε voting"
        " | ε strong (DP-SGD + profiling) | ε weak (profiling + voting) | voters"
    )
    lines = head(header)
    for name, r in res.items():
        fin = r.summary.get("finish", {})
        mech = {k: v["epsilon_max"] for k, v in r.privacy.get("mechanisms", {}).items()}
        sigmas = [e["sigma"] for e in r.privacy.get("entries", []) if e.get("kind") == "dp-sgd"]
        sgd = mech.get("dp-sgd:train")
        cells = [
            num(max(sigmas), 3) if sigmas else "—",
            _eps(sgd),
            _eps(mech.get("analytic-gaussian:profile")),
            _eps(mech.get("analytic-gaussian:vote")),
            _eps(fin.get("epsilon/strong")),
            _eps(fin.get("epsilon/weak")),
            str(int(r.vote.get("voters", 0))),
        ]
        lines.append(row([f"`{name}`", *cells]))
    return lines


def _budget_table(res: Mapping[str, RunResult]) -> list[str]:
    header = (
        "run | MB up | MB down | profile s | fine-tuning s | generation + eval s"
        " | (generation s) | voting + eval s | (clients' votes s) | total s"
    )
    lines = head(header)
    for name, r in res.items():
        st = r.stage_seconds()
        cells = [
            num(r.summary.get("bytes_up", 0) / 1e6, 2),
            num(r.summary.get("bytes_down", 0) / 1e6, 2),
            num(st["profile"], 1),
            num(st["train"], 0),
            num(st["generate"], 0),
            num(r.gen.get("time/generate_s"), 0),
            num(st["vote"], 0),
            num(r.vote.get("time/vote_clients_s"), 0),
            num(r.wall_s, 0),
        ]
        lines.append(row([f"`{name}`", *cells]))
    return lines


def estimate_seconds(grid: Grid, res: Mapping[str, RunResult]) -> float | None:
    """An estimate of ``grid``'s wall time from measured runs (``None`` without any).

    Fine-tuning: the measured seconds per strong-client DP-SGD step (mean over the runs that
    fine-tuned) times each cell's strong clients × rounds × steps; generation (with its
    evaluation): the measured mean seconds per synthetic sample times the cell's samples;
    voting (with its evaluation): the measured mean seconds per voter times its weak clients.
    """
    trained = [r for r in res.values() if r.train_rounds > 0 and r.strong_clients > 0]
    if not trained:
        return None
    per_step = float(
        np.mean(
            [
                r.stage_seconds()["train"] / (r.strong_clients * r.train_rounds * r.steps)
                for r in trained
            ]
        )
    )
    per_sample = float(
        np.mean([r.stage_seconds()["generate"] / max(r.num_samples, 1) for r in res.values()])
    )
    per_voter = float(
        np.mean(
            [r.stage_seconds()["vote"] / max(int(r.vote.get("voters", 0)), 1) for r in res.values()]
        )
    )
    total = 0.0
    for cell in grid.cells():
        spec = grid.spec(cell.data)
        strong = math.floor(cell.strong * spec.clients)
        if cell.epsilon is not None:
            total += per_step * strong * grid.train_rounds * grid.steps
        total += per_sample * grid.num_samples + per_voter * (spec.clients - strong)
    return total


PAPER_FINDINGS = (
    "IID Yelp, ε = 8: 1% strong clients with voting reach accuracy 0.6149, about that of 10% "
    "strong without voting (0.6280); 20% strong with voting (F1 0.6285) beat 40% strong "
    "without (0.6168); at 1% strong, voting raises the rating F1 by about 0.20.",
    "IID PubMed, ε = 8: 5% strong with voting (0.8028) beat 20% strong without DP (0.7968); "
    "voting brings DP results to or above the non-DP baseline.",
    "Non-IID (10% strong): on some Yelp splits ε = 8 with voting beats ε = ∞ without; on "
    "PubMed, ε = ∞ is below ε = 8 under strong skew (clipping and noise as a regulariser).",
)


def _setup_lines(grid: Grid) -> list[str]:
    from fedfm.config import load_config
    from fedfm.engine import resolve

    cell = next((c for c in grid.cells() if c.epsilon is not None), grid.cells()[0])
    run_cfg = load_config(job_config(grid, cell))
    algo, task = resolve(run_cfg)  # every default filled in
    a, t = algo.model_dump(), task.model_dump()
    lines = [
        f"- Generator: {t['lm']} (bfloat16 autocast: {t['autocast_bf16']}), LoRA r = "
        f"{t['lora']['r']} on {', '.join(t['lora']['target_modules'])}; {grid.train_rounds} "
        f"rounds × {grid.steps} DP-SGD steps (expected Poisson batch {grid.batch_size}, "
        f"clipping {a['max_grad_norm']:g}, {run_cfg.train.optimizer} lr {run_cfg.train.lr:g}), "
        f"server optimizer {a['server_opt']['name']}; training rows of at most "
        f"{grid.max_length} tokens.",
        f"- Generation: s = {grid.num_samples} samples allotted by the noisy profile, "
        f"temperature {a['generation']['temperature']:g}, top-p {a['generation']['top_p']:g}, "
        f"{grid.max_new_tokens} new tokens. Voting: {a['embedder']} embeddings, K = {grid.k}, "
        f"threshold {a['vote_threshold']:g}, {a['selection']} within each code.",
        f"- Privacy: ε_profile = {a['epsilon_profile']:g}, ε_vote = {a['epsilon_vote']:g}, "
        f"δ = {run_cfg.privacy.delta:g} for every mechanism, {run_cfg.privacy.accountant} "
        "accountant (it reports an analytic Gaussian calibrated for ε = 1 as about 1.1).",
        f"- Evaluation: {grid.test_rows} real held-out rows per data set; logistic "
        f"regression (C = {a['eval']['logreg_c']:g}) on {a['eval']['embedder'] or a['embedder']} "
        f"embeddings and the small text classifier ({a['eval']['clf_steps']} Adam steps), both "
        "trained on the synthetic set alone.",
        f"- Seeds: {', '.join(map(str, grid.seeds))}.",
    ]
    for d in grid.data:
        rows = "all" if d.rows is None else str(d.rows)
        parts = [part for dd, part in grid.pairs() if dd.name == d.name]
        lines.append(
            f"- {NAMES[d.name]}: {d.clients} clients, {rows} training rows each, strong "
            f"fractions {', '.join(f'{100 * s:g}%' for s in d.strong)} "
            f"({', '.join(str(math.floor(s * d.clients)) for s in d.strong)} clients); "
            f"code distributions {', '.join(parts)}"
            + (
                f" (non-IID: Dirichlet α = {PARTITIONS['noniid']['alpha']:g} over the label)."
                if "noniid" in parts
                else "."
            )
        )
    return lines


def _diff(
    res: Mapping[str, RunResult],
    cell: Cell,
    a: tuple[float, float | None, str],
    b: tuple[float, float | None, str],
) -> Estimate:
    """Logistic-regression accuracy of one set minus another's, paired over test rows.

    ``a`` and ``b`` are (strong share, ε_train or None for the floor, ``gen`` or ``vote``)
    in the group of ``cell`` (its data set, distribution and seed).
    """
    ra, rb = (res.get(dataclasses.replace(cell, strong=x[0], epsilon=x[1]).name) for x in (a, b))
    if a == b or ra is None or rb is None or a[2] not in ra.items or b[2] not in rb.items:
        return NONE
    return acc_diff(ra.items[a[2]], rb.items[b[2]], "logreg")


ONE_SEED = (
    "One seed: the SE covers the test rows, not another draw of the DP noise, sampling or"
    " generation."
)
DUPLICATES = (
    "Voting resamples s of s with replacement, which keeps at most about 63% distinct samples"
    " even under uniform votes; without a duplication-matched control the change cannot be"
    " credited to the votes."
)


def readouts(grid: Grid) -> list[Readout[dict[str, RunResult]]]:
    """Voting, more strong clients (the premise of claim 1), the paper's two claims, and the
    control this grid lacks; on the first group of the grid, logistic-regression accuracy."""
    d, part = grid.pairs()[0]
    lo, hi = min(d.strong), max(d.strong)
    cell = Cell(d.name, part, grid.seeds[0], lo, 8.0)
    where = f"{NAMES[d.name]}, {part}, ε 8"
    return [
        Readout(
            f"voting − no voting, {100 * lo:g}% strong, {where}",
            "paired over test rows",
            "voting raises downstream scores (Yelp, 1% strong: about +0.20 F1)",
            +1,
            lambda r: _diff(r, cell, (lo, 8.0, "vote"), (lo, 8.0, "gen")),
            scope=f"{DUPLICATES} {ONE_SEED}",
        ),
        Readout(
            "voted − a uniform draw with replacement (the duplication-matched control)",
            "—",
            "the votes select better samples",
            +1,
            lambda r: NONE,
            scope="This grid keeps no generated pool to redraw from, so it has no such control.",
            testable=False,
        ),
        Readout(
            f"{100 * hi:g}% − {100 * lo:g}% strong without voting, {where}",
            "paired over test rows",
            "more strong clients help (the premise of claim 1; Yelp 10% strong: 0.6280)",
            +1,
            lambda r: _diff(r, cell, (hi, 8.0, "gen"), (lo, 8.0, "gen")),
            scope=ONE_SEED,
        ),
        Readout(
            f"{100 * lo:g}% strong with voting − {100 * hi:g}% without, {where}",
            "paired over test rows",
            "few strong clients with voting reach many without (Yelp 0.6149 vs 0.6280)",
            +1,
            lambda r: _diff(r, cell, (lo, 8.0, "vote"), (hi, 8.0, "gen")),
            scope=f"Meaningful only where the premise (the row above) holds. {ONE_SEED}",
        ),
        Readout(
            f"ε 8 with voting − ε ∞ without, {100 * lo:g}% strong, {NAMES[d.name]}, {part}",
            "paired over test rows",
            "on some non-IID splits ε 8 with voting beats ε ∞ without",
            +1,
            lambda r: _diff(r, cell, (lo, 8.0, "vote"), (lo, math.inf, "gen")),
            scope=f"{DUPLICATES} {ONE_SEED}",
        ),
    ]


def body(ctx: Context[Grid], res: dict[str, RunResult]) -> list[str]:
    """Setup, scores, differences, privacy, budget, the paper's findings, the full grid."""
    grid = ctx.grid
    lines = [
        '"Resource-Adaptive Federated Text Generation with Differential Privacy" (ICLR 2026, '
        "arXiv:2603.07027; `algorithm: dpsyn`, docs/dpsyn.md); "
        f"{len(res)} of {len(grid.cells())} runs finished.",
        "",
        "## Setup",
        "",
        *_setup_lines(grid),
        "",
        '"Without voting" and "with voting" are rounds R + 1 and R + 2 of the same run '
        "(the generated set, then the set resampled by the weak clients' votes).",
        "",
        "## Downstream scores on the real held-out rows",
        "",
        "Classifiers trained only on each set; `logreg`: logistic regression on MiniLM "
        "embeddings, `clf`: fedfm's small text classifier; Fréchet: distance between the "
        "set's and the held-out rows' MiniLM embeddings (lower is closer). Distinct samples: "
        "generated samples, and after voting the distinct ones the resampling kept.",
        "",
    ]
    for d, part in grid.pairs():
        lines += [f"### {NAMES[d.name]}, {part}", "", *_results_table(grid, res, d.name, part), ""]
    lines += [
        "## Differences",
        "",
        "a − b over the same held-out rows; ± the paired SE over test rows (accuracy: sd/√n of "
        "per-row correctness differences; macro-F1: SD of "
        f"{BOOTSTRAP} paired bootstrap resamples of the rows); `*`: more than 2 SE from zero. "
        "These SEs cover the test rows only, not another draw of the DP noise, sampling or "
        "generation (one seed per cell unless stated).",
        "",
        *_diff_table(grid, res),
        "",
        *_seed_table(grid, res),
        "## Privacy per run",
        "",
        "ε of each mechanism (worst client) and their composition per role (worst client of "
        "the role), from `privacy.json` and `summary.json` (`finish`); ∞ for ε_train = ∞.",
        "",
        *_privacy_table(res),
        "",
        "## Budget and wall time",
        "",
        "Bytes on the wire summed over the run (adapters down and up, counts, synthetic texts "
        "to the voters, votes); seconds per stage from `metrics.jsonl` (one thread, CPU shared "
        "with other jobs, so the times are upper bounds of an idle machine's).",
        "",
        *_budget_table(res),
        "",
        f"Summed over the runs: {sum(r.wall_s for r in res.values()) / 60:.1f} min.",
        "",
        "## The paper's findings",
        "",
        *[f"- {p}" for p in PAPER_FINDINGS],
        "",
        "Compare with the rows `voting`, `paper claim 1` and `paper claim 2` above; the "
        "data sets, model (SmolLM2-135M with LoRA instead of GPT-2 fine-tuned in full), client "
        "counts and budgets here are far smaller than the paper's.",
        "",
        *_full_grid_lines(res),
    ]
    return lines


def _full_grid_lines(res: Mapping[str, RunResult]) -> list[str]:
    est = estimate_seconds(FULL, res)
    when = (
        f"an estimate from the measured runs above (not a measurement): about "
        f"{est / 3600:.1f} h on one thread"
        if est is not None
        else "not estimated (no run fine-tuned)"
    )
    data = "; ".join(
        f"{NAMES[d.name]}: {d.clients} clients of "
        f"{'all' if d.rows is None else d.rows} rows, strong "
        f"{', '.join(f'{100 * x:g}%' for x in d.strong)}"
        for d in FULL.data
    )
    return [
        "## The full grid",
        "",
        f"`fedfm reproduce dpsyn` runs {len(FULL.cells())} runs ({data};"
        f" {' and '.join(FULL.partitions)} code distributions; ε_train ∈"
        f" {{{', '.join(_eps_name(e) for e in FULL.epsilons)}}}; a floor run per data set and"
        f" distribution; seeds {', '.join(map(str, FULL.seeds))}; the same sizes per run as"
        " above) and writes `docs/dpsyn-study.md`. Its time: "
        f"{when} (fine-tuning time per strong-client DP step, generation time per sample and"
        " voting time per voter, each the mean over these runs, times the full grid's counts;"
        " these runs shared their cores, so an idle machine takes less).",
        "",
    ]


STUDY = register(
    Study(
        name="dpsyn",
        summary="DP federated text generation: DP noise, strong share, voting",
        full=FULL,
        quick=QUICK,
        jobs=jobs,
        read=read,
        readouts=readouts,
        title=lambda ctx: f"DP federated text generation: reproduction ({ctx.grid.label})",
        body=body,
        reports=("dpsyn-study.md", "dpsyn-quick.md"),
    )
)
