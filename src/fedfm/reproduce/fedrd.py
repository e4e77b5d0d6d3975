"""FedRD where the teacher's knowledge can transfer.

The teacher probe first, then FedRD as the paper, with the teacher detached, with an unlabelled
transfer pool, and the pool's pseudo-label control (``docs/fedrd.md``).

Method: FedRD (federated reprogramming knowledge distillation, :mod:`fedfm.algorithms.fedrd`).
Its claim is that a frozen foundation model's knowledge, reprogrammed on the server, reaches
the student. That needs a teacher stronger than the student, so each task's first jobs are the
probe: the fine-tuning control (student FedAvg + CE on the public rows) and FedRD as the paper,
whose teacher path z_t is scored on test rows. Only a task whose teacher margin over the control
is resolved (more than 2 SE over seeds) gets the other arms; the others are reported as
"cannot be tested". The transfer pool (``algo.transfer_size``) is ours, beyond the paper.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fedfm.reproduce.framework import Context, Readout, Run, merge, preset, register
from fedfm.reproduce.stats import NONE, Estimate, mean_se, paired
from fedfm.reproduce.tables import DASH, Text, marked, num

TEXT = Text("fedrd")
PROBE_ARMS = ("ft", "paper")  # the control and FedRD as the paper (its teacher path: the probe)


@dataclass(frozen=True)
class Task:
    """One cell of the study.

    One cell: its name, the presets of FedRD and of the fine-tuning control, and overrides
    (data, partition, rows left for the transfer pool).
    """

    name: str
    fedrd: str
    control: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    pool: int | None = None  # the transfer pool's rows (None: the grid's)


# Every arm's algo fields over the FedRD preset ("ft" is the control preset as it is).
ARMS: dict[str, dict[str, Any]] = {
    "ft": {},
    "paper": {},
    "detached": {"detach_teacher": True},
    "pool": {"detach_teacher": True, "transfer_size": "$pool"},
    "pseudo": {"detach_teacher": True, "beta": 0.0, "transfer_size": "$pool",
               "transfer_loss": "pseudo"},
}  # fmt: skip
LABELS = {
    "ft": "fine-tuning control (student FedAvg + CE on the public rows)",
    "paper": "FedRD as the paper (KL and CKA into both sides)",
    "detached": "FedRD, teacher detached (standard KD)",
    "pool": "FedRD, detached + unlabelled transfer pool (ours)",
    "pseudo": "pseudo-label control: CE on the teacher path's hard labels of the same pool",
}


def _text(dataset: str, alpha: float, max_train: int) -> dict[str, Any]:
    return {
        "task": {"dataset": dataset, "max_train": max_train},
        "partition": {"alpha": alpha},
    }


@dataclass(frozen=True)
class Grid:
    """Tasks, seeds, rounds (None: the presets') and the transfer pool's size."""

    tasks: tuple[Task, ...]
    seeds: tuple[int, ...]
    pool: int = 2000
    rounds: int | None = None

    def config(self, task: Task, arm: str, seed: int) -> dict[str, Any]:
        """One run's config: the arm's preset with the task's and the grid's overrides."""
        base = preset(task.control if arm == "ft" else task.fedrd)
        pool = self.pool if task.pool is None else task.pool
        algo = {k: pool if v == "$pool" else v for k, v in ARMS[arm].items()}
        over: dict[str, Any] = {"seed": seed, "plots": False, "algo": algo}
        if self.rounds is not None:
            over["rounds"] = self.rounds
        return merge(merge(base, task.overrides), over)


TEXT_TASKS = (
    # TREC leaves 1,881 rows that no client holds and that are not public or test rows.
    Task("trec", "fedrd-text", "fedrd-text-ft", _text("trec", 0.1, 3000), pool=1500),
    Task("rotten_tomatoes", "fedrd-text", "fedrd-text-ft", _text("rotten_tomatoes", 0.5, 4000)),
)
VISION = Task("fashion_mnist", "fedrd-vision", "fedrd-vision-ft")
FULL = Grid((*TEXT_TASKS, VISION), seeds=(0, 1, 2))
QUICK = Grid((*TEXT_TASKS, VISION), seeds=(0, 1))


def run_name(task: Task, arm: str, seed: int) -> str:
    """One run's folder."""
    return f"{task.name}-{arm}-s{seed}"


def jobs(ctx: Context[Grid]) -> list[Run]:
    """The probe of every task first.

    The other arms only for a task whose teacher margin over the control is resolved once its probe
    has run.
    """
    grid, out = ctx.grid, []
    for task in grid.tasks:
        probe = [run_name(task, a, s) for a in PROBE_ARMS for s in grid.seeds]
        out += [
            Run(run_name(task, a, s), grid.config(task, a, s), group=f"{task.name}-{a}")
            for a in PROBE_ARMS
            for s in grid.seeds
        ]
        if ctx.settled(probe) and margin_of(ctx, task).resolved() > 0:
            out += [
                Run(run_name(task, a, s), grid.config(task, a, s), group=f"{task.name}-{a}")
                for a in ARMS
                if a not in PROBE_ARMS
                for s in grid.seeds
            ]
    return out


# ----------------------------------------------------------------------------- reading


@dataclass
class Read:
    """Per task, arm and seed: the student's test accuracy, the teacher path's, test CKA."""

    grid: Grid
    acc: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)
    teacher: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)
    cka: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)


