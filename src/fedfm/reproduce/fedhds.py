"""FedHDS reproduction study (Qin et al., ACL 2025 Findings).

Rouge-L on a held-out task against FedIT, Random at FedHDS's data fraction, FedHDS-Turbo and the
untrained base.

Its premise first (DESIGN principle 18): the paper tunes a pretrained *base* LM, which needs
instruction data. The full grid runs SmolLM2 as a base LM (its chat template off: the Alpaca
prompt) on open-ended data only, and FedIT's first seed is the pilot (``fedfm reproduce fedhds
--pilot``): FedIT − base on the held-out task must be resolved above zero, or the other
methods do not run (their configs wait for it).

The paper scores only categories no client trained on (Dolly-15k's, one held out), where
FedIT's overfitting of each client's few categories can show: the full grid holds out the
suite's creative-writing Alpaca instructions (``alpaca_creative``) and trains on its
question-answering and given-input ones and on GSM8K solutions; the older grids held out
``general`` (all of Alpaca) and trained on the suite's other domains.

Every method is :mod:`fedfm.algorithms.fedhds` (FedIT is ``selection: all``), so each
difference is paired over the same held-out items; the report's setup gives the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fedfm.core.runfolder import read_jsonl
from fedfm.reproduce.framework import (
    Context,
    Readout,
    Run,
    RunView,
    Unmet,
    merge,
    preset,
    register,
)
from fedfm.reproduce.stats import IN_DIRECTION, Estimate, mean_se, paired, units_for, verdict
from fedfm.reproduce.tables import DASH, Text, marked, num, ratio, table

TEXT = Text("fedhds")
HELDOUT = "general"  # the held-out domain of a grid that names none
TRAINED = ("math", "medical", "movie", "qtype", "spam")
TARGET_SE = 0.015
"""The SE that resolves a held-out difference of 0.03 at 2 SE: the grid's item count is
sized from a pilot's per-item SD of the FedHDS − FedIT difference, (SD / TARGET_SE)²."""


@dataclass(frozen=True)
class Grid:
    """The study's size; everything else comes from the ``fedhds`` preset.

    Attributes:
        per_domain_train: Training rows drawn per trained domain (five domains).
        heldout_items, seen_items: Items evaluated of the held-out domain (zero-shot) and
            of the trained ones.
        heldout_tokens, math_tokens: Generation budget of a held-out item (at least the
            references' 90th percentile) and of a GSM8K item.
        seen_tokens: Generation budget of a seen item of another open-ended trained domain
            (None: ``heldout_tokens``); its score is secondary.
        seeds: Seeds of FedIT and FedHDS; the other methods run the first.
        clients: Clients (Dirichlet 0.5 over domains); ``fraction``: sampled per round.
        turbo_model: FedHDS-Turbo's feature model, with ``turbo_args``.
        methods: Keys of :data:`METHODS` the grid runs (None: all).
        trained: The trained domains.
        heldout: The held-out domain, scored zero-shot (no client trains on it).
        base_lm: Prompt without the chat template (the Alpaca prompt): the model as a base LM.
        eval_ppl: Score every item's reference NLL too (held-out NLL beside Rouge-L).
        gated: Whether the other methods wait for the pilot (FedIT's first seed) to resolve
            FedIT above the base on the held-out task (False: they run whatever it shows).
        task: Fields replacing the preset's ``task`` fields (e.g. a tiny model in tests);
            ``partition``: its ``partition`` fields; ``algo``: every method's (its own win).
    """

    per_domain_train: int
    heldout_items: int
    seen_items: int
    rounds: int
    heldout_tokens: int = 352
    math_tokens: int = 160
    seen_tokens: int | None = None
    seeds: tuple[int, ...] = (0, 1)
    clients: int = 20
    fraction: float = 0.25
    turbo_model: str = "all-minilm-l6-v2"
    turbo_args: Mapping[str, Any] = field(default_factory=dict)
    methods: tuple[str, ...] | None = None
    trained: tuple[str, ...] = TRAINED
    heldout: str = HELDOUT
    base_lm: bool = False
    eval_ppl: bool = False
    gated: bool = True
    task: Mapping[str, Any] = field(default_factory=dict)
    partition: Mapping[str, Any] = field(default_factory=dict)
    algo: Mapping[str, Any] = field(default_factory=dict)


