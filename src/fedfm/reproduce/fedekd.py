"""FedeKD under partial concept shift.

Does the energy gate protect the clients whose labels differ from the federation's, where ungated
distillation hurts them? (``docs/fedekd.md``)

Paper: Nguyen, Wang, Ku 2026, "FedeKD: Energy-Based Gating for Robust Federated Knowledge
Distillation under Heterogeneity" (arXiv:2605.05553). The gate exists for proxy knowledge that is
confidently wrong on *some* samples; this grid builds that condition (``task.shift``: on a
minority of clients the labels of class pairs are swapped in their training and local test rows)
and reads first whether ungated distillation does hurt those clients (the premise, DESIGN
principle 18). The arms: the private models alone, ungated KD, the sigmoid gate (ours, the
default), the level gate (ours) and the oracle gate (weight 0 on exactly the relabelled rows:
the bound of any gate). The readouts are fixed below before any run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fedfm.reproduce.framework import Context, Readout, Run, RunView, merge, preset, register
from fedfm.reproduce.stats import Estimate, mean_se, pooled_paired
from fedfm.reproduce.tables import DASH, Text, marked, num

TEXT = Text("fedekd")
GATED = ("sigmoid", "level")  # the gates under test; "oracle" is the bound


@dataclass(frozen=True)
class Arm:
    """One method of the grid: the private models alone, or FedeKD with a gate, β and λ."""

    gate: str  # "local" (no federation), "ungated", "sigmoid", "level" or "oracle"
    lam: float = 0.0
    beta: float = 0.0

    @property
    def tag(self) -> str:
        """The arm's part of its runs' folder names."""
        if self.gate == "local":
            return "local"
        if self.gate in ("ungated", "oracle"):
            return f"{self.gate}-l{self.lam:g}"
        return f"{self.gate}-b{self.beta:g}-l{self.lam:g}"

    @property
    def label(self) -> str:
        """The arm as the tables name it."""
        names = {"local": "private models alone", "ungated": "ungated KD", "oracle": "oracle gate"}
        if self.gate in names:
            return names[self.gate] + ("" if self.gate == "local" else f" (λ={self.lam:g})")
        return f"{self.gate} gate (β={self.beta:g}, λ={self.lam:g})"

    def algo(self) -> dict[str, Any]:
        """The run's algorithm and gate fields."""
        if self.gate == "local":
            return {"algorithm": "local-private", "algo": {"gate": "ungated"}}
        return {
            "algorithm": "fedekd",
            "algo": {"gate": self.gate, "beta": self.beta, "lam": self.lam},
        }


