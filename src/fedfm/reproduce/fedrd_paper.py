"""FedRD reproduction study.

FedRD against controls for its public rows, the paper's KD baselines and a client-side adapter on
the foundation model, over seeds and rounds.

On Fashion-MNIST (SmallCNN students, a frozen EfficientNet-Lite0 on the server) and TREC (a
fastText-style student, a frozen all-MiniLM-L6-v2), at Dirichlet label skew, seed by seed,
every method of :data:`METHODS`, and a linear probe of Lite0's features: does the teacher beat
the student? With one worker the runs share one process, so the foundation model's features
are computed once and reused by every later run on the same rows.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import numpy as np

from fedfm import plots
from fedfm.reproduce.framework import (
    Compute,
    Context,
    Job,
    Readout,
    Run,
    RunView,
    merge,
    preset,
    register,
    untestable,
)
from fedfm.reproduce.stats import Estimate, mean_se, paired
from fedfm.reproduce.tables import Text, band, head, row, save, side

TEXT = Text("fedrd_paper")


@dataclass(frozen=True)
class Method:
    """A row family: label, preset per modality, ``algo`` overrides, public rows or not."""

    label: str
    presets: Mapping[str, str]
    algo: Mapping[str, Any] = field(default_factory=dict)
    public: bool = True


ONLY = {"adapter": ("vision",), "lora": ("text",)}  # the other methods have both modalities
METHODS: dict[str, Method] = {
    key: Method(
        label,
        {mod: f"fedrd-{mod}{suffix}" for mod in ONLY.get(key, ("vision", "text"))},
        {"alpha": 0.0, "beta": 0.0} if key == "ab0" else {},
        public,
    )
    for key, label, suffix, public in (
        ("fedavg", "student FedAvg (no public rows)", "-fedavg", False),
        ("ft", "student FedAvg + public fine-tuning", "-ft", True),
        ("ab0", "FedRD, α = β = 0 (public CE only)", "", True),
        ("fedrd", "FedRD", "", True),
        ("nophi", "FedRD without φ", "-nophi", True),
        ("hint", "Fed-Hint (FitNets hints)", "-hint", True),
        ("adapter", "federated adapter on the FM (clients hold Lite0)", "-adapter", False),
        ("lora", "federated LoRA on the FM (clients hold MiniLM)", "-lora", False),
    )
}
"""Every method; FedRD is compared with each of the others, seed by seed."""


@dataclass
class Grid:
    """What the study runs.

    Attributes:
        modalities: ``vision`` and/or ``text``.
        alphas: Dirichlet concentrations.
        seeds: Seeds (each draws the training pool, the public set and the partition).
        methods: Keys of :data:`METHODS` (one without a preset for a modality is skipped).
        rounds, eval_every: Rounds per run (None: the presets'), the curves' step.
        overrides: Per modality, ``section -> {key: value}`` merged into every run's config
            (``algo`` only where the method trains on the public rows).
        probe_sizes, probe_test: Lite0 input sizes of the linear probe (empty: none), and
            its test images.
    """

    modalities: Sequence[str] = ("vision", "text")
    alphas: Sequence[float] = (0.1, 0.5)
    seeds: Sequence[int] = (0, 1, 2)
    methods: Sequence[str] = ("fedavg", "ft", "ab0", "fedrd", "nophi", "hint", "adapter")
    rounds: int | None = None
    eval_every: int = 10
    overrides: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    probe_sizes: Sequence[int] = (32, 64, 128)
    probe_test: int = 1000


FULL = Grid()
QUICK = Grid(
    modalities=("vision",),
    alphas=(0.5,),
    seeds=(0,),
    rounds=2,
    eval_every=1,
    overrides={
        "vision": {
            "task": {"max_train": 300, "max_test": 200},
            "algo": {
                "public_size": 100,
                "teacher_eval_size": 100,
                "teacher_options": {"image_size": 32},
            },
            "train": {"steps": 2},
            "partition": {"num_clients": 3, "min_size": 10},
            "clients": {"min_clients": 3},
        }
    },
    probe_sizes=(32,),
    probe_test=100,
)


class Cell(NamedTuple):
    """One run of the grid."""

    modality: str
    alpha: float
    seed: int
    method: str

    @property
    def name(self) -> str:
        """Run folder name, e.g. ``vision-a0.1-s2-fedrd``."""
        return f"{self.modality}-a{self.alpha:g}-s{self.seed}-{self.method}"


def _methods(grid: Grid, mod: str) -> list[str]:
    return [m for m in grid.methods if mod in METHODS[m].presets]


def cells(grid: Grid) -> list[Cell]:
    """Every run, seed by seed (an interrupted grid has every cell at fewer seeds)."""
    return [
        Cell(mod, a, s, m)
        for s in grid.seeds
        for mod in grid.modalities
        for a in grid.alphas
        for m in _methods(grid, mod)
    ]


def job_config(job: Cell, grid: Grid) -> dict[str, Any]:
    """The run config of one job (the adapter's ``fm_size`` is the teacher's image size)."""
    m = METHODS[job.method]
    data = preset(m.presets[job.modality])
    ov = copy.deepcopy(grid.overrides.get(job.modality, {}))
    algo_ov = ov.pop("algo", {})
    size = algo_ov.get("teacher_options", {}).get("image_size")
    if m.public:
        data["algo"] = merge(data.get("algo", {}), {**algo_ov, **m.algo})
    elif job.method == "adapter" and size is not None:
        ov = merge(ov, {"task": {"model_args": {"fm_size": size}}})
    data = merge(data, ov)
    data.update(
        seed=job.seed,
        rounds=grid.rounds or int(data.get("rounds", 40)),
        eval_every=grid.eval_every,
        eval_before=False,
        plots=False,
    )
    data["partition"] = {**data.get("partition", {}), "alpha": job.alpha}
    return data


def _first(grid: Grid, method: str, mod: str = "vision") -> dict[str, Any]:
    """The run config of ``method`` at the grid's first α and seed."""
    return job_config(Cell(mod, grid.alphas[0], grid.seeds[0], method), grid)


PROBE = "lite0-probe"


def probe(
    inputs: Mapping[str, Path], folder: Path, sizes: Sequence[int], n_train: int, n_test: int
) -> dict[str, Any]:
    """Linear-probe accuracy of EfficientNet-Lite0 features on Fashion-MNIST per input size.

    Linear-probe accuracy of EfficientNet-Lite0 features on Fashion-MNIST per input size
    (logistic regression on ``n_train`` training images, as many as the public set, scored on
    ``n_test``), and the features' seconds per 100 images.
    """
    import torch
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    from fedfm.data.sources import load_source
    from fedfm.models.vision import imagenet_preprocess, load_efficientnet_lite0

    torch.set_num_threads(1)
    src = load_source("fashion_mnist")
    assert src.train is not None and src.test is not None  # the source has both splits
    tr = src.train.shuffle(seed=0).select(range(n_train))
    te = src.test.shuffle(seed=0).select(range(n_test))

    def images(ds: Any) -> torch.Tensor:
        return torch.tensor(np.asarray(ds["image"]), dtype=torch.float32)[:, None] / 255.0

    xtr, xte = images(tr), images(te)
    ytr, yte = np.asarray(tr["label"]), np.asarray(te["label"])
    model = load_efficientnet_lite0(pretrained=True)
    out = {}
    for size in sizes:

        @torch.no_grad()
        def feats(x: torch.Tensor, size: int = size) -> np.ndarray:
            parts = [
                model.features(imagenet_preprocess(x[s : s + 100], size=size))
                for s in range(0, len(x), 100)
            ]
            return torch.cat(parts).numpy()

        t = time.perf_counter()
        ftr, fte = feats(xtr), feats(xte)
        secs = time.perf_counter() - t
        # One BLAS thread: on a shared machine L-BFGS with a thread pool is many times slower.
        with threadpool_limits(1):
            clf = LogisticRegression(max_iter=2000).fit(ftr, ytr)
        out[str(int(size))] = {
            "acc": float(clf.score(fte, yte)),
            "s_per_100": secs / (n_train + n_test) * 100,
            "n_train": n_train,
            "n_test": n_test,
        }
    return out


def jobs(ctx: Context[Grid]) -> list[Job]:
    """The Lite0 probe (when the grid has images), then every run."""
    grid = ctx.grid
    out: list[Job] = []
    if "vision" in grid.modalities and grid.probe_sizes:
        n_train = int(_first(grid, "fedrd")["algo"].get("public_size", 500))
        params = {"sizes": [int(s) for s in grid.probe_sizes], "n_train": n_train}
        out.append(Compute(PROBE, probe, {**params, "n_test": grid.probe_test}))
    return out + [Run(c.name, job_config(c, grid), group=c.method) for c in cells(grid)]


@dataclass
class RunResult:
    """What the report reads from one run.

    The ``final`` evaluated round's metrics, the test accuracy ``curve`` by round, the ``server``
    metrics (``server_*`` means over rounds, ``server_*@last``, the warm-up's ``warmup_*``) and the
    last evaluated round.
    """

    final: dict[str, float]
    curve: dict[int, float]
    server: dict[str, float]
    rounds: int


def read_run(view: RunView) -> RunResult | None:
    """The run's results, or None when it has no evaluated round yet."""
    evals = [r for r in view.metrics if "acc" in r and r.get("round", 0) > 0]
    if not evals:
        return None
    trained = [r for r in view.metrics if r.get("round", 0) >= 1]
    keys = {k for r in trained for k in r if k.startswith("server_")} - {"server_steps"}
    server = {k: float(np.mean([r[k] for r in trained if k in r])) for k in keys}
    # The last round's server metrics too: how far the public rows are fitted at the end.
    server.update({f"{k}@last": float(trained[-1][k]) for k in keys if k in trained[-1]})
    server.update({k: float(v) for k, v in trained[0].items() if k.startswith("warmup_")})
    return RunResult(
        final={k: float(v) for k, v in evals[-1].items() if isinstance(v, int | float)},
        curve={int(r["round"]): float(r["acc"]) for r in evals},
        server=server,
        rounds=int(evals[-1]["round"]),
    )


Results = dict[Cell, RunResult]


def read(ctx: Context[Grid]) -> Results:
    """Every run of the grid that has an evaluated round."""
    runs = {job: read_run(ctx.run(job.name)) for job in cells(ctx.grid)}
    return {job: r for job, r in runs.items() if r is not None}


def _seeds(
    res: Results, grid: Grid, mod: str, alpha: float, method: str, value: Callable[..., Any]
) -> dict[int, float]:
    """Seed -> ``value(run)`` of one cell (seeds whose run gives None left out)."""
    runs = {s: res.get(Cell(mod, alpha, s, method)) for s in grid.seeds}
    got = {s: value(r) for s, r in runs.items() if r is not None}
    return {s: float(v) for s, v in got.items() if v is not None}


def _rounds(grid: Grid, mod: str, method: str) -> int:
    if grid.rounds is not None:
        return grid.rounds
    return int(preset(METHODS[method].presets[mod]).get("rounds", 40))


def per_seed(res: Results, grid: Grid, mod: str, alpha: float, method: str, metric: str) -> dict:
    """Seed -> the final ``metric`` of one cell's finished runs."""
    n = _rounds(grid, mod, method)
    return _seeds(
        res, grid, mod, alpha, method, lambda r: r.final.get(metric) if r.rounds == n else None
    )


def _est(res: Results, grid: Grid, mod: str, alpha: float, method: str, metric: str) -> Estimate:
    """Mean ± SE over seeds of one cell's final ``metric``."""
    return mean_se(per_seed(res, grid, mod, alpha, method, metric))


def _curve(res: Results, grid: Grid, mod: str, alpha: float, method: str, rnd: int) -> dict:
    """Seed -> test accuracy at round ``rnd``."""
    return _seeds(res, grid, mod, alpha, method, lambda r: r.curve.get(rnd))


def results_table(grid: Grid, res: Results, mod: str) -> list[str]:
    """Mean ± SE over seeds of the final accuracy and macro-F1 per (α, method)."""
    lines = []
    for a in grid.alphas:
        for m in _methods(grid, mod):
            acc, f1, t = (_est(res, grid, mod, a, m, k) for k in ("acc", "macro_f1", "teacher/acc"))
            cells = ["yes" if METHODS[m].public else "no", acc.fmt(), f1.fmt(), t.fmt(), acc.n]
            lines.append(row([f"{a:g}", METHODS[m].label, *cells]))
    return lines


def _minus(res: Results, grid: Grid, mod: str, alpha: float, other: str, metric: str) -> Estimate:
    """FedRD − ``other`` on the final ``metric``, paired by seed."""
    mine = per_seed(res, grid, mod, alpha, "fedrd", metric)
    return paired(mine, per_seed(res, grid, mod, alpha, other, metric))


def differences(grid: Grid, res: Results, mod: str, alpha: float) -> dict[str, dict[str, Any]]:
    """FedRD minus every other method, paired by seed: accuracy and macro-F1 estimates."""
    return {
        m: {k: _minus(res, grid, mod, alpha, m, k) for k in ("acc", "macro_f1")}
        for m in _methods(grid, mod)
        if m != "fedrd"
    }


def differences_table(grid: Grid, res: Results, mod: str) -> list[str]:
    """The paired differences FedRD − method, per α."""
    lines = []
    for a in grid.alphas:
        for m, d in differences(grid, res, mod, a).items():
            acc, f1 = d["acc"], d["macro_f1"]
            cells = [acc.fmt(signed=True), f1.fmt(signed=True), acc.n]
            verdict = side(acc, "FedRD higher", "FedRD lower")
            lines.append(row([f"{a:g}", METHODS[m].label, *cells, verdict]))
    return lines


def teacher_lines(grid: Grid, res: Results, mod: str) -> list[str]:
    """FedRD's teacher-path accuracy next to the public fine-tuning control's student's."""
    lines = []
    for a in grid.alphas:
        for m in ("fedrd", "nophi"):
            if m not in _methods(grid, mod):
                continue
            t, s = _est(res, grid, mod, a, m, "teacher/acc"), _est(res, grid, mod, a, m, "acc")
            ctrl = _est(res, grid, mod, a, "ft", "acc").fmt()
            if t.n:
                values = {"alpha": f"{a:g}", "method": METHODS[m].label, "control": ctrl}
                lines.append(TEXT("teacher", values, teacher=t.fmt(), student=s.fmt()))
    return lines


def seeds_table(grid: Grid, res: Results, mod: str) -> list[str]:
    """The final test accuracy of every run, seed by seed (what the means and SEs are of)."""
    lines = head(["α", "method", *[f"seed {s}" for s in grid.seeds]])
    for a in grid.alphas:
        for m in _methods(grid, mod):
            vals = per_seed(res, grid, mod, a, m, "acc")
            cells = [f"{vals[s]:.3f}" if s in vals else "—" for s in grid.seeds]
            lines.append(row([f"{a:g}", METHODS[m].label, *cells]))
    return lines


DROP = 0.2
"""A fall of test accuracy this large between two evaluations flags a run as unstable."""


def unstable_lines(res: Results, mod: str) -> list[str]:
    """Runs of ``mod`` whose test accuracy fell by more than :data:`DROP` between evaluations."""
    lines = []
    for job, r in sorted(res.items(), key=lambda kv: kv[0].name):
        for a, b in itertools.pairwise(sorted(r.curve)):
            if job.modality == mod and r.curve[a] - r.curve[b] > DROP:
                values = {"run": job.name, "method": METHODS[job.method].label, "a": a, "b": b}
                values.update(before=f"{r.curve[a]:.3f}", after=f"{r.curve[b]:.3f}")
                lines.append(TEXT("unstable", values))
    return lines


def curve_rounds(res: Results) -> list[int]:
    """Rounds evaluated in every run that has results."""
    sets = [set(r.curve) for r in res.values()]
    return sorted(set.intersection(*sets)) if sets else []


def curves_table(grid: Grid, res: Results, mod: str) -> list[str]:
    """Mean ± SE test accuracy at each evaluated round, and FedRD − each public-row control."""
    rounds = curve_rounds(res)
    lines = head(["α", "method", *[f"round {r}" for r in rounds]])
    for a in grid.alphas:
        for m in _methods(grid, mod):
            cells = [mean_se(_curve(res, grid, mod, a, m, r)) for r in rounds]
            lines.append(row([f"{a:g}", METHODS[m].label, *[c.fmt() for c in cells]]))
        for ref in ("ft", "ab0"):
            if ref in _methods(grid, mod) and "fedrd" in _methods(grid, mod):
                diffs = [
                    paired(_curve(res, grid, mod, a, "fedrd", r), _curve(res, grid, mod, a, ref, r))
                    for r in rounds
                ]
                label = f"**FedRD − {METHODS[ref].label}** (paired)"
                lines.append(row([f"{a:g}", label, *[d.fmt(signed=True) for d in diffs]]))
    return lines


def teacher_table(grid: Grid, res: Results, mod: str) -> list[str]:
    """The server's view: the teacher path, the public-set fit and CKA, public vs test."""
    keys = [
        ("warmup_ce_t", "warm-up CE(y, z_t), mean over its steps"),
        ("server_ce_t@last", "public CE(y, z_t), last round"),
        ("server_kl@last", "public KL(z_t‖z_s), last round"),
        ("server_cka@last", "public CKA(f_t, f_s), last round"),
        ("server_hint@last", "public hint loss, last round"),
        ("server_loss@last", "server loss, last round"),
    ]
    lines = head(["α", "method", *[label for _, label in keys], "test CKA(f_t, f_s)"])
    for a in grid.alphas:
        for m in (m for m in _methods(grid, mod) if METHODS[m].public):
            cells = [
                mean_se(_seeds(res, grid, mod, a, m, lambda r, k=k: r.server.get(k))).fmt()
                for k, _ in keys
            ]
            cka = _est(res, grid, mod, a, m, "cka_test").fmt()
            lines.append(row([f"{a:g}", METHODS[m].label, *cells, cka]))
    return lines


def probe_text(probe: Mapping[str, Any] | None, grid: Grid, res: Results) -> str:
    """The Lite0 probe per input size next to the students' accuracy."""
    if not probe:
        return TEXT("probe-none")
    rows = sorted(probe.items(), key=lambda kv: int(kv[0]))
    size = _first(grid, "fedrd")["algo"].get("teacher_options", {}).get("image_size")
    size = None if size is None else int(size)
    best = max(rows, key=lambda kv: kv[1]["acc"])
    used = probe.get(str(size)) if size is not None else None
    gaps = []
    for a in grid.alphas:
        for m in (m for m in ("fedavg", "ft") if m in grid.methods):
            est = _est(res, grid, "vision", a, m, "acc")
            if est.n and used:
                values = {"alpha": f"{a:g}", "method": METHODS[m].label, "student": est.fmt()}
                values.update(probe=f"{used['acc']:.3f}", gap=f"{used['acc'] - est.mean:+.3f}")
                gaps.append(TEXT("probe-gap", values, size=size))
    cells = [[f"{s} px", f"{v['acc']:.3f}", f"{v['s_per_100']:.2f}"] for s, v in rows]
    first = {k: rows[0][1].get(k, "?") for k in ("n_train", "n_test")}
    best_ = {"best": best[0], "best_acc": f"{best[1]['acc']:.3f}", "size": size}
    return TEXT("probe-table", first, best_, rows=cells, gaps=gaps)


def setup_table(grid: Grid) -> list[str]:
    """One line per method: algorithm, data, client model, server, rounds and training."""
    lines = []
    for mod in grid.modalities:
        for m in _methods(grid, mod):
            c = _first(grid, m, mod)
            t, al, p, tr = c["task"], c.get("algo", {}), c["partition"], c["train"]
            sizes = [f"{k} {t[k]}" for k in ("max_train", "max_test") if t.get(k)]
            data = f"{t['dataset']} ({', '.join(sizes)})" if sizes else t["dataset"]
            server = "—"
            if METHODS[m].public:
                srv = al.get("server_train", {})
                fm = f"{al.get('teacher')} {al.get('teacher_options', {})}"
                fm = "no FM" if c["algorithm"] == "fedavg-ft" else fm
                # The vision public split is an algo field, the text one a task field.
                parts = [fm, f"public {al.get('public_size', t.get('public_size'))}"]
                parts += [f"{k}={al[k]}" for k in ("alpha", "beta") if al.get(k) is not None]
                if al.get("warmup_epochs"):
                    parts.append(f"warm-up {al['warmup_epochs']} epochs")
                parts.append(
                    f"{srv.get('epochs')} epoch(s)/round {srv.get('optimizer')} lr {srv.get('lr')}"
                )
                server = ", ".join(parts)
            model = f"{t.get('model')} {t.get('model_args', {})}"
            local = f"{tr.get('steps')} steps, bs {tr.get('batch_size')}, {tr.get('optimizer')}"
            clients = f"{c['rounds']}, {p.get('num_clients')} clients ({local} lr {tr.get('lr')})"
            cells = [METHODS[m].presets[mod], c["algorithm"], data, model, server, clients]
            lines.append(row([METHODS[m].label, *cells]))
    return lines


def scale_row(grid: Grid) -> str:
    """The row of the substitutions on scale, from the grid's FedRD config."""
    c = _first(grid, "fedrd")
    t, al, tr = c["task"], c["algo"], c["train"]
    values = {"clients": c["partition"].get("num_clients"), "max_train": t.get("max_train")}
    values.update(test_fraction=f"{t.get('local_test_fraction', 0.2):g}", steps=tr.get("steps"))
    values.update(rounds=c["rounds"], public=al.get("public_size"))
    return TEXT("scale-row", values, size=al.get("teacher_options", {}).get("image_size"))


def curves_figure(grid: Grid, res: Results, path: Path) -> Path | None:
    """Test accuracy over rounds, mean ± SE over seeds; a row per modality, a column per α."""
    rounds = curve_rounds(res)
    if not rounds:
        return None
    mods, alphas = list(grid.modalities), list(grid.alphas)
    palette = plots.colours(METHODS[m].label for m in grid.methods)
    size = (5.5 * len(alphas), 3.6 * len(mods))
    fig, axes = plt.subplots(len(mods), len(alphas), figsize=size, squeeze=False)
    for i, mod in enumerate(mods):
        for ax, a in zip(axes[i], alphas, strict=True):
            for m in _methods(grid, mod):
                est = [mean_se(_curve(res, grid, mod, a, m, r)) for r in rounds]
                label = METHODS[m].label
                band(ax, rounds, est, 0.15, marker="o", ms=3, label=label, color=palette[label])
            ax.set_title(f"{mod}, Dirichlet α = {a:g}")
            ax.set_xlabel("round")
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
        axes[i][0].legend(fontsize=7, loc="lower right")
    return save(fig, path, 110)


def readouts(grid: Grid) -> list[Readout[Results]]:
    """Per modality and α: FedRD against public fine-tuning and against FedRD without φ.

    The paper's other claims, untested.
    """
    fm = TEXT("scope-fm")
    claims = (
        ("ft", "the FM's distillation helps the student (beyond the public rows)"),
        ("nophi", "reprogramming beats KD without it under non-IID data"),
    )
    scopes = {"ft": TEXT("scope-ft", fm=fm), "nophi": fm}
    out: list[Readout[Results]] = [
        Readout(
            f"FedRD − {METHODS[m].label}, test accuracy, {mod}, α = {a:g}",
            "paired over seeds",
            paper,
            +1,
            partial(_minus, grid=grid, mod=mod, alpha=a, other=m, metric="acc"),
            scope=scopes[m],
        )
        for mod in grid.modalities
        for a in grid.alphas
        for m, paper in claims
        if m in _methods(grid, mod)
    ]
    return [
        *out,
        untestable(
            "FedRD − Fed-CRD, Fed-VID, SemCKD", "FedRD above the KD baselines", TEXT("scope-kd")
        ),
        untestable(
            "client memory, federated LoRA / FedRD",
            "about 70 MB against about 1,297 MB of GPU memory",
            TEXT("scope-memory"),
        ),
    ]


def results_text(grid: Grid, res: Results, mod: str) -> str:
    """One modality's results: finals, differences, curves, seeds and the server's view."""
    return TEXT(
        "results",
        modality=mod,
        teacher=teacher_lines(grid, res, mod),
        results=results_table(grid, res, mod),
        differences=differences_table(grid, res, mod),
        curves=curves_table(grid, res, mod),
        seeds=seeds_table(grid, res, mod),
        drop=f"{DROP:g}",
        unstable=unstable_lines(res, mod) or [TEXT("no-unstable")],
        server=teacher_table(grid, res, mod),
    )


def body(ctx: Context[Grid], res: Results) -> str:
    """The method, the setup, per modality the results, the probe, the substitutions."""
    grid = ctx.grid
    jobs_ = cells(grid)
    fig = curves_figure(grid, res, ctx.figures / "accuracy_over_rounds.png")
    done = sum(j in res and res[j].rounds == _rounds(grid, j.modality, j.method) for j in jobs_)
    vision = "vision" in grid.modalities
    return TEXT(
        "body",
        command=ctx.command,
        modalities=", ".join(grid.modalities),
        alphas=", ".join(f"{a:g}" for a in grid.alphas),
        seeds=", ".join(map(str, grid.seeds)),
        methods=", ".join(f"{len(_methods(grid, m))} {m}" for m in grid.modalities),
        runs=len(jobs_),
        done=done,
        eval_every=grid.eval_every,
        n_seeds=len(grid.seeds),
        quick=TEXT("quick", overrides=grid.overrides) if ctx.quick else None,
        setup=setup_table(grid),
        results="\n\n".join(results_text(grid, res, mod) for mod in grid.modalities),
        probe=TEXT("probe", probe=probe_text(ctx.run(PROBE).result, grid, res)) if vision else None,
        scale_row=scale_row(grid) if vision else None,
        text_row=TEXT("text-row") if "text" in grid.modalities else None,
        figures=None if fig is None else TEXT("figures", path=f"{ctx.figures.name}/{fig.name}"),
    )


STUDY = register(
    __name__, "FedRD vs public-row controls, FedRD without φ, Fed-Hint, FedAvg, FM adapter"
)