# The base-LM premise (the paper tunes a pretrained LM; SmolLM2-Instruct already follows
# instructions, and in the earlier grid FedIT - base was -0.080 on the held-out task): no chat
# template, open-ended data only, as Dolly's categories with one held out (Alpaca's creative
# instructions held out; its question-answering and given-input ones and GSM8K worked
# solutions trained on), IID clients, and rounds enough that FedHDS's small per-round coresets
# add up to training.
OPEN = ("math", "alpaca_qa", "alpaca_task")
BASE_LM: dict[str, Any] = dict(
    trained=OPEN,
    heldout="alpaca_creative",
    base_lm=True,
    eval_ppl=True,
    partition={"scheme": "iid"},
)
QUICK = Grid(60, 60, 20, 2, seeds=(0,), **BASE_LM)
# Client size: the paper's clients hold about 75 rows (Dolly's 15,000 over 200). With 15
# (60 rows per domain over 20 clients) t-SNE spreads a client's points evenly and HDBSCAN
# found 0.4 clusters per client and no global cluster: nothing was selected. A pilot of one
# round (base model): 10 clients of about 60 rows, 5 per round: 32 centroids, 6 global
# clusters, 2.1% of the rows; 20 of about 30 rows, 10 per round: 47 centroids, 2 global
# clusters, 0.7%. FedIT's cost grows with the rows per round (that grid ran 3 rounds).
# The held-out item count: in the earlier default grid the per-item SD of FedHDS - FedIT was
# 0.140, and (0.140 / TARGET_SE)^2 = 87 items. Their references' 90th percentile is 351 tokens.
# Rounds: FedHDS kept 3.7 global clusters a round at 10 clients (1.22% of the rows), one row
# each, so 3 rounds trained it on about 11 rows in all; 10 rounds add up to about 37. The pilot
# (FedIT's first seed) costs its row-steps: rounds x 5 clients x rows each. In the earlier grid
# (5 domains of 120 rows) FedIT took 2,001 CPU s with two evaluations and 1,669 with one: an
# evaluation about 330 s, and about 1.43 CPU s a row-step at batch 1. These rows are 1.44x as
# long in tokens (166.5 against 115.6, capped at 256), so about 2.06 s a row-step. Seen items
# of the Alpaca domains are generated to the GSM8K budget (secondary scores).
# The grid of 66 rows a domain (about 20 a client, 10 rounds) selected nothing in any round:
# 0.7 clusters a client, 3.5 centroids a round, no global cluster (docs/fedhds-20-rows.md).
# The server's HDBSCAN (min_cluster_size 2) over m centroids finds a global cluster with
# probability 0.32 at m = 9, 0.86 at 16, 0.98 at 24 (Gaussian clouds, 200 draws each); the
# one-round pilot above
# with clients of about 60 rows had 32 centroids and 6 global clusters (2.1% of the rows, about
# 6 a round). So 200 rows a domain (about 60 a client) for 5 rounds: about 30 selected rows in
# all, and the probe (FedHDS's first round, in the pilot) stops the main grid below
# MIN_CORESET. FedIT: 5 rounds x 5 clients x 60 rows = 1,500 row-steps, about 3,090 CPU s, plus
# two evaluations: about 64 CPU min, the pilot command's length.
FULL = Grid(200, 90, 30, 5, clients=10, fraction=0.5, seen_tokens=160, **BASE_LM)


@dataclass(frozen=True)
class Method:
    """One method of the study.

    One method: its job name ``key`` (``<key>-s<seed>`` after the first seed), its ``algo``
    overrides; whether it runs every seed (else the first), uses the Turbo feature model, and
    is ``scored`` (else one item per domain: a run kept for its data fraction only), and its
    ``rounds`` (None: the grid's).
    """

    key: str
    label: str
    algo: Mapping[str, Any]
    seeds: bool = False
    turbo: bool = False
    scored: bool = True
    rounds: int | None = None


