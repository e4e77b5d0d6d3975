"""Clients of different strength: mixed LoRA ranks and compressed updates against their bill.

FedIT on the instruction suite with clients of LoRA ranks 4, 8 and 16 (one tier each, by
client position) under each mode of :data:`fedfm.core.lora_ranks.RANK_MODES` (SVD
re-projection, HetLoRA, FLoRA stacking, naive zero-padded averaging), against homogeneous
FedIT at r = 4 and r = 8; and homogeneous r = 8 with each wire codec of
:mod:`fedfm.core.codec` both ways, against float32. Every method reads out the seen score and
the held-out references' NLL per token against the run's total GB
(:func:`fedfm.core.audit.communication_bill`), each difference paired by seed.

Choices of ours: the LoRA scale is ``alpha = 2 r`` for every global rank (one scale, so that
rank and not scale is compared); the mixed runs' global rank is 16, the largest client's
(FLoRA's: room for every round's stack); the codec runs code every array field of the
``train`` messages, up and down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfm.reproduce.framework import Context, Readout, Run, RunView, merge, preset, register
from fedfm.reproduce.stats import Estimate, mean_se, paired
from fedfm.reproduce.tables import DASH, Text, marked, num, table

TEXT = Text("hetero")
RANKS = (4, 8, 16)
CODECS = ("bfloat16", "float16", "int8", "nf4")
REFERENCE = "r8"  # homogeneous r = 8 in float32: the codecs' reference


@dataclass(frozen=True)
class Grid:
    """The study's size; the rest comes from the ``fedit-fedavg`` preset.

    Attributes:
        rounds, steps, lr: Rounds, local AdamW steps per round and their rate.
        per_domain_train, per_domain_test: Rows drawn per domain of the suite.
        clients: Clients (Dirichlet 0.5 over domains), all of them every round; client ``i``
            has rank ``RANKS[i mod 3]`` in the mixed runs (3: one client a tier).
        seeds: Seeds of every method (differences are paired by seed).
        methods: Keys of :data:`METHODS` the grid runs (None: all).
        task: Fields replacing the task's (e.g. a tiny model in tests); ``partition``: the
            partition's.
        label: Which grid it is, for the report's title.
    """

    rounds: int = 3
    steps: int = 8
    lr: float = 5e-4
    per_domain_train: int = 40
    per_domain_test: int = 10
    clients: int = 3
    seeds: tuple[int, ...] = (0, 1)
    methods: tuple[str, ...] | None = None
    task: Mapping[str, Any] = field(default_factory=dict)
    partition: Mapping[str, Any] = field(default_factory=dict)
    label: str = "full grid"


# Size: a job's CPU time is its local steps (rounds x clients x steps, about 5.9 CPU s each at
# batch 4 and up to 256 tokens: 71.2 CPU s for the 12 steps of a --quick job) plus about 16
# CPU s an evaluation of 24 items (0.67 s an item). At 6 clients a job was 144 steps, about
# 910 CPU s, and the 20 jobs about 305 CPU min: 150 min on 2 workers. At 3 clients (one a tier)
# the clients keep their 8 steps a round (the drift the rank modes aggregate) and the 60 test
# items (the readouts' power): 72 steps, about 480 CPU s a job, about 165 CPU min in all.
FULL = Grid()
QUICK = Grid(
    rounds=1,
    steps=2,
    per_domain_train=12,
    per_domain_test=4,
    seeds=(0,),
    partition={"min_size": 4},
    label="quick grid",
)


@dataclass(frozen=True)
class Method:
    """One arm: its job-name ``key``, report ``label``, LoRA settings and ``comm`` section."""

    key: str
    label: str
    lora: Mapping[str, Any]
    comm: Mapping[str, Any] = field(default_factory=dict)


def _mixed(mode: str, label: str) -> Method:
    lora = {"r": max(RANKS), "client_ranks": list(RANKS), "rank_mode": mode}
    return Method(mode, f"ranks 4/8/16, {label}", lora)


METHODS = (
    Method("r4", "every client r=4", {"r": 4}),
    Method("r8", "every client r=8", {"r": 8}),
    _mixed("zeropad", "naive zero-padded averaging"),
    _mixed("svd", "SVD re-projection to r=16"),
    _mixed("hetlora", "HetLoRA (sparsity-weighted)"),
    _mixed("flora", "FLoRA stacking (exact, growing downlink)"),
    *(
        Method(
            f"r8-{c}", f"every client r=8, {c} both ways", {"r": 8}, {"uplink": c, "downlink": c}
        )
        for c in CODECS
    ),
)


def methods(grid: Grid) -> list[Method]:
    """The grid's methods, in run order."""
    return [m for m in METHODS if grid.methods is None or m.key in grid.methods]