@dataclass(frozen=True)
class Grid:
    """The study's grid.

    The study's grid: a preset (its ``task.shift`` names the shifted clients), the seeds,
    λ and β of the gated arms, and overrides of the preset (a smaller grid for tests).
    """

    preset: str
    seeds: tuple[int, ...]
    lams: tuple[float, ...]
    betas: tuple[float, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def arms(self) -> list[Arm]:
        """Local, ungated and oracle at each λ, each tested gate at each β × λ."""
        out = [Arm("local")]
        out += [Arm("ungated", lam) for lam in self.lams]
        out += [Arm(g, lam, b) for g in GATED for b in self.betas for lam in self.lams]
        return out + [Arm("oracle", lam) for lam in self.lams]

    def config(self) -> dict[str, Any]:
        """The preset with the grid's overrides (before the arm and seed)."""
        return merge(preset(self.preset), self.overrides)

    @property
    def shifted(self) -> frozenset[str]:
        """The shifted clients' ids."""
        return frozenset(str(c) for c in self.config()["task"]["shift"]["clients"])


# Ten seeds: the pilot's paired SDs over seeds (0.011-0.016 for R1-R4) give 2 SE <= 0.01.
FULL = Grid("fedekd-fmnist-shift", seeds=tuple(range(10)), lams=(1.0, 2.0), betas=(1.0, 4.0))
# The pilot (``--quick``): the premise and a first look at each gate, one β and λ, two seeds.
QUICK = Grid("fedekd-fmnist-shift", seeds=(0, 1), lams=(2.0,), betas=(1.0,))


def run_name(arm: Arm, seed: int) -> str:
    """The folder of one arm's run with one seed."""
    return f"{arm.tag}-s{seed}"


def jobs(ctx: Context[Grid]) -> list[Run]:
    """Every arm with every seed; a seed fixes the partition, splits and initialisations."""
    grid = ctx.grid
    base = merge(grid.config(), {"plots": False})
    return [
        Run(run_name(a, s), merge(base, {"seed": s, **a.algo()}), group=a.gate)
        for a in grid.arms()
        for s in grid.seeds
    ]


# ----------------------------------------------------------------------------- reading


@dataclass
class Read:
    """Per arm and seed, what the report reads from the runs.

    Per arm and seed: every client's last local accuracy and accuracy on the relabelled
    classes, the mean client's global test accuracy, the gate's mean weights; and the sizes.
    """

    grid: Grid
    local: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    swapped: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    test: dict[str, dict[int, float]] = field(default_factory=dict)
    weights: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    sizes: dict[str, list[int]] = field(default_factory=dict)


def _last_clients(view: RunView) -> dict[str, dict[str, float]]:
    rows = view.client_metrics
    return dict(rows[-1]["clients"]) if rows else {}


def _weights(view: RunView) -> tuple[float, float] | None:
    """The gate's mean weights on the shifted clients' rows.

    The gate's mean weight on the shifted clients' relabelled rows and on their other rows,
    averaged over the rounds.
    """
    rows = [r for r in view.metrics if "gate_shifted" in r and "gate_kept" in r]
    if not rows:
        return None
    return float(np.mean([r["gate_shifted"] for r in rows])), float(
        np.mean([r["gate_kept"] for r in rows])
    )


def read(ctx: Context[Grid]) -> Read:
    """What the readouts and tables need, from the finished runs."""
    grid, out = ctx.grid, Read(ctx.grid)
    for arm in grid.arms():
        for s in grid.seeds:
            view = ctx.run(run_name(arm, s))
            if not view.finished:
                continue
            clients = _last_clients(view)
            out.local.setdefault(arm.tag, {})[s] = {
                c: float(m["local/acc"]) for c, m in clients.items()
            }
            out.swapped.setdefault(arm.tag, {})[s] = {
                c: float(m["local/shifted_acc"])
                for c, m in clients.items()
                if "local/shifted_acc" in m
            }
            out.test.setdefault(arm.tag, {})[s] = float(view.final.get("test/acc", math.nan))
            if (w := _weights(view)) is not None:
                out.weights.setdefault(arm.tag, {})[s] = w
            for key in ("sizes", "local_test_sizes"):
                out.sizes.setdefault(key, []).extend(view.partition.get(key, []))
    return out


# ----------------------------------------------------------------------------- statistics


def nt(
    r: Read, arm: Arm, shifted: bool, worst: bool = False, key: str = "local"
) -> dict[int, float]:
    """Seed -> negative transfer of ``arm`` over the shifted or the other clients.

    Seed -> negative transfer of ``arm`` (its accuracy minus the private models' alone,
    per client of the same seed) over the shifted or the other clients: the mean client, or
    the worst. ``key`` "swapped": accuracy on the relabelled classes (shifted clients).
    """
    table = r.local if key == "local" else r.swapped
    out = {}
    for s, acc in table.get(arm.tag, {}).items():
        ref = table.get("local", {}).get(s, {})
        cs = [c for c in acc if c in ref and (c in r.grid.shifted) == shifted]
        if cs:
            d = [acc[c] - ref[c] for c in cs]
            out[s] = min(d) if worst else float(np.mean(d))
    return out


def versus(r: Read, gate: str, shifted: bool, worst: bool = False, key: str = "local") -> Estimate:
    """``gate`` − ungated KD at the same λ, pooled over the grid's β × λ cells per seed."""
    betas = r.grid.betas if gate in GATED else (0.0,)
    pairs = [
        (
            nt(r, Arm(gate, lam, b), shifted, worst, key),
            nt(r, Arm("ungated", lam), shifted, worst, key),
        )
        for b in betas
        for lam in r.grid.lams
    ]
    return pooled_paired([p for p in pairs if p[0] and p[1]])


def premise(r: Read) -> Estimate:
    """Ungated KD's negative transfer on the shifted clients (mean client), at the largest λ."""
    return mean_se(nt(r, Arm("ungated", max(r.grid.lams)), shifted=True))


def premise_holds(r: Read) -> bool:
    """Whether ungated KD hurts the shifted clients by more than 2 SE."""
    return premise(r).resolved() < 0


def weight_ratio(r: Read, gate: str) -> Estimate:
    """How well the gate tells the relabelled rows apart, per seed pooled over cells.

    The gate's mean weight on the relabelled rows over that on the shifted clients' other
    rows (1: the gate does not tell them apart; 0: the oracle), per seed pooled over cells.
    """
    per: dict[int, list[float]] = {}
    for arm in (a for a in r.grid.arms() if a.gate == gate):
        for s, (w_shift, w_kept) in r.weights.get(arm.tag, {}).items():
            if w_kept > 0:
                per.setdefault(s, []).append(w_shift / w_kept)
    return mean_se([float(np.mean(v)) for v in per.values()])


PREMISE_SCOPE = "premise-scope"
GATE_SCOPE = "gate-scope"


def readouts(grid: Grid) -> list[Readout[Read]]:
    """The premise first, then each gate against ungated KD.

    On the shifted clients (the claim), on the others (no harm), and whether the gate sees the
    relabelled rows.
    """
    lam = max(grid.lams)
    scope = TEXT(GATE_SCOPE)
    out: list[Readout[Read]] = [
        Readout(
            f"premise: ungated KD (λ={lam:g}) − private models alone,"
            " shifted clients' local accuracy",
            "mean client, paired by seed",
            "ungated distillation transfers the federation's labels to shifted clients (harm)",
            -1,
            premise,
            scope=TEXT(PREMISE_SCOPE),
        )
    ]
    for gate in (*GATED, "oracle"):
        out.append(
            Readout(
                f"{gate} gate − ungated KD, shifted clients' local accuracy",
                "mean client, paired by seed, pooled over β × λ",
                "the gate lowers negative transfer" + (" (bound)" if gate == "oracle" else ""),
                +1,
                partial(versus, gate=gate, shifted=True),
                scope=scope,
                testable=premise_holds,
            )
        )
    for gate in GATED:
        out.append(
            Readout(
                f"{gate} gate − ungated KD, unshifted clients' local accuracy",
                "mean client, paired by seed, pooled over β × λ",
                "gating does not cost the clients without shift",
                +1,
                partial(versus, gate=gate, shifted=False),
                scope=scope,
                testable=premise_holds,
            )
        )
    for gate in GATED:
        out.append(
            Readout(
                f"{gate} gate: weight on relabelled rows / on the shifted clients' other rows",
                "mean over seeds (each pooled over β × λ)",
                "high-energy (wrong) proxy knowledge gets less trust",
                -1,
                partial(weight_ratio, gate=gate),
                null=1.0,
                scope=scope,
                testable=premise_holds,
            )
        )
    return out


# ----------------------------------------------------------------------------- report


def _arm_rows(r: Read) -> list[list[str]]:
    rows = []
    for arm in r.grid.arms():
        if arm.tag not in r.local:
            continue
        cells = [arm.label]
        if arm.gate == "local":
            cells += [DASH] * 5
        else:
            cells += [
                marked(mean_se(nt(r, arm, True))),
                marked(mean_se(nt(r, arm, True, worst=True))),
                marked(mean_se(nt(r, arm, True, key="swapped"))),
                marked(mean_se(nt(r, arm, False))),
                marked(mean_se(nt(r, arm, False, worst=True))),
            ]
        w = r.weights.get(arm.tag, {})
        ws = [mean_se([v[i] for v in w.values()]) for i in (0, 1)]
        cells += [ws[0].fmt(3) if w else DASH, ws[1].fmt(3) if w else DASH]
        cells += [mean_se(r.test.get(arm.tag, {})).fmt(3), str(len(r.local[arm.tag]))]
        rows.append(cells)
    return rows


def _gate_rows(r: Read) -> list[list[str]]:
    rows = []
    for gate in (*GATED, "oracle"):
        ests = [
            versus(r, gate, True),
            versus(r, gate, True, worst=True),
            versus(r, gate, True, key="swapped"),
            versus(r, gate, False),
            versus(r, gate, False, worst=True),
        ]
        rows.append([gate, *(marked(e) for e in ests)])
    return rows


def _resolution_rows(grid: Grid, r: Read) -> list[list[str]]:
    """Each readout's SE and the smallest effect its grid resolves (2 SE)."""
    rows = []
    for i, ro in enumerate(readouts(grid), start=1):
        est = ro.value(r)
        ok = est.n > 1 and math.isfinite(est.se)
        rows.append(
            [f"R{i}", str(est.n), num(est.se if ok else None), num(2 * est.se if ok else None)]
        )
    return rows


def _sizes(values: Iterable[int]) -> str:
    v = sorted(values)
    return f"{v[0]} / {int(np.median(v))}" if v else DASH


def body(ctx: Context[Grid], r: Read) -> str:
    """The setup, the premise, the arms, the gates against ungated KD, the resolution."""
    grid = ctx.grid
    cfg = grid.config()
    shift = cfg["task"]["shift"]
    holds = premise_holds(r)
    return TEXT(
        "body",
        preset=grid.preset,
        seeds=", ".join(map(str, grid.seeds)),
        lams=", ".join(f"{x:g}" for x in grid.lams),
        betas=", ".join(f"{x:g}" for x in grid.betas),
        rounds=cfg["rounds"],
        clients=cfg["partition"]["num_clients"],
        alpha=cfg["partition"]["alpha"],
        shifted=", ".join(map(str, shift["clients"])),
        pairs=", ".join(f"{a} ↔ {b}" for a, b in shift["pairs"]),
        rows=_sizes(r.sizes.get("sizes", [])),
        test_rows=_sizes(r.sizes.get("local_test_sizes", [])),
        steps=cfg["train"]["steps"],
        batch=cfg["train"]["batch_size"],
        premise=TEXT("premise-holds" if holds else "premise-fails", estimate=marked(premise(r))),
        arms=_arm_rows(r),
        gates=_gate_rows(r),
        resolution=_resolution_rows(grid, r),
    )


STUDY = register(
    __name__,
    "FedeKD's gates under partial concept shift (label swaps on a minority of clients)",
    reports=("fedekd.md", "fedekd-pilot.md"),
    title=lambda ctx: TEXT("title-quick" if ctx.quick else "title"),
)