# sklearn's HDBSCAN counted the point itself in min_samples (= min_cluster_size 2): one
# neighbour in the hdbscan package's count, at both levels.
BEFORE = {"selection": "hierarchical", "min_samples": 1, "server_min_samples": 1}
METHODS = (
    Method("fedit", "FedIT (all data)", {"selection": "all"}, seeds=True),
    Method("fedhds", "FedHDS", {"selection": "hierarchical"}, seeds=True),
    Method("turbo", "FedHDS-Turbo", {"selection": "hierarchical"}, turbo=True),
    Method("random", "Random (FedHDS's fraction)", {"selection": "random"}),
    Method("count", "FedHDS, min_samples as before the fix", BEFORE, scored=False),
)
REFERENCE = "fedit"
PROBE = Method("probe", "FedHDS's first round", METHODS[1].algo, scored=False, rounds=1)
"""Part of the pilot: FedHDS's first round alone (its selection; one item a domain scored)."""
MIN_CORESET = 20
"""Rows FedHDS must be on course to train on over the grid's rounds (the probe's first round's
coreset times the rounds) for its claims to be testable: fewer, and FedHDS is nearly the base."""
PAPER_MARGIN = 0.3182 - 0.3141
"""The paper's FedHDS − Random margin (Table 2, Rouge-L as a fraction): what R2 must resolve."""

# The paper's Table 2 (Rouge-L %, Dolly-15K α = 0.5, its 1.3B model) and Table 3 (speed-up of
# the whole federated tuning over FedIT, same column): the closest of its settings to ours.
PAPER = {
    "fedit": ("30.55", "1×"),
    "fedhds": ("31.82", "16.06×"),
    "turbo": ("31.47", "18.86×"),
    "random": ("31.41", "12.89×"),
}


def methods(grid: Grid) -> list[Method]:
    """The grid's methods, in run order."""
    return [m for m in METHODS if grid.methods is None or m.key in grid.methods]


def runs_of(method: Method, grid: Grid) -> list[tuple[int, str]]:
    """``(seed, job name)`` of every run of the method."""
    seeds = grid.seeds if method.seeds else grid.seeds[:1]
    return [(s, method.key if s == grid.seeds[0] else f"{method.key}-s{s}") for s in seeds]


def job_config(method: Method, grid: Grid, seed: int) -> dict[str, Any]:
    """The run config of one method and seed (Random's budget: :func:`_at_fedhds_fraction`)."""
    seen = grid.seen_items // len(grid.trained) + 1
    per_domain_test = {**dict.fromkeys(grid.trained, seen), grid.heldout: grid.heldout_items}
    source: dict[str, Any] = {"per_domain_train": grid.per_domain_train}
    source.update(per_domain_test=per_domain_test, domains=[*grid.trained, grid.heldout])
    task: dict[str, Any] = {"heldout_domain": None, "heldout_domains": [grid.heldout]}
    task.update(train_domains=list(grid.trained), source_options=source, primary="zeroshot/score")
    task.update(eval_ppl=grid.eval_ppl)
    task.update(zeroshot_items=grid.heldout_items, max_eval=grid.seen_items)
    task.update(max_new_tokens=grid.heldout_tokens, choice_mode="loglik", choice_norm="none")
    budgets = dict.fromkeys(grid.trained, grid.seen_tokens) if grid.seen_tokens else {}
    task["domain_max_new_tokens"] = {**budgets, "math": grid.math_tokens}
    if not method.scored:
        task.update(zeroshot_items=1, max_eval=len(grid.trained))
    cfg = merge(preset("fedhds"), {"task": task, "partition": {"num_clients": grid.clients}})
    cfg["task"].update(grid.task)
    if grid.base_lm:  # after the grid's task fields, which may replace the prompt's
        cfg["task"]["prompt"] = {**cfg["task"].get("prompt", {}), "use_chat_template": False}
    cfg["partition"].update(grid.partition)
    algo = {**grid.algo, **method.algo}
    if method.turbo:
        algo.update(feature_model=grid.turbo_model, feature_model_args=dict(grid.turbo_args))
    cfg = merge(cfg, {"clients": {"fraction": grid.fraction}, "algo": algo})
    rounds = method.rounds or grid.rounds
    cfg.update(seed=seed, rounds=rounds, eval_every=rounds, plots=False)
    # Round 0, the untrained base, once.
    cfg["eval_before"] = method.key == REFERENCE and seed == grid.seeds[0]
    return cfg


def _at_fedhds_fraction(
    method: Method, grid: Grid, seed: int, needs: Mapping[str, RunView]
) -> dict[str, Any]:
    budget = needs["fedhds"].finish.get("data_fraction")
    if not budget:
        raise Unmet("FedHDS has no measured data fraction")
    cfg = job_config(method, grid, seed)
    cfg["algo"]["random_budget"] = round(float(budget), 6)
    return cfg


def premise(grid: Grid, fedit: RunView) -> Estimate:
    """The pilot: FedIT against its base on held-out Rouge-L.

    The pilot: FedIT (first seed, last round) − its round 0 (the base), held-out Rouge-L
    paired over items.
    """
    return paired(item_scores(fedit, True), item_scores(fedit, True, 0))