def read(ctx: Context[Grid]) -> Read:
    """The last evaluation of every finished run."""
    out = Read(ctx.grid)
    for task in ctx.grid.tasks:
        for arm in ARMS:
            for s in ctx.grid.seeds:
                view = ctx.run(run_name(task, arm, s))
                if not view.finished:
                    continue
                final = view.final
                for key, table in (("acc", out.acc), ("teacher/acc", out.teacher)):
                    if key in final:
                        table.setdefault((task.name, arm), {})[s] = float(final[key])
                if "cka_test" in final:
                    out.cka.setdefault((task.name, arm), {})[s] = float(final["cka_test"])
    return out


def margin(r: Read, task: str) -> Estimate:
    """The premise: FedRD's teacher path accuracy − the control student's, paired by seed."""
    return paired(r.teacher.get((task, "paper"), {}), r.acc.get((task, "ft"), {}))


def margin_of(ctx: Context[Grid], task: Task) -> Estimate:
    """The premise of one task from the runs in the study folder."""
    return margin(read(ctx), task.name)


def diff(r: Read, task: str, a: str, b: str) -> Estimate:
    """Student test accuracy of arm ``a`` − arm ``b``, paired by seed."""
    return paired(r.acc.get((task, a), {}), r.acc.get((task, b), {}))


def gap_closed(r: Read, task: str, arm: str) -> Estimate:
    """Share of the teacher–control gap an arm closes.

    (arm − control) / (teacher − control), the ratio of the seed means (a single value: no SE).
    """
    d, m = diff(r, task, arm, "ft"), margin(r, task)
    if d.n == 0 or m.n == 0 or m.mean <= 0:
        return NONE
    return Estimate(d.mean / m.mean, float("nan"), 1)


def readouts(grid: Grid) -> list[Readout[Read]]:
    """Per task: the premise first, then each arm against its control (fixed before the runs)."""
    out: list[Readout[Read]] = []
    premise_scope, scope = TEXT("premise-scope"), TEXT("arm-scope")
    for task in grid.tasks:
        name = task.name
        out.append(
            Readout(
                f"{name}, premise: teacher path − fine-tuning control",
                "test accuracy, paired by seed",
                "the foundation model's path is stronger than the student",
                +1,
                partial(margin, task=name),
                scope=premise_scope,
            )
        )

        def holds(r: Read, t: str = name) -> bool:
            return margin(r, t).resolved() > 0

        for a, b, claim in (
            ("paper", "ft", "FedRD beats the control that sees the same public rows"),
            ("detached", "ft", "distillation into the student alone beats the control"),
            ("pool", "ft", "distillation on unlabelled rows transfers more (ours)"),
            ("pool", "pseudo", "soft KD adds to hard pseudo-labels of the same pool"),
        ):
            out.append(
                Readout(
                    f"{name}: {a} − {b}",
                    "student test accuracy, paired by seed",
                    claim,
                    +1,
                    partial(diff, task=name, a=a, b=b),
                    scope=scope,
                    testable=holds,
                )
            )
    return out


# ----------------------------------------------------------------------------- report


def _probe_rows(r: Read) -> list[list[str]]:
    rows = []
    for task in r.grid.tasks:
        m = margin(r, task.name)
        ctrl = mean_se(r.acc.get((task.name, "ft"), {}))
        teach = mean_se(r.teacher.get((task.name, "paper"), {}))
        resolved = m.resolved() > 0
        state = "tested" if resolved else "cannot be tested: the teacher is not resolved stronger"
        rows.append([task.name, teach.fmt(3), ctrl.fmt(3), marked(m), num(2 * m.se), state])
    return rows


def _arm_rows(r: Read) -> list[list[str]]:
    rows = []
    for task in r.grid.tasks:
        for arm in ARMS:
            acc = r.acc.get((task.name, arm), {})
            if not acc:
                continue
            rows.append(
                [
                    task.name,
                    LABELS[arm],
                    mean_se(acc).fmt(3),
                    DASH if arm == "ft" else marked(diff(r, task.name, arm, "ft")),
                    DASH if arm == "ft" else gap_closed(r, task.name, arm).fmt(2),
                    mean_se(r.teacher.get((task.name, arm), {})).fmt(3),
                    mean_se(r.cka.get((task.name, arm), {})).fmt(2),
                    str(len(acc)),
                ]
            )
    return rows


def body(ctx: Context[Grid], r: Read) -> str:
    """The setup, the probe, every arm."""
    grid = ctx.grid
    cfg = grid.config(grid.tasks[0], "paper", grid.seeds[0])
    return TEXT(
        "body",
        seeds=", ".join(map(str, grid.seeds)),
        pool=", ".join(f"{t.name} {grid.pool if t.pool is None else t.pool}" for t in grid.tasks),
        rounds=cfg["rounds"],
        probe=_probe_rows(r),
        arms=_arm_rows(r),
        seeds_n=len(grid.seeds),
        alphas=", ".join(
            f"{t.name} α={grid.config(t, 'ft', 0)['partition']['alpha']:g}" for t in grid.tasks
        ),
    )


STUDY = register(
    __name__,
    "FedRD where the teacher is stronger: probe first, detached KD, transfer pool, pseudo-labels",
    reports=("fedrd.md", "fedrd-pilot.md"),
    later="a task's detached, pool and pseudo-label arms, once its probe resolves the margin",
    title=lambda ctx: TEXT("title-quick" if ctx.quick else "title"),
)
