"""FedRD reproduction study: accuracy and macro-F1 across methods, client memory, bytes.

``fedfm reproduce fedrd`` runs, at Dirichlet label skew α ∈ {0.1, 0.5}:

* vision (Fashion-MNIST, SmallCNN student, EfficientNet-Lite0 on the server): student FedAvg,
  federated KD without reprogramming, FedRD;
* text (TREC, fastText-style student, all-MiniLM-L6-v2 on the server): the same three, plus
  federated LoRA on MiniLM (clients hold the encoder with LoRA adapters and a head);

then measures the peak memory of one client's local training in a fresh process for FedRD
(student only) and for federated LoRA (encoder + LoRA), reads bytes per round from each run's
audit-ledger totals (``bytes_up``/``bytes_down`` in ``metrics.jsonl``), probes EfficientNet-Lite0
at several input sizes (the reason for the size the presets use), and writes ``docs/fedrd.md``
with tables and figures. ``--quick`` runs a small grid and writes its report under the output
folder, so it never replaces the committed report.

Runs go to worker processes with one torch thread each (on a shared 2-core machine two
threads per process contend and run many times slower).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedfm import plots
from fedfm.reproduce import STUDIES

# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Method:
    """One row of the study: a preset per modality."""

    label: str
    presets: dict[str, str]  # modality -> preset


METHODS: dict[str, Method] = {
    "fedavg": Method(
        "student FedAvg", {"vision": "fedrd-vision-fedavg", "text": "fedrd-text-fedavg"}
    ),
    "kd": Method(
        "federated KD, no reprogramming", {"vision": "fedrd-vision-kd", "text": "fedrd-text-kd"}
    ),
    "fedrd": Method("FedRD", {"vision": "fedrd-vision", "text": "fedrd-text"}),
    "lora": Method("federated LoRA on the FM", {"text": "fedrd-text-lora"}),
}


@dataclass
class Grid:
    """What the study runs.

    Attributes:
        modalities: ``vision`` and/or ``text``.
        alphas: Dirichlet concentrations.
        methods: Keys of :data:`METHODS` (a method without a preset for a modality is skipped).
        seed: Run seed (also draws the partition: every method sees the same clients).
        rounds: Rounds per run (None: the presets').
        eval_every: Evaluate every this many rounds (and after the last).
        overrides: ``key=value`` overrides per modality (e.g. smaller sets for --quick).
        memory: Measure client memory.
        memory_repeats: Repeats of each memory measurement (medians are reported).
        probe_sizes: EfficientNet-Lite0 input sizes to probe (empty: skip).
        workers: Parallel worker processes (one torch thread each).
    """

    modalities: Sequence[str] = ("vision", "text")
    alphas: Sequence[float] = (0.1, 0.5)
    methods: Sequence[str] = tuple(METHODS)
    seed: int = 0
    rounds: int | None = None
    eval_every: int = 1
    overrides: dict[str, list[str]] = field(default_factory=dict)
    memory: bool = True
    memory_repeats: int = 3
    probe_sizes: Sequence[int] = (32, 64, 96)
    workers: int = 2


FULL = Grid(eval_every=5)
QUICK = Grid(
    rounds=2,
    eval_every=2,
    overrides={
        "vision": [
            "task.max_train=1000",
            "algo.public_size=200",
            "algo.teacher_eval_size=200",
            "train.steps=10",
        ],
        "text": [
            "task.max_train=1200",
            "task.max_test=150",
            "task.public_size=100",
            "algo.teacher_eval_size=150",
            "train.steps=4",
            "clients.fraction=0.2",
            "clients.min_clients=2",
        ],
    },
    probe_sizes=(),
    memory_repeats=1,
)


@dataclass(frozen=True)
class Job:
    """One run of the grid."""

    modality: str
    alpha: float
    method: str

    @property
    def name(self) -> str:
        return f"{self.modality}-a{self.alpha:g}-{self.method}"

    @property
    def preset(self) -> str:
        return METHODS[self.method].presets[self.modality]


def jobs_of(grid: Grid) -> list[Job]:
    """Every run; LoRA runs (the slowest) first so the two workers finish together."""
    jobs = [
        Job(mod, a, m)
        for mod in grid.modalities
        for a in grid.alphas
        for m in grid.methods
        if mod in METHODS[m].presets
    ]
    return sorted(jobs, key=lambda j: (j.method != "lora", j.modality != "vision"))


def job_overrides(job: Job, grid: Grid, out: Path) -> list[str]:
    """``key=value`` overrides of one run: α, seed, study settings."""
    ov = [
        f"name={job.name}",
        f"seed={grid.seed}",
        f"partition.alpha={job.alpha}",
        f"out_dir={out}",
        f"eval_every={grid.eval_every}",
        "eval_before=false",
        "plots=false",
        "threads=1",
    ]
    if grid.rounds is not None:
        ov.append(f"rounds={grid.rounds}")
    return ov + applicable(job.preset, grid.overrides.get(job.modality, []))


def applicable(preset: str, overrides: Sequence[str]) -> list[str]:
    """The overrides that apply to a preset: ``algo.*`` keys only where its algorithm is
    FedRD or the KD baseline (the others have no public set or teacher)."""
    from fedfm.config import load_config

    server_kd = load_config(preset).algorithm in ("fedrd", "fedrd-kd")
    return [o for o in overrides if server_kd or not o.startswith("algo.")]


def run_job(args: tuple[str, list[str]]) -> tuple[str, str | None, float]:
    """Runs one preset with overrides (in a worker); returns (name, error or None, seconds)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import fedfm.algorithms.fedrd
    import fedfm.tasks.text  # noqa: F401  (registers the text task)
    from fedfm.config import load_config
    from fedfm.runtime import run

    preset, overrides = args
    t = time.perf_counter()
    cfg = load_config(preset, overrides)
    try:
        run(cfg, overwrite=True, progress=False)
        return cfg.name, None, time.perf_counter() - t
    except Exception as e:  # a failed run is reported in the study, not fatal to it
        return cfg.name, f"{type(e).__name__}: {e}", time.perf_counter() - t


# ----------------------------------------------------------------------------- client memory


MEMORY_PAIRS: dict[str, str] = {
    "FedRD client (text student)": "fedrd-text",
    "federated LoRA client (MiniLM + LoRA)": "fedrd-text-lora",
    "FedRD client (vision student)": "fedrd-vision",
}


def memory_table(
    overrides: dict[str, list[str]] | None = None,
    modalities: Sequence[str] = ("vision", "text"),
    repeats: int = 3,
) -> dict[str, dict[str, Any]]:
    """Client memory of each entry of :data:`MEMORY_PAIRS` in ``modalities``, with the study's
    overrides that apply to its preset (:func:`fedfm.measure.memory_table`)."""
    from fedfm.measure import memory_table as measure_table

    clients = {}
    for label, preset in MEMORY_PAIRS.items():
        mod = "vision" if "vision" in preset else "text"
        if mod in modalities:
            clients[label] = (preset, applicable(preset, (overrides or {}).get(mod, [])))
    return measure_table(clients, repeats)


# ----------------------------------------------------------------------------- Lite0 size probe


def lite0_probe(
    sizes: Sequence[int], n_train: int = 800, n_test: int = 500, seed: int = 0
) -> dict[int, dict[str, float]]:
    """Linear-probe accuracy of EfficientNet-Lite0 features on Fashion-MNIST per input size.

    Logistic regression (scikit-learn) on pooled features of ``n_train`` training images,
    scored on ``n_test`` test images; also the seconds per 100 images for the features.
    """
    import torch
    from sklearn.linear_model import LogisticRegression

    from fedfm.data.sources import load_source
    from fedfm.models.vision import imagenet_preprocess, load_efficientnet_lite0

    torch.set_num_threads(1)
    src = load_source("fashion_mnist")
    tr = src.train.shuffle(seed=seed).select(range(n_train))
    te = src.test.shuffle(seed=seed).select(range(n_test))

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
        clf = LogisticRegression(max_iter=2000).fit(ftr, ytr)
        out[int(size)] = {
            "acc": float(clf.score(fte, yte)),
            "s_per_100": secs / (n_train + n_test) * 100,
        }
    return out


def _probe_job(args: tuple[Sequence[int]]) -> tuple[str, Any, float]:
    t = time.perf_counter()
    try:
        return "probe", lite0_probe(args[0]), time.perf_counter() - t
    except Exception as e:
        return "probe", f"{type(e).__name__}: {e}", time.perf_counter() - t


def _dispatch(job: tuple[str, Any]) -> tuple[str, Any, float]:
    kind, args = job
    return _probe_job(args) if kind == "probe" else run_job(args)


# ----------------------------------------------------------------------------- analysis


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_stats(run: Path) -> dict[str, Any] | None:
    """Final metrics, bytes per round (mean over rounds >= 1) and the accuracy curve."""
    rows = _rows(run)
    evals = [r for r in rows if "acc" in r]
    if not evals:
        return None
    last = evals[-1]
    trained = [r for r in rows if r["round"] >= 1]
    cfg = json.loads(json.dumps(_yaml(run / "config.yaml")))
    clients = [r.get("clients", 0) for r in trained]
    return {
        "acc": last["acc"],
        "macro_f1": last["macro_f1"],
        "teacher_acc": last.get("teacher/acc"),
        "teacher_f1": last.get("teacher/macro_f1"),
        "round": last["round"],
        "up": float(np.mean([r["bytes_up"] for r in trained])) if trained else 0.0,
        "down": float(np.mean([r["bytes_down"] for r in trained])) if trained else 0.0,
        "clients": float(np.mean(clients)) if clients else 0.0,
        "time_s": float(sum(r.get("time_s", 0.0) for r in rows)),
        "cfg": cfg,
    }


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text()) if path.exists() else {}


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _results_table(grid: Grid, stats: dict[str, Any], modality: str) -> list[str]:
    head = [
        "α",
        "method",
        "acc",
        "macro-F1",
        "teacher path z_t acc",
        "MB up / round",
        "MB down / round",
        "MB up / client / round",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in grid.alphas:
        for m in grid.methods:
            if modality not in METHODS[m].presets:
                continue
            s = stats.get(Job(modality, a, m).name)
            if s is None:
                lines.append(f"| {a:g} | {METHODS[m].label} | failed | | | | | |")
                continue
            t = "—" if s["teacher_acc"] is None else f"{s['teacher_acc']:.3f}"
            per = s["up"] / s["clients"] if s["clients"] else 0.0
            lines.append(
                f"| {a:g} | {METHODS[m].label} | {s['acc']:.3f} | {s['macro_f1']:.3f} | {t} |"
                f" {_mb(s['up'])} | {_mb(s['down'])} | {_mb(per)} |"
            )
    return lines


def _memory_lines(mem: dict[str, Any]) -> list[str]:
    head = [
        "client",
        "parameters held",
        "trainable",
        "sent per round",
        "training memory (MB, anonymous RSS increase; median [range])",
        "RSS increase (MB)",
        "process peak RSS (MB)",
        "FM loaded",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, m in mem.items():
        if "error" in m:
            lines.append(f"| {label} | {m['error']} | | | | | | |")
            continue
        lines.append(
            f"| {label} | {m['params_on_client']:,} | {m['params_trainable']:,} |"
            f" {m['params_sent']:,} | {m['train_mb']:.1f} [{m['train_mb_min']:.1f}–"
            f"{m['train_mb_max']:.1f}] | {m['rss_increase_mb']:.1f} |"
            f" {m['peak_mb']:.1f} |"
            f" {'yes' if m['fm_loaded'] else 'no'} |"
        )
    return lines


def memory_ratio(mem: dict[str, Any]) -> float | None:
    """FedRD text client / federated LoRA client, training memory (anonymous RSS increase)."""
    a = mem.get("FedRD client (text student)", {})
    b = mem.get("federated LoRA client (MiniLM + LoRA)", {})
    if "train_mb" not in a or "train_mb" not in b or b["train_mb"] <= 0:
        return None
    return a["train_mb"] / b["train_mb"]


def _figures(grid: Grid, stats: dict[str, Any], mem: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    mods = list(grid.modalities)
    palette = plots.colours(METHODS[m].label for m in grid.methods)  # one colour per method
    fig, axes = plt.subplots(1, len(mods), figsize=(5.5 * len(mods), 3.6), squeeze=False)
    for ax, mod in zip(axes[0], mods, strict=True):
        meths = [m for m in grid.methods if mod in METHODS[m].presets]
        width = 0.8 / max(len(meths), 1)
        for k, m in enumerate(meths):
            accs = []
            for a in grid.alphas:
                s = stats.get(Job(mod, a, m).name)
                accs.append(s["acc"] if s else float("nan"))
            x = np.arange(len(grid.alphas)) + (k - (len(meths) - 1) / 2) * width
            ax.bar(x, accs, width, label=METHODS[m].label, color=palette[METHODS[m].label])
        ax.set_xticks(np.arange(len(grid.alphas)))
        ax.set_xticklabels([f"Dirichlet α = {a:g}" for a in grid.alphas])
        ax.set_ylabel("test accuracy (last round)")
        ax.set_title(mod)
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    paths.append(folder / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    ok = {k: v for k, v in mem.items() if "train_mb" in v}
    if ok:
        fig, ax = plt.subplots(figsize=(8, 2.8))
        labels = list(ok)
        ax.barh(labels, [ok[k]["train_mb"] for k in labels], label="training memory")
        ax.set_xscale("log")
        ax.set_xlabel("training memory of one client (MB, anonymous RSS increase; log scale)")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        paths.append(folder / "client_memory.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _observations(grid: Grid, stats: dict[str, Any]) -> list[str]:
    """Accuracy differences between FedRD and each baseline, per modality and α."""
    lines = []
    for mod in grid.modalities:
        for a in grid.alphas:
            mine = stats.get(Job(mod, a, "fedrd").name)
            if mine is None:
                continue
            parts = []
            for m in grid.methods:
                other = stats.get(Job(mod, a, m).name) if m != "fedrd" else None
                if other is not None:
                    d_acc = mine["acc"] - other["acc"]
                    d_f1 = mine["macro_f1"] - other["macro_f1"]
                    parts.append(f"vs {METHODS[m].label} {d_acc:+.3f} acc / {d_f1:+.3f} F1")
            lines.append(f"- {mod}, α = {a:g}: FedRD " + "; ".join(parts) + ".")
    return lines


def _preset_lines(grid: Grid) -> list[str]:
    lines = [
        "| preset | algorithm | data | client model | server | rounds, clients/round | local"
        " training |",
        "|---|---|---|---|---|---|---|",
    ]
    from fedfm.config import load_config

    for mod in grid.modalities:
        for m in grid.methods:
            if mod not in METHODS[m].presets:
                continue
            name = METHODS[m].presets[mod]
            ov = [o for o in applicable(name, grid.overrides.get(mod, [])) if "eval_every" not in o]
            c = load_config(name, ov + ([f"rounds={grid.rounds}"] if grid.rounds else []))
            t, al, p, tr = c.task, c.algo, c.partition, c.train
            server = "—"
            if c.algorithm.startswith("fedrd"):
                srv = al.get("server_train", {})
                pub = t.get("public_size") or al.get("public_size")
                server = (
                    f"{al.get('teacher')} {al.get('teacher_options', {})}, public {pub},"
                    f" α={al.get('alpha')}, β={al.get('beta')}, {srv.get('epochs')} epochs"
                    f" {srv.get('optimizer')} lr {srv.get('lr')}"
                )
            sizes = [f"{k} {t[k]}" for k in ("max_train", "max_test", "public_size") if t.get(k)]
            data = f"{t['dataset']} ({', '.join(sizes)})" if sizes else t["dataset"]
            n = int(p.get("num_clients", 10))
            per_round = min(n, max(c.clients.min_clients, round(c.clients.fraction * n)))
            lines.append(
                f"| {name} | {c.algorithm} | {data} | {t.get('model')} {t.get('model_args', {})} |"
                f" {server} | {c.rounds}, {per_round} of {n} |"
                f" {tr.steps} steps, bs {tr.batch_size}, {tr.optimizer} lr {tr.lr} |"
            )
    return lines


INTRO = """\
# FedRD: federated reprogramming knowledge distillation — reproduction

Method: FedRD, *A Federated Learning and Knowledge Distillation Approach* (federated
reprogramming knowledge distillation; the paper's setting: PMC-CLIP on ISIC2018).
Code: `src/fedfm/algorithms/fedrd.py` (FedRD and the KD baseline `fedrd-kd`; the other
baselines are `fedavg` presets), `src/fedfm/core/cka.py` (linear CKA),
`src/fedfm/tasks/text.py` (text task, MiniLM + LoRA classifier), this study:
`src/fedfm/reproduce/fedrd.py`, the memory benchmark: `benchmarks/client_memory.py`.
This page is written by the study; do not edit it by hand.

## The method in brief

The server holds a frozen foundation model F_t, a trainable reprogramming module φ (a
projection, two pre-norm residual MLP blocks and a projection to the student's feature
width), the shared FC head g and the global student F_s; clients hold only the student.
Each round: broadcast the student; clients train it with cross-entropy; FedAvg by n_k; then
the server co-trains φ, g and the student on a small public set with
`L = CE(y, z_s) + α·CE(y, z_t) + β·(KL(z_t ‖ z_s) + L_CKA(f_t, f_s))`,
z_t = g(φ(F_t(x))), z_s = g(F_s(x)), L_CKA = −linear CKA (widths may differ).

Choices of ours (the paper does not fix them): g *is* the student's head (it travels with
the student and clients train it too); gradients of KL and CKA reach both sides (joint
back-propagation); the server optimizer (Adam) is rebuilt every round; F_t's features on the
public set are computed once and cached (F_t is frozen and there is no augmentation, so this
is exact). The KD baseline uses the same loss with F_t's raw features fed to a separate
teacher head and to CKA (no φ). The public set is disjoint by sample id from every client's
data and from the test set (checked; an overlapping set is refused). Student FedAvg and
federated LoRA do not use the public set.
"""


def write_report(
    grid: Grid,
    out: Path,
    report: Path,
    wall_s: float,
    command: str,
    failed: dict[str, str],
    mem: dict[str, Any],
    probe: Any,
    times: dict[str, float],
) -> Path:
    """Writes the markdown report and its figure (in a folder next to it)."""
    stats = {j.name: run_stats(out / j.name) for j in jobs_of(grid)}
    stats = {k: v for k, v in stats.items() if v is not None}
    figs = _figures(grid, stats, mem, report.parent / report.stem)
    ratio = memory_ratio(mem) if mem else None
    lines = [
        INTRO,
        "## How to reproduce",
        "",
        "```",
        command,
        "```",
        "",
        f"- Runs: {len(jobs_of(grid))} ({', '.join(grid.modalities)} × α ∈"
        f" {{{', '.join(f'{a:g}' for a in grid.alphas)}}} × methods), seed {grid.seed} (the seed"
        " also draws the partition, so every method sees the same clients),"
        f" {grid.workers} worker process(es) with one torch thread each.",
        f"- Wall time: {wall_s / 60:.1f} min on {os.cpu_count()} CPU cores"
        f" ({platform.machine()}, Python {platform.python_version()}), memory measurements and"
        " the size probe included.",
        f"- Evaluation every {grid.eval_every} round(s) and after the last; metrics are those of"
        " the last round, on the server's test set (Fashion-MNIST's 10,000 test images;"
        " 500 TREC questions held out from the source).",
        *([f"- Study overrides: {grid.overrides}."] if grid.overrides else []),
        "",
        *_preset_lines(grid),
        "",
        "## Accuracy and macro-F1",
        "",
        "*teacher path z_t acc*: accuracy of g(φ(F_t(x))) (FedRD) or of the teacher head on raw"
        " F_t features (KD) on a fixed subset of the test set (its size is the preset's"
        " `teacher_eval_size`). Bytes are the audit ledger's totals per round (all clients of the"
        " round; parameters and metadata), averaged over rounds.",
        "",
    ]
    for mod in grid.modalities:
        lines += [f"### {mod}", "", *_results_table(grid, stats, mod), ""]
    lines += [
        "**Differences** (computed from the tables; one seed per cell, so a difference of a"
        " point or two is not a ranking):",
        "",
        *_observations(grid, stats),
        "",
    ]
    lines += ["## Client memory", ""]
    if mem:
        lines += [
            "Peak memory of ONE client's local training (one round: model build, received"
            " parameters, local steps, reply), each measured in its own fresh process,"
            " repeated (interleaved) and reported as the median with the range. Memory"
            " is sampled every 2 ms; *training memory* is the peak increase of the anonymous"
            " resident memory (RssAnon: tensors, activations, optimizer state, Python objects)"
            " over its value just before the client's model is built; the RSS increase adds"
            " file-backed pages (library code touched on first use, shared with every torch"
            " process). The same libraries are imported, one step of a 1-parameter model with"
            " the client's optimizer initialises torch's lazy one-time state, and the client's"
            " data are loaded before that point in every measurement. The process peak RSS"
            " includes the"
            " Python/torch/transformers runtime that both clients share.",
            "",
            *_memory_lines(mem),
            "",
        ]
        if ratio is not None:
            verdict = "meets" if ratio <= 0.1 else "misses"
            lines += [
                f"**Client memory ratio FedRD / federated LoRA: {ratio:.3f}** (target ≤ 0.1:"
                f" {verdict} it). The paper reports ~70 MB vs ~1,297 MB of GPU memory.",
                "",
            ]
    else:
        lines += ["(not measured in this grid)", ""]
    if probe:
        lines += ["## EfficientNet-Lite0 input size", ""]
        if isinstance(probe, str):
            lines += [f"Probe failed: {probe}", ""]
        else:
            lines += [
                "Fashion-MNIST images are 28×28; Lite0 was trained at 224. A linear probe"
                " (logistic regression on pooled features of 800 training images, scored on 500"
                " test images) per input size, one torch thread:",
                "",
                "| input size | probe accuracy | feature seconds / 100 images |",
                "|---|---|---|",
                *[
                    f"| {s} | {v['acc']:.3f} | {v['s_per_100']:.2f} |"
                    for s, v in sorted(probe.items(), key=lambda kv: int(kv[0]))
                ],
                "",
                "The presets use 64 px: accuracy holds there, while 224 px (Lite0's native size)"
                " has 12× the pixels of 64 px.",
                "",
            ]
    lines += ["## Figures", "", *[f"![{f.stem}]({report.stem}/{f.name})" for f in figs], ""]
    if times:
        lines += [
            "## Run times",
            "",
            "| run | seconds |",
            "|---|---|",
            *[f"| {k} | {v:.0f} |" for k, v in sorted(times.items())],
            "",
        ]
    if failed:
        lines += ["## Failed runs", "", *[f"- `{k}`: {v}" for k, v in sorted(failed.items())], ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines))
    return report


def run_study(grid: Grid, out: Path, report: Path, command: str) -> Path:
    """Runs the grid into ``out`` and writes ``report``; returns its path."""
    t0 = time.perf_counter()
    work: list[tuple[str, Any]] = [
        ("run", (j.preset, job_overrides(j, grid, out))) for j in jobs_of(grid)
    ]
    if grid.probe_sizes and "vision" in grid.modalities:
        work.insert(1, ("probe", (tuple(grid.probe_sizes),)))
    failed: dict[str, str] = {}
    times: dict[str, float] = {}
    probe: Any = None
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")  # fresh interpreters, no forked torch thread pools
    with ProcessPoolExecutor(max(1, grid.workers), mp_context=ctx) as pool:
        for name, res, secs in pool.map(_dispatch, work, chunksize=1):
            times[name] = secs
            if name == "probe":
                probe = res
            elif res is not None:
                failed[name] = res
    mem: dict[str, Any] = {}
    if grid.memory and "text" in grid.modalities:
        mem = memory_table(grid.overrides, grid.modalities, grid.memory_repeats)
    wall = time.perf_counter() - t0
    saved = {
        "grid": dataclasses.asdict(grid),
        "wall_s": wall,
        "command": command,
        "failed": failed,
        "memory": mem,
        "probe": probe,
        "times": times,
    }
    (out / "study.json").write_text(json.dumps(saved, indent=1))
    return write_report(grid, out, report, wall, command, failed, mem, probe, times)


def rerender(out: Path, report: Path) -> Path:
    """Writes the report again from a finished study's folder (its ``study.json`` and runs)."""
    d = json.loads((Path(out) / "study.json").read_text())
    probe = d["probe"]
    if isinstance(probe, dict):
        probe = {int(k): v for k, v in probe.items()}
    return write_report(
        Grid(**d["grid"]), Path(out), report, d["wall_s"], d["command"], d["failed"],
        d["memory"], probe, d["times"],
    )  # fmt: skip


@STUDIES.register("fedrd", "FedRD vs student FedAvg, KD without reprogramming, federated LoRA")
def fedrd_study(out: Path, quick: bool) -> Path:
    """The registered study: the full grid into docs/fedrd.md, or the quick one into ``out``."""
    out = Path(out) / ("fedrd-quick" if quick else "fedrd")
    workers = min(2, os.cpu_count() or 1)
    if quick:
        grid = dataclasses.replace(QUICK, workers=workers)
        return run_study(grid, out, out / "fedrd-quick.md", "fedfm reproduce fedrd --quick")
    grid = dataclasses.replace(FULL, workers=workers)
    return run_study(grid, out, Path("docs") / "fedrd.md", "fedfm reproduce fedrd")