def pilot_holds(grid: Grid, fedit: RunView) -> bool:
    """Whether FedIT is resolved above the base on the held-out task (> 2 SE)."""
    return verdict(premise(grid, fedit), +1) == IN_DIRECTION


def on_course(grid: Grid, probe: RunView) -> float:
    """Rows FedHDS is on course to select over the grid's rounds (the probe's round x rounds)."""
    return float(probe.finish.get("total_coreset", 0.0)) * grid.rounds


def _after_pilot(build: Any, grid: Grid, needs: Mapping[str, RunView]) -> Mapping[str, Any]:
    """A main run's config (``build`` of the needs), once the pilot holds (else Unmet).

    Every main run also needs the probe to be on course for :data:`MIN_CORESET` rows.
    """
    if grid.gated and not pilot_holds(grid, needs[REFERENCE]):
        est = premise(grid, needs[REFERENCE]).fmt(signed=True)
        raise Unmet(
            f"the pilot does not resolve FedIT above the base on the held-out task ({est}):"
            " the base does not need this instruction data, and selecting it tests nothing"
        )
    probe = needs.get(PROBE.key)
    if grid.gated and probe is not None and on_course(grid, probe) < MIN_CORESET:
        stats = _selection_stats(probe)
        raise Unmet(
            f"FedHDS's selection is on course for {on_course(grid, probe):.0f} rows over"
            f" {grid.rounds} rounds (its first round: {stats.get('centroids per round', 0):.0f}"
            f" centroids, {stats.get('global clusters per round', 0):.0f} global clusters),"
            f" fewer than {MIN_CORESET}: its claims cannot be tested on clients this small"
        )
    return dict(build(needs) if callable(build) else build)


def jobs(ctx: Context[Grid]) -> list[Run]:
    """FedIT's first seed (the pilot, its round 0 the base).

    Then, where it holds, every other method and seed, Random after FedHDS at the data fraction
    FedHDS measured.
    """
    grid = ctx.grid
    pilot = Run(REFERENCE, job_config(METHODS[0], grid, grid.seeds[0]), group=REFERENCE)
    probe = Run(PROBE.key, job_config(PROBE, grid, grid.seeds[0]), group=PROBE.key)
    if ctx.pilot:
        return [pilot, probe]
    out = [pilot, probe]
    for m in methods(grid):
        for seed, name in runs_of(m, grid):
            if name == REFERENCE:
                continue
            # every main run waits for both parts of the pilot: where FedHDS selects too
            # little, FedIT's second seed and the count serve no readout either
            needs: tuple[str, ...] = (REFERENCE, PROBE.key)
            build: Any = job_config(m, grid, seed)
            if m.key == "random":
                build, needs = partial(_at_fedhds_fraction, m, grid, seed), (*needs, "fedhds")
            out.append(Run(name, partial(_after_pilot, build, grid), needs, m.key))
    # Every scored method's first seed first: a study stopped early still has each readout.
    first = {n for m in methods(grid) if m.scored for _, n in runs_of(m, grid)[:1]}
    return sorted(out, key=lambda r: r.name not in first)


@dataclass
class Results:
    """The finished runs of the grid, by job name."""

    runs: dict[str, RunView]
    grid: Grid
    probe: RunView | None = None

    def of(self, key: str) -> list[RunView]:
        """The finished runs of a method, first seed first."""
        m = next(m for m in METHODS if m.key == key)
        return [self.runs[n] for _, n in runs_of(m, self.grid) if n in self.runs]

    def base(self) -> RunView | None:
        """FedIT's first-seed run, whose round 0 is the untrained base."""
        return self.runs.get(REFERENCE)

    @property
    def round0(self) -> dict[str, Any]:
        """The untrained base's metrics (empty before FedIT's first run has finished)."""
        b = self.base()
        return b.rounds.get(0, {}) if b is not None else {}


def read(ctx: Context[Grid]) -> Results:
    """The finished runs of the grid."""
    names = [n for m in methods(ctx.grid) for _, n in runs_of(m, ctx.grid)]
    rounds = {n: (ctx.run(n).summary or {}).get("rounds") for n in names}
    probe = ctx.run(PROBE.key)
    done = (probe.summary or {}).get("rounds") == PROBE.rounds
    runs = {n: ctx.run(n) for n in names if rounds[n] == ctx.grid.rounds}
    return Results(runs, ctx.grid, probe if done else None)