def job_name(method: Method, seed: int) -> str:
    """``<key>-s<seed>``."""
    return f"{method.key}-s{seed}"


def job_config(method: Method, grid: Grid, seed: int) -> dict[str, Any]:
    """The run config of one method and seed."""
    lora = dict(method.lora)
    if lora.get("rank_mode") == "flora":  # room for every round's stack of every client
        lora["r"] = grid.rounds * sum(RANKS[i % len(RANKS)] for i in range(grid.clients))
    lora["alpha"] = 2.0 * float(lora["r"])
    source = {"per_domain_train": grid.per_domain_train, "per_domain_test": grid.per_domain_test}
    task: dict[str, Any] = {"lora": lora, "source_options": source, "choice_mode": "loglik"}
    task.update(choice_norm="none", eval_ppl=True, likelihood_only=True, max_eval=None)
    cfg = merge(preset("fedit-fedavg"), {"task": task})
    cfg["task"].update(grid.task)
    cfg["partition"].update(num_clients=grid.clients, **grid.partition)
    cfg["clients"] = {"fraction": 1.0, "min_clients": grid.clients}
    cfg["train"].update(steps=grid.steps, lr=grid.lr)
    cfg.update(seed=seed, rounds=grid.rounds, eval_every=grid.rounds, plots=False)
    cfg["eval_before"] = method.key == REFERENCE  # the untrained base: each seed's round 0
    if method.comm:
        cfg["comm"] = {**method.comm, "fields": ["train.params"]}
    return cfg


def jobs(ctx: Context[Grid]) -> list[Run]:
    """Every method and seed, the first seed of every method first."""
    grid = ctx.grid
    return [
        Run(job_name(m, s), job_config(m, grid, s), group=m.key)
        for s in grid.seeds
        for m in methods(grid)
    ]


@dataclass
class Results:
    """The finished runs, by method key and seed."""

    runs: dict[str, dict[int, RunView]]
    grid: Grid

    def per_seed(self, key: str, fn: Callable[[RunView], float | None]) -> dict[int, float]:
        """``{seed: fn(run)}`` over the method's finished runs with a value."""
        out = {}
        for seed, view in self.runs.get(key, {}).items():
            value = fn(view)
            if value is not None and math.isfinite(value):
                out[seed] = value
        return out


def read(ctx: Context[Grid]) -> Results:
    """The finished runs of the grid."""
    runs: dict[str, dict[int, RunView]] = {}
    for m in methods(ctx.grid):
        for s in ctx.grid.seeds:
            view = ctx.run(job_name(m, s))
            if view.finished:
                runs.setdefault(m.key, {})[s] = view
    return Results(runs, ctx.grid)


def ref_nll(view: RunView, rnd: int | None = None) -> float | None:
    """Held-out references' NLL per token (the log of the evaluation's ``ppl``)."""
    row = view.final if rnd is None else view.rounds.get(rnd, {})
    ppl = row.get("ppl")
    return math.log(float(ppl)) if isinstance(ppl, int | float) and ppl > 0 else None


def score(view: RunView) -> float | None:
    """The seen score (label accuracy by likelihood, mean over domains)."""
    value = view.final.get("score")
    return float(value) if isinstance(value, int | float) else None


def gb_total(view: RunView) -> float | None:
    """The run's total GB, up and down, from its communication bill."""
    bill = (view.summary or {}).get("comm")
    return float(bill["gb_total"]) if bill else None


MEASURES: dict[str, Callable[[RunView], float | None]] = {
    "nll": ref_nll,
    "score": score,
    "gb": gb_total,
}


def diff(res: Results, a: str, b: str, measure: str) -> Estimate:
    """``a − b`` on a measure, paired by seed (``base``: the untrained model, r8's round 0)."""
    fa = res.per_seed(a, MEASURES[measure])
    if b == "base":
        return paired(fa, res.per_seed(REFERENCE, lambda v: ref_nll(v, 0)))
    return paired(fa, res.per_seed(b, MEASURES[measure]))


def gb_ratio(res: Results, a: str, b: str) -> Estimate:
    """``a``'s total GB over ``b``'s, mean ± SE over seeds."""
    ga, gb = res.per_seed(a, gb_total), res.per_seed(b, gb_total)
    return mean_se([ga[s] / gb[s] for s in sorted(set(ga) & set(gb)) if gb[s] > 0])


