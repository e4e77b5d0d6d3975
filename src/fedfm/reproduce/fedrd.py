"""FedRD reproduction study: FedRD against controls for its public rows, the paper's KD
baselines and a client-side adapter on the foundation model, over seeds and rounds.

``fedfm reproduce fedrd`` runs, on Fashion-MNIST (SmallCNN students, a frozen
EfficientNet-Lite0 on the server) and on TREC (a fastText-style student, a frozen
all-MiniLM-L6-v2 on the server), at Dirichlet label skew α ∈ {0.1, 0.5}, for every seed:

* **controls** for the labelled public rows the server trains on: student FedAvg + public
  fine-tuning (``fedavg-ft``: the server's CE on the same public rows, same epochs, no
  foundation model) and FedRD with α = β = 0 (public CE only, with FedRD's warm-up of g);
* **FedRD**, **FedRD without φ** (``fedrd-nophi``, formerly ``fedrd-kd``) and **Fed-Hint**
  (FitNets feature hints at the server), the KD baselines;
* **student FedAvg** (no public rows) and, for images, a **federated adapter on the
  foundation model** (clients hold the frozen Lite0 with a trainable adapter and head;
  federated LoRA on MiniLM, ``fedrd-text-lora``, is a method here but not in the full grid:
  every client step runs the encoder, too slow for seeds × 40 rounds on 2 CPU cores);

then probes Lite0's features linearly (logistic regression on as many training images as the
public set has) at several input sizes, so the report can say whether the teacher beats the
student, and writes ``docs/fedrd.md`` (:mod:`fedfm.reproduce.fedrd_report`, which also
registers the study). ``--quick`` runs a tiny grid and writes its report under the output
folder, so it never replaces the committed report.

Jobs run seed by seed, so an interrupted grid has every cell at fewer seeds. By default
they go one after another in one process with one torch thread: the foundation model's
features (public set, evaluation rows, the adapter's images) are computed once per process
and reused by every later run that reads the same rows.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedfm.reproduce.framework import Compute, Context, Job, Run, merge, preset

# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Method:
    """One row family of the study.

    Attributes:
        label: Name in the report.
        presets: Modality -> preset.
        algo: Overrides of the preset's ``algo`` section (e.g. α = β = 0).
        public: Whether the server trains on the labelled public rows.
        kind: ``control``, ``method``, ``kd`` (a KD baseline) or ``baseline``.
    """

    label: str
    presets: Mapping[str, str]
    algo: Mapping[str, Any] = field(default_factory=dict)
    public: bool = True
    kind: str = "baseline"


METHODS: dict[str, Method] = {
    "fedavg": Method(
        "student FedAvg (no public rows)",
        {"vision": "fedrd-vision-fedavg", "text": "fedrd-text-fedavg"},
        public=False,
    ),
    "ft": Method(
        "student FedAvg + public fine-tuning",
        {"vision": "fedrd-vision-ft", "text": "fedrd-text-ft"},
        kind="control",
    ),
    "ab0": Method(
        "FedRD, α = β = 0 (public CE only)",
        {"vision": "fedrd-vision", "text": "fedrd-text"},
        {"alpha": 0.0, "beta": 0.0},
        kind="control",
    ),
    "fedrd": Method("FedRD", {"vision": "fedrd-vision", "text": "fedrd-text"}, kind="method"),
    "nophi": Method(
        "FedRD without φ", {"vision": "fedrd-vision-nophi", "text": "fedrd-text-nophi"}, kind="kd"
    ),
    "hint": Method(
        "Fed-Hint (FitNets hints)",
        {"vision": "fedrd-vision-hint", "text": "fedrd-text-hint"},
        kind="kd",
    ),
    "adapter": Method(
        "federated adapter on the FM (clients hold Lite0)",
        {"vision": "fedrd-vision-adapter"},
        public=False,
    ),
    "lora": Method(
        "federated LoRA on the FM (clients hold MiniLM)", {"text": "fedrd-text-lora"}, public=False
    ),
}
"""Every method; FedRD is compared with each of the others, seed by seed."""


@dataclass
class Grid:
    """What the study runs.

    Attributes:
        modalities: ``vision`` and/or ``text``.
        alphas: Dirichlet concentrations.
        seeds: Seeds (each also draws the training pool, the public set and the partition:
            every method of a seed sees the same clients and public rows).
        methods: Keys of :data:`METHODS` (one without a preset for a modality is skipped).
        rounds: Rounds per run (None: the presets').
        eval_every: Evaluate every this many rounds (and after the last): the curves' step.
        overrides: Per modality, ``section -> {key: value}`` merged into every run's config;
            the ``algo`` section only where the method trains on the public rows.
        probe_sizes: Lite0 input sizes of the linear probe (empty: skip).
        probe_test: Test images the probe is scored on.
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

    @property
    def preset(self) -> str:
        return METHODS[self.method].presets[self.modality]


def cells(grid: Grid) -> list[Cell]:
    """Every run, seed by seed (an interrupted grid has every cell at fewer seeds)."""
    return [
        Cell(mod, a, s, m)
        for s in grid.seeds
        for mod in grid.modalities
        for a in grid.alphas
        for m in grid.methods
        if mod in METHODS[m].presets
    ]


def job_config(job: Cell, grid: Grid) -> dict[str, Any]:
    """The run config of one job: the preset, the method's overrides, α, seed, study settings.

    The model arguments of the study's ``algo.teacher_options`` apply to the adapter's
    ``model_args.fm_size`` too, so both foundation-model paths see images of one size.
    """
    data = preset(job.preset)
    m = METHODS[job.method]
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


# ----------------------------------------------------------------------------- Lite0 probe


def lite0_probe(
    sizes: Sequence[int], n_train: int, n_test: int, seed: int = 0
) -> dict[int, dict[str, float]]:
    """Linear-probe accuracy of EfficientNet-Lite0 features on Fashion-MNIST per input size.

    Logistic regression (scikit-learn) on pooled features of ``n_train`` training images
    (as many as the public set: the rows the teacher path learns from), scored on ``n_test``
    test images; also the seconds per 100 images for the features.
    """
    import torch
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

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
        # One BLAS thread: on a shared machine L-BFGS with a thread pool is many times slower.
        with threadpool_limits(1):
            clf = LogisticRegression(max_iter=2000).fit(ftr, ytr)
        out[int(size)] = {
            "acc": float(clf.score(fte, yte)),
            "s_per_100": secs / (n_train + n_test) * 100,
            "n_train": n_train,
            "n_test": n_test,
        }
    return out


def public_size(grid: Grid) -> int:
    """The vision public set's size (the probe trains on as many images)."""
    data = job_config(Cell("vision", grid.alphas[0], grid.seeds[0], "fedrd"), grid)
    return int(data["algo"].get("public_size", 500))


def probe(inputs: Mapping[str, Path], folder: Path, **params: Any) -> dict[str, Any]:
    """The probe as a computation of the study (its result, by input size)."""
    del inputs, folder
    return {str(k): v for k, v in lite0_probe(**params).items()}


PROBE = "lite0-probe"


def jobs(ctx: Context[Grid]) -> list[Job]:
    """The Lite0 probe (when the grid has images), then every run."""
    grid = ctx.grid
    out: list[Job] = []
    if "vision" in grid.modalities and grid.probe_sizes:
        params = {"sizes": [int(s) for s in grid.probe_sizes], "n_train": public_size(grid)}
        out.append(Compute(PROBE, probe, {**params, "n_test": grid.probe_test}))
    return out + [Run(c.name, job_config(c, grid), group=c.method) for c in cells(grid)]