def heldout_nll(view: RunView, rnd: int | None = None) -> dict[str, float]:
    """Item id -> reference NLL per token of the held-out items (where the run scored it)."""
    return {
        str(i["id"]): float(i["nll"]) / int(i["nll_tokens"])
        for i in view.items(rnd)
        if i.get("zeroshot") and i.get("nll_tokens")
    }


def item_scores(view: RunView, zeroshot: bool, rnd: int | None = None) -> dict[str, float]:
    """Item id -> Rouge-L (held-out) or its domain's own score (seen) of one evaluation."""
    key = "rougeL" if zeroshot else "score"
    return {
        str(i["id"]): float(i[key]) for i in view.items(rnd) if bool(i.get("zeroshot")) == zeroshot
    }


def seed_mean(views: Sequence[RunView], zeroshot: bool = True) -> dict[str, float]:
    """Each item's score averaged over the runs (seeds) that evaluated it (all of them)."""
    maps = [item_scores(v, zeroshot) for v in views]
    ids = set.intersection(*(set(m) for m in maps)) if maps else set()
    return {i: float(np.mean([m[i] for m in maps])) for i in ids}


def base_scores(res: Results, zeroshot: bool = True) -> dict[str, float]:
    """The untrained base's item scores (round 0 of FedIT's first seed)."""
    b = res.base()
    return item_scores(b, zeroshot, 0) if b is not None and b.items(0) else {}


def delta(res: Results, a: str, b: str, zeroshot: bool = True) -> Estimate:
    """``a`` − ``b`` (``base``: the untrained base), paired over items, seeds averaged."""
    sides = [
        base_scores(res, zeroshot) if k == "base" else seed_mean(res.of(k), zeroshot)
        for k in (a, b)
    ]
    return paired(sides[0], sides[1])


def seed_delta(res: Results, a: str, b: str, i: int) -> Estimate:
    """``a`` − ``b`` on the held-out items, seed ``i`` of both only."""
    ra, rb = res.of(a), res.of(b)
    if len(ra) <= i or len(rb) <= i:
        return paired({}, {})
    return paired(item_scores(ra[i], True), item_scores(rb[i], True))


def cost_ratio(res: Results, keys: Sequence[str], of: str = "fedhds") -> Estimate:
    """FedIT's seconds (the sum of ``keys``) over ``of``'s, mean ± SE over seeds."""

    def secs(view: RunView) -> float:
        return sum(float(view.finish.get(k, 0.0)) for k in keys)

    # A run that trained on no row has no ratio (a seed where nothing was selected).
    pairs = zip(res.of(REFERENCE), res.of(of), strict=False)
    return mean_se([secs(r) / secs(m) for r, m in pairs if secs(m) > 0])


TRAIN_S = ("total_train_s",)
TOTAL_S = ("total_client_s", "total_select_s")


def selected(res: Results) -> bool:
    """Whether FedHDS's first seed trained on any row (else its readouts measure no selection)."""
    runs = res.of("fedhds")
    return bool(runs) and bool(runs[0].finish.get("data_fraction"))