def readouts(grid: Grid) -> list[Readout[Results]]:
    """The comparisons the study exists for (fixed before the runs)."""
    seeds = f"paired by seed ({len(grid.seeds)} seed{'s' if len(grid.seeds) > 1 else ''})"
    nll = "NLL per token of the held-out references"
    sc = {k: TEXT(f"scope-{k}") for k in ("premise", "modes", "rank", "codec")}

    def d(a: str, b: str, m: str) -> Callable[[Results], Estimate]:
        return lambda r: diff(r, a, b, m)

    rows = (  # name, paper, direction, value, scope
        (f"r8 − untrained base, {nll}", "the budget moves the model: r8's NLL below the base's",
         -1, d("r8", "base", "nll"), "premise"),
        (f"SVD re-projection − naive zero-padding, {nll}",
         "re-projection beats naive factor averaging (NVFlare's example: 0.941 vs 0.896)", -1,
         d("svd", "zeropad", "nll"), "modes"),
        (f"HetLoRA − naive zero-padding, {nll}",
         "sparsity-weighted aggregation beats plain zero-padded averaging (Cho et al. 2024)", -1,
         d("hetlora", "zeropad", "nll"), "modes"),
        (f"FLoRA stacking − naive zero-padding, {nll}",
         "exact stacking beats zero-padded averaging (Wang et al., NeurIPS 2024)", -1,
         d("flora", "zeropad", "nll"), "modes"),
        (f"SVD re-projection (ranks 4/8/16) − every client r=4, {nll}",
         "stronger clients' higher ranks help over the lowest homogeneous rank (HetLoRA)", -1,
         d("svd", "r4", "nll"), "rank"),
        (f"r8 nf4 − r8 float32, {nll}",
         "a 4-bit wire costs accuracy (NVFlare: 4-bit filters, 5,411 MB → 676 MB)", +1,
         d("r8-nf4", "r8", "nll"), "codec"),
    )  # fmt: skip
    out = [Readout(n, seeds, p, s, v, scope=sc[k]) for n, p, s, v, k in rows]
    out.append(
        Readout(
            "total GB, r8 nf4 / r8 float32",
            f"ratio per seed, mean ± SE over seeds ({len(grid.seeds)})",
            "4-bit blockwise cuts the bytes about 8× (NVFlare: 676 / 5,411 = 0.125)",
            -1,
            lambda r: gb_ratio(r, "r8-nf4", "r8"),
            null=1.0,
            scope=sc["codec"],
        )
    )
    return out


def _mean(values: Mapping[int, float]) -> float | None:
    return float(np.mean(list(values.values()))) if values else None


def _levels(res: Results) -> list[str]:
    rows = []
    for m in methods(res.grid):
        if m.key not in res.runs:
            continue
        cells = [num(_mean(res.per_seed(m.key, MEASURES[k])), 4) for k in ("score", "nll")]
        ref = "r8" if m.comm else "zeropad" if "client_ranks" in m.lora else "r8"
        vs = [marked(diff(res, m.key, ref, k)) if m.key != ref else DASH for k in ("score", "nll")]
        rows.append(
            [
                m.label,
                len(res.runs[m.key]),
                *cells,
                num(_mean(res.per_seed(m.key, gb_total)), 6),
                ref,
                *vs,
            ]
        )
    header = ["method", "seeds", "score", "ref. NLL/token", "total GB", "vs", "Δ score", "Δ NLL"]
    return table(header, rows)


def _bills(res: Results) -> list[str]:
    """Each client's GB up and down in the first seed's run of every method."""
    rows = []
    for m in methods(res.grid):
        view = res.runs.get(m.key, {}).get(res.grid.seeds[0])
        bill = (view.summary or {}).get("comm") if view is not None else None
        if not bill:
            continue
        for cid, v in bill["per_client"].items():
            rows.append([m.label, cid, num(v["gb_up"] * 1e3, 4), num(v["gb_down"] * 1e3, 4)])
    return table(["method", "client", "MB up", "MB down"], rows)


def body(ctx: Context[Grid], res: Results) -> str:
    """Setup, levels and differences, each client's bill."""
    grid = ctx.grid
    missing = [m.key for m in methods(grid) if m.key not in res.runs]
    return TEXT(
        "body",
        vars(grid),
        ranks="/".join(map(str, RANKS)),
        codecs=", ".join(CODECS),
        seeds=", ".join(map(str, grid.seeds)),
        levels=_levels(res),
        bills=_bills(res),
        missing=TEXT("missing", missing=", ".join(missing), command=ctx.command)
        if missing
        else None,
    )


STUDY = register(__name__, "mixed LoRA ranks and wire codecs: score and NLL against total GB")