def readouts(grid: Grid) -> list[Readout[Results]]:
    """FedHDS against FedIT and Random on the held-out task, and its client cost ratios."""
    seeds = "both seeds" if len(grid.seeds) > 1 else "one seed"
    per_seed, paper = "ratio per seed, mean ± SE over seeds", "16.06× less for the whole tuning"

    def seconds(name: str, keys: Sequence[str]) -> Readout[Results]:
        value, scope = partial(cost_ratio, keys=keys), TEXT("scope-seconds")
        return Readout(name, per_seed, f"{paper} (Table 3)", +1, value, 1.0, 1, scope, selected)

    def pilot(r: Results) -> Estimate:
        fedit = r.base()
        return premise(grid, fedit) if fedit is not None else paired({}, {})

    def pilot_nll(r: Results) -> Estimate:
        fedit = r.base()
        if fedit is None:
            return paired({}, {})
        return paired(heldout_nll(fedit), heldout_nll(fedit, 0))

    def premise_and(r: Results) -> bool:
        fedit = r.base()
        return fedit is not None and pilot_holds(grid, fedit) and selected(r)

    return [
        Readout(
            f"pilot: FedIT − base (round 0), Rouge-L of the held-out task ({grid.heldout})",
            "paired over items (first seed)",
            "the base LM needs instruction data: FedIT above the base (the paper's premise)",
            +1,
            pilot,
            scope=TEXT("scope-pilot"),
        ),
        Readout(
            "pilot: FedIT − base (round 0), reference NLL per token of the held-out task",
            "paired over items (first seed)",
            "the base LM needs instruction data: FedIT's NLL below the base's",
            -1,
            pilot_nll,
            scope=TEXT("scope-pilot"),
        ),
        Readout(
            f"FedHDS − FedIT, Rouge-L of the held-out task ({grid.heldout})",
            f"paired over items ({seeds}, averaged per item)",
            "FedHDS ≥ FedIT on held-out tasks (Dolly α = 0.5, 1.3B: 31.82 vs 30.55)",
            +1,
            lambda r: delta(r, "fedhds", REFERENCE),
            scope=TEXT("scope-items"),
            testable=premise_and,
        ),
        Readout(
            "FedHDS − Random at FedHDS's data fraction, Rouge-L of the held-out task",
            "paired over items (first seed)",
            "FedHDS > Random at the same data budget (31.82 vs 31.41)",
            +1,
            lambda r: seed_delta(r, "fedhds", "random", 0),
            scope=TEXT(
                "scope-random",
                margin=f"{PAPER_MARGIN:.4f}",
                need_low=f"{units_for(0.10, PAPER_MARGIN):,}",
                need_high=f"{units_for(0.16, PAPER_MARGIN):,}",
            ),
            testable=premise_and,
            margin=PAPER_MARGIN,
        ),
        seconds("client training time, FedIT / FedHDS", TRAIN_S),
        seconds(
            "client compute with features and clustering (and the server's selection),"
            " FedIT / FedHDS",
            TOTAL_S,
        ),
    ]


def _mean(views: Sequence[RunView], *keys: str, part: str = "finish") -> float | None:
    """The runs' mean of their summary's ``part``, summed over ``keys``; None for none."""
    values = [[float(getattr(v, part)[k]) for v in views if k in getattr(v, part)] for k in keys]
    found = [float(np.mean(x)) for x in values if x]
    return sum(found) if found else None


def _final(views: Sequence[RunView], key: str) -> float | None:
    return _mean(views, key, part="final")


def _avg(scores: Mapping[str, float]) -> str:
    return num(np.mean(list(scores.values())) if scores else None)


def _rows(res: Results) -> list[tuple[str, str, list[RunView]]]:
    """``(label, method key, runs)`` per scored method, and per seed (key "") of several."""
    out = []
    for m in (m for m in methods(res.grid) if m.scored):
        views = res.of(m.key)
        if len(views) > 1:
            out.append((f"{m.label}, mean of {len(views)} seeds", m.key, views))
            out += [(f"{m.label}, seed {v.config.get('seed')}", "", [v]) for v in views]
        else:
            out.append((m.label, m.key, views))
    return out


def _heldout_rows(res: Results) -> list[list[str]]:
    base, fedit, r0 = base_scores(res), seed_mean(res.of(REFERENCE)), res.round0
    cut = f"zeroshot/truncated/{res.grid.heldout}"
    rows = [["untrained base (round 0)", _avg(base), marked(paired(base, fedit)), DASH]]
    rows[0] += [num(r0.get(cut), 2), num(r0.get("score"), 3)]
    for label, key, views in _rows(res):
        scores = seed_mean(views)
        vs_fedit = marked(paired(scores, fedit)) if key != REFERENCE else DASH
        cells = [label, _avg(scores), vs_fedit, marked(paired(scores, base))]
        rows.append([*cells, num(_final(views, cut), 2), num(_final(views, "score"), 3)])
    return rows


def _cost_rows(res: Results) -> list[list[str]]:
    ref = res.of(REFERENCE)
    rows = []
    for label, _, views in _rows(res):
        train, total = _mean(views, *TRAIN_S), _mean(views, *TOTAL_S)
        cells = [label, num(_mean(views, "data_fraction"), 4), num(train, 1)]
        cells += [ratio(_mean(ref, *TRAIN_S), train)]
        cells += [num(_mean(views, "total_feature_s", "total_cluster_s"), 1), num(total, 1)]
        cells += [ratio(_mean(ref, *TOTAL_S), total)]
        sel = f"{int(np.mean([v.audit_bytes('select') for v in views])):,}" if views else DASH
        rows.append([*cells, sel])
    return rows


def _seen_table(res: Results) -> list[str]:
    fedit, r0 = seed_mean(res.of(REFERENCE), False), res.round0
    trained = res.grid.trained
    base = [num(r0.get("score")), DASH, *(num(r0.get(f"score/{d}"), 2) for d in trained)]
    rows = [["untrained base (round 0)", *base]] if r0 else []
    for label, key, views in _rows(res):
        vs = marked(paired(seed_mean(views, False), fedit)) if key not in ("", REFERENCE) else DASH
        cells = [label, num(_final(views, "score")), vs]
        rows.append([*cells, *(num(_final(views, f"score/{d}"), 2) for d in trained)])
    return table(["method", "seen score", "Δ vs FedIT ± SE", *trained], rows)


def _seed_gap(res: Results) -> str | None:
    """R1 per seed, and the spread between seeds."""
    n = min(len(res.of("fedhds")), len(res.of(REFERENCE)))
    if n < 2:
        return None
    per = [seed_delta(res, "fedhds", REFERENCE, i) for i in range(n)]
    cells = ", ".join(
        f"seed {res.of(REFERENCE)[i].config.get('seed')}: {marked(e)}" for i, e in enumerate(per)
    )
    se = math.sqrt(per[0].se ** 2 + per[1].se ** 2)
    return TEXT("seed-gap", cells=cells, gap=f"{per[0].mean - per[1].mean:+.3f}", se=f"{se:.3f}")


def _selection_stats(view: RunView) -> dict[str, float]:
    """Means per round of a FedHDS run's selection log (clusters, centroids)."""
    path = view.folder / "artefacts" / "selection.jsonl"
    rows = read_jsonl(path, need_round=False) if path.exists() else []
    clients = [r for r in rows if r.get("client") is not None and "clusters" in r]
    server = [r for r in rows if r.get("client") is None]
    out = {}
    if clients:
        out["clusters per client"] = float(np.mean([len(r["clusters"]) for r in clients]))
        out["rows per client"] = float(np.mean([r["n"] for r in clients]))
    for key in ("centroids", "global_clusters") if server else ():
        out[f"{key.replace('_', ' ')} per round"] = float(np.mean([r.get(key, 0) for r in server]))
    return out


def _hdbscan(res: Results) -> str | None:
    """The data fraction before and after the fix of HDBSCAN's min_samples."""
    labels = {"fedhds": "after (the hdbscan package's count)", "count": "before (sklearn's count)"}
    keys = ["rows per client", "clusters per client", "centroids per round"]
    keys.append("global clusters per round")
    rows = []
    for k, label in labels.items():
        if (v := res.runs.get(k)) is not None:
            stats = _selection_stats(v)
            cells = [num(v.finish.get("data_fraction"), 4), *(num(stats.get(x), 1) for x in keys)]
            rows.append([label, *cells])
    return TEXT("hdbscan", table=table(["FedHDS", "data fraction", *keys], rows)) if rows else None


def _pilot(res: Results) -> str:
    """The pilot: FedIT's first seed against its round 0, Rouge-L and held-out NLL."""
    from fedfm.reproduce.stats import mde_of

    fedit, grid = res.base(), res.grid
    if fedit is None or not fedit.items(0):
        return TEXT("no-pilot")
    rows = []
    pairs = (
        ("Rouge-L", item_scores(fedit, True), item_scores(fedit, True, 0)),
        ("reference NLL per token", heldout_nll(fedit), heldout_nll(fedit, 0)),
    )
    for label, after, before in pairs:
        d = paired(after, before)
        cells = [_avg(before), _avg(after), marked(d), num(mde_of(d)), d.n]
        rows.append([label, *cells])
    holds = pilot_holds(grid, fedit)
    mode = "without its chat template (a base LM)" if grid.base_lm else "with its chat template"
    values = {"mode": mode, "trained": ", ".join(grid.trained), "heldout": grid.heldout}
    gate = TEXT("pilot-holds" if holds else "pilot-fails")
    return TEXT("pilot", vars(grid), values, rows=rows, gate=gate, probe=_probe(res))


def _probe(res: Results) -> str:
    """The pilot's second part: FedHDS's first round, what its selection found."""
    probe, grid = res.probe, res.grid
    if probe is None:
        return TEXT("no-probe")
    stats = _selection_stats(probe)
    keys = ["rows per client", "clusters per client", "centroids per round"]
    keys.append("global clusters per round")
    coreset = float(probe.finish.get("total_coreset", 0.0))
    cells = [num(stats.get(k), 1) for k in keys]
    cells += [f"{coreset:.0f}", f"{on_course(grid, probe):.0f}"]
    header = [*keys, "rows selected", f"on course for ({grid.rounds} rounds)"]
    holds = on_course(grid, probe) >= MIN_CORESET
    return TEXT(
        "probe",
        vars(grid),
        min_coreset=MIN_CORESET,
        table=table(header, [cells]),
        gate=TEXT("probe-holds" if holds else "probe-fails", min_coreset=MIN_CORESET),
    )


def _instrument(res: Results) -> str:
    """What the scorer did: budgets, truncation, the base's labels, the items needed."""
    b, r0, grid = res.base(), res.round0, res.grid
    if b is None:
        return TEXT("no-base")
    p90 = dict(b.partition.get("reference_tokens_p90", {}))
    budget = {
        **(dict.fromkeys(grid.trained, grid.seen_tokens) if grid.seen_tokens else {}),
        grid.heldout: grid.heldout_tokens,
        "math": grid.math_tokens,
    }
    cut = {d: f"{'zeroshot/' if d == grid.heldout else ''}truncated/{d}" for d in p90}
    rows = [
        [d, p90.get(d, DASH), budget.get(d, DASH), *(num(x.get(cut[d]), 2) for x in (r0, b.final))]
        for d in sorted(p90)
    ]
    hist = []
    for d in grid.trained:
        preds = {k.rsplit("/", 1)[1]: v for k, v in r0.items() if k.startswith(f"pred/{d}/")}
        if preds:
            shares = ", ".join(f"{k} {v:.2f}" for k, v in sorted(preds.items()))
            cells = [num(r0.get(f"{k}/{d}"), 3) for k in ("acc", "majority", "uniform")]
            hist.append([d, *cells, shares])
    fedit = res.of(REFERENCE)
    diffs = {
        "FedHDS − FedIT (seeds averaged per item, R1)": delta(res, "fedhds", REFERENCE),
        "FedHDS − FedIT, first seed": seed_delta(res, "fedhds", REFERENCE, 0),
        "FedIT − base, first seed (the pilot's statistic)": paired(
            item_scores(fedit[0], True) if fedit else {}, base_scores(res)
        ),
    }
    sds = []
    for name, est in diffs.items():
        if est.n > 1:
            sd = est.se * math.sqrt(est.n)
            sds.append([name, est.n, num(sd), num(est.se), math.ceil((sd / TARGET_SE) ** 2)])
    return TEXT(
        "budgets",
        budgets=rows,
        labels=TEXT("labels", rows=hist) if hist else None,
        resolve=TEXT("resolve", target_se=TARGET_SE, rows=sds) if sds else None,
    )


def body(ctx: Context[Grid], res: Results) -> str:
    """The setup, the instrument, the results, the paper's figures and what differs."""
    grid, r0 = ctx.grid, res.round0
    round0 = {"rouge": num(r0.get("zeroshot/rougeL_all")), "score": num(r0.get("score"))}
    missing = [f"- `{n}`" for m in methods(grid) for _, n in runs_of(m, grid) if n not in res.runs]
    paper = [[m.label, *PAPER[m.key]] for m in methods(grid) if m.key in PAPER]
    return TEXT(
        "body",
        vars(grid),
        trained=", ".join(grid.trained),
        partition_scheme=grid.partition.get("scheme", "Dirichlet(0.5) over domains"),
        train_rows=grid.per_domain_train * len(grid.trained),
        client_rows=grid.per_domain_train * len(grid.trained) // grid.clients,
        pilot=_pilot(res),
        main_missing=TEXT("no-main", command=ctx.command) if set(res.runs) <= {REFERENCE} else None,
        fraction=f"{grid.fraction:.0%}",
        seeds=", ".join(map(str, grid.seeds)),
        n_seeds=len(grid.seeds),
        round0=TEXT("round0", round0) if r0 else None,
        instrument=_instrument(res),
        heldout_rows=_heldout_rows(res),
        seed_gap=_seed_gap(res),
        cost_rows=_cost_rows(res),
        hdbscan=_hdbscan(res),
        seen_table=_seen_table(res),
        paper=paper,
        not_run=TEXT("not-run", missing=missing) if missing else None,
    )


STUDY = register(
    __name__,
    "FedHDS, FedHDS-Turbo and Random vs FedIT on a held-out task",
    title=lambda ctx: TEXT("title-quick" if ctx.quick else "title"),
)
