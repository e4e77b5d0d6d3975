"""FedHDS reproduction study: data fraction, Rouge-L and client time against FedIT.

``fedfm reproduce fedhds`` runs, on the six-domain instruction suite with the real
SmolLM2-135M-Instruct, split over clients by Dirichlet(0.5) over domains, a quarter of the
clients per round and the ``spam`` domain held out of training and evaluated zero-shot:
FedIT (every sampled client trains on all its rows), FedHDS, FedHDS-Turbo (all-MiniLM-L6-v2
features), Random (each client's rows at random, at the data fraction FedHDS measured in this
study: a job that needs FedHDS's run), single-level (FedHDS without the inter-client step),
GlobalSelect (every client's 2-D points clustered on the server) and Coreset-Cent (the server
clusters the pooled data: not private, a reference). It writes ``docs/fedhds.md`` from the
grid it ran (``--quick``: the smaller grid :data:`QUICK`; the report says which).

Every method runs :mod:`fedfm.algorithms.fedhds` (FedIT as ``selection: all``, tested to give
the same adapter as ``algorithm: fedavg``), so all are evaluated alike: every held-out item by
Rouge-L against its reference (as Natural-Instructions' evaluation does, classification
included) and by its domain's own metric (``score``); per-item results are kept, so each
difference from FedIT comes with a paired standard error over the evaluated items (one seed:
the SE covers the evaluation sample, not partition or training randomness). Times and bytes
are those the runs measured and audited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedfm.reproduce.framework import (
    Context,
    Readout,
    Run,
    RunView,
    Study,
    Unmet,
    preset,
    register,
)
from fedfm.reproduce.stats import Estimate, paired
from fedfm.reproduce.tables import DASH, head, num, ratio, row, table


@dataclass(frozen=True)
class Grid:
    """The study's size; everything else comes from the ``fedhds`` preset.

    Attributes:
        per_domain_train: Training rows drawn per domain (six domains).
        per_domain_test: Test rows drawn per domain.
        clients: Clients (Dirichlet 0.5 over domains).
        fraction: Clients sampled per round.
        rounds: Rounds.
        max_eval: Held-out items evaluated (split over the seen domains), plus as many
            zero-shot items per domain.
        max_new_tokens: Generation budget of each item.
        seed: Run seed.
        methods: Keys of :data:`METHODS` the grid runs (None: all).
        task: Fields replacing the preset's ``task`` fields (e.g. a tiny model in tests).
        partition: Fields replacing the preset's ``partition`` fields.
    """

    per_domain_train: int
    per_domain_test: int
    clients: int
    fraction: float
    rounds: int
    max_eval: int
    max_new_tokens: int
    seed: int = 0
    methods: tuple[str, ...] | None = None
    task: Mapping[str, Any] = field(default_factory=dict)
    partition: Mapping[str, Any] = field(default_factory=dict)


QUICK = Grid(120, 12, 20, 0.25, 3, 60, 48)
FULL = Grid(200, 40, 40, 0.25, 10, 120, 128)


@dataclass(frozen=True)
class Method:
    """One method of the study: its ``algo`` overrides on the preset.

    ``rounds_factor`` runs it for that many times the grid's rounds: the control that asks
    whether a selection method catches up with FedIT when it is given more rounds at a
    fraction of FedIT's training time.
    """

    key: str
    label: str
    algo: Mapping[str, Any]
    private: bool = True
    rounds_factor: int = 1

    def rounds(self, grid: Grid) -> int:
        """The rounds this method runs in ``grid``."""
        return grid.rounds * self.rounds_factor


TURBO = {"selection": "hierarchical", "feature_model": "all-minilm-l6-v2"}
METHODS = (
    Method("fedhds", "FedHDS", {"selection": "hierarchical"}),
    Method("turbo", "FedHDS-Turbo", TURBO),
    Method("fedit", "FedIT (all data)", {"selection": "all"}),
    Method("random", "Random (FedHDS's fraction)", {"selection": "random"}),
    Method("single", "Single-level (FedHDS‡)", {"selection": "single-level"}),
    Method("global", "GlobalSelect", {"selection": "global"}),
    Method("cent", "Coreset-Cent (not private)", {"selection": "centralised"}, private=False),
    Method("fedhds-x4", "FedHDS, 4× the rounds", {"selection": "hierarchical"}, rounds_factor=4),
    Method("turbo-x4", "FedHDS-Turbo, 4× the rounds", TURBO, rounds_factor=4),
)
REFERENCE = "fedit"

# The paper's Table 2 (Rouge-L %, Dolly-15K α = 0.5, its 1.3B model) and Table 3 (speed-up of
# the whole federated tuning over FedIT, same column): the closest of its settings to ours.
PAPER = {
    "fedit": ("30.55", "1×"),
    "fedhds": ("31.82", "16.06×"),
    "turbo": ("31.47", "18.86×"),
    "random": ("31.41", "12.89×"),
    "single": ("below FedHDS", "—"),
    "global": ("below FedHDS", "—"),
    "cent": ("33.27", "—"),
}


def methods(grid: Grid) -> list[Method]:
    """The grid's methods, in run order."""
    return [m for m in METHODS if grid.methods is None or m.key in grid.methods]


def job_config(method: Method, grid: Grid, budget: float | None = None) -> dict[str, Any]:
    """The run config of one method of the grid (Random at FedHDS's ``budget``)."""
    cfg = preset("fedhds")
    cfg["task"].update(grid.task)
    cfg["partition"].update(grid.partition)
    rounds = method.rounds(grid)
    cfg.update(seed=grid.seed, rounds=rounds, eval_every=rounds, plots=False)
    cfg["eval_before"] = method.key == REFERENCE
    cfg["algo"] = {**cfg["algo"], **method.algo}
    if budget is not None:
        cfg["algo"]["random_budget"] = round(budget, 6)
    task = cfg["task"]
    task["source_options"] = {
        "per_domain_train": grid.per_domain_train,
        "per_domain_test": grid.per_domain_test,
    }
    task.update(max_eval=grid.max_eval, max_new_tokens=grid.max_new_tokens)
    cfg["partition"] = {**cfg["partition"], "num_clients": grid.clients}
    cfg["clients"] = {**cfg["clients"], "fraction": grid.fraction}
    return cfg


def _at_fedhds_fraction(method: Method, grid: Grid) -> Callable[[Mapping[str, RunView]], Any]:
    def config(needs: Mapping[str, RunView]) -> dict[str, Any]:
        budget = needs["fedhds"].finish.get("data_fraction")
        if not budget:
            raise Unmet("FedHDS has no measured data fraction")
        return job_config(method, grid, float(budget))

    return config


def jobs(ctx: Context[Grid]) -> list[Run]:
    """Every method; Random after FedHDS, at the data fraction FedHDS measured."""
    grid = ctx.grid
    return [
        Run(m.key, _at_fedhds_fraction(m, grid), ("fedhds",), m.key)
        if m.key == "random"
        else Run(m.key, job_config(m, grid), group=m.key)
        for m in methods(grid)
    ]


Results = dict[str, RunView]


def read(ctx: Context[Grid]) -> Results:
    """The finished runs of the grid, by method key."""
    res = {}
    for m in methods(ctx.grid):
        view = ctx.run(m.key)
        if view.finished and (view.summary or {}).get("rounds") == m.rounds(ctx.grid):
            res[m.key] = view
    return res


def rouge(view: RunView, zeroshot: bool) -> dict[tuple[str, str], float]:
    """Item (domain, id) -> Rouge-L of the run's last evaluation, seen or zero-shot items."""
    return {
        (str(i["domain"]), str(i["id"])): float(i["rougeL"])
        for i in view.items()
        if bool(i.get("zeroshot")) == zeroshot
    }


def _delta(res: Results, a: str, b: str, zeroshot: bool) -> Estimate:
    if a not in res or b not in res:
        return paired({}, {})
    return paired(rouge(res[a], zeroshot), rouge(res[b], zeroshot))


def _time_ratio(res: Results, key: str, of: str = "fedhds") -> Estimate:
    """FedIT's client seconds over FedHDS's (one measurement: no SE)."""
    if of not in res or REFERENCE not in res:
        return paired({}, {})
    x = float(res[of].finish.get(key, 0.0))
    return Estimate(float(res[REFERENCE].finish.get(key, 0.0)) / max(x, 1e-9), float("nan"), 1)


HELD_OUT = (
    "The only held-out domain of this grid is spam, a one-word classification scored by"
    " Rouge-L; the paper's held-out tasks are open-ended (Dolly's held-out category,"
    " Natural-Instructions' test tasks). One seed and few rounds: the SE covers the evaluated"
    " items only."
)


def readouts(grid: Grid) -> list[Readout[Results]]:
    """FedHDS against FedIT and Random on the held-out and seen domains, and its speed-up."""
    del grid
    return [
        Readout(
            "FedHDS − FedIT, Rouge-L of the held-out domain (zero-shot)",
            "paired over items",
            "FedHDS ≥ FedIT on held-out tasks (Dolly α = 0.5: 31.82 vs 30.55)",
            +1,
            lambda r: _delta(r, "fedhds", REFERENCE, True),
            scope=HELD_OUT,
        ),
        Readout(
            "FedHDS − FedIT, Rouge-L of the seen domains",
            "paired over items",
            "not the paper's measure (it scores held-out tasks only)",
            +1,
            lambda r: _delta(r, "fedhds", REFERENCE, False),
            scope="Four of the five seen domains are one-word classification; FedIT trains on"
            " every row of them, so this favours FedIT where the paper's argument (FedIT"
            " overfits local tasks) predicts nothing.",
        ),
        Readout(
            "FedHDS − Random at FedHDS's data fraction, Rouge-L of the held-out domain",
            "paired over items",
            "FedHDS > Random at the same budget (31.82 vs 31.41)",
            +1,
            lambda r: _delta(r, "fedhds", "random", True),
            scope=HELD_OUT,
        ),
        Readout(
            "client training time, FedIT / FedHDS",
            "ratio of one run each",
            "16.06× less for the whole tuning (Table 3)",
            +1,
            lambda r: _time_ratio(r, "total_train_s"),
            null=1.0,
            digits=1,
            scope="Seconds measured on shared cores, one run each: no SE.",
        ),
        Readout(
            "client compute with features and clustering, FedIT / FedHDS",
            "ratio of one run each",
            "16.06× less for the whole tuning (Table 3)",
            +1,
            lambda r: _time_ratio(r, "total_client_s"),
            null=1.0,
            digits=1,
            scope="FedHDS runs the LLM over every sampled client's rows each round; at a small"
            " coreset these features dominate its client time.",
        ),
    ]


# ----------------------------------------------------------------------------- the report


def _main_table(grid: Grid, res: Results) -> list[str]:
    ref = res.get(REFERENCE)
    lines = head(
        "method | Rouge-L (seen) | Δ vs FedIT ± SE | Rouge-L (zero-shot)"
        " | score (own metrics) | zero-shot score | data fraction | client train s"
        " | train speed-up | feature + cluster s | client total s | total speed-up"
        " | server select s | selection bytes up | MB up | MB down"
    )
    for m in methods(grid):
        r = res.get(m.key)
        if r is None:
            lines.append(f"| {m.label} | not run |" + " |" * 14)
            continue
        fin, t, s = r.final, r.finish, r.summary or {}
        delta = _delta(res, m.key, REFERENCE, False).fmt(3, signed=True)
        fc = t.get("total_feature_s", 0.0) + t.get("total_cluster_s", 0.0)
        ref_t = ref.finish if ref else {}
        cells = [
            m.label,
            num(fin.get("rougeL_all")),
            DASH if ref is None or m.key == REFERENCE else delta,
            num(fin.get("zeroshot/rougeL_all")),
            num(fin.get("score")),
            num(fin.get("zeroshot/score")),
            num(t.get("data_fraction"), 4),
            num(t.get("total_train_s"), 1),
            ratio(ref_t.get("total_train_s", 0.0), t.get("total_train_s", 0.0)) if ref else DASH,
            num(fc, 1),
            num(t.get("total_client_s"), 1),
            ratio(ref_t.get("total_client_s", 0.0), t.get("total_client_s", 0.0)) if ref else DASH,
            num(t.get("total_select_s"), 2),
            f"{r.audit_bytes('select'):,}",
            f"{int(s['bytes_up']) / 1e6:.2f}",
            f"{int(s['bytes_down']) / 1e6:.2f}",
        ]
        lines.append(row(cells))
    return lines


def _domain_table(grid: Grid, res: Results) -> list[str]:
    domains = sorted(
        {k.split("/", 1)[1] for r in res.values() for k in r.final if k.startswith("rougeL_all/")}
    )
    rows = [
        [m.label]
        + [
            f"{num(res[m.key].final.get(f'rougeL_all/{d}'))}"
            f" ({num(res[m.key].final.get(f'score/{d}'), 2)})"
            for d in domains
        ]
        for m in methods(grid)
        if m.key in res
    ]
    return table(["method", *domains], rows)


def _longer_lines(grid: Grid, res: Results) -> list[str]:
    """One sentence per method run for more rounds: does it catch up with FedIT, at what cost."""
    ref = res.get(REFERENCE)
    lines = []
    for m in methods(grid):
        r = res.get(m.key)
        if m.rounds_factor == 1 or r is None or ref is None:
            continue
        delta = _delta(res, m.key, REFERENCE, False)
        train = _time_ratio(res, "total_train_s", m.key).mean
        total = _time_ratio(res, "total_client_s", m.key).mean
        lines += [
            f"{m.label}: Rouge-L {num(r.final.get('rougeL_all'))} against FedIT's"
            f" {num(ref.final.get('rougeL_all'))} (paired difference"
            f" {delta.fmt(3, signed=True)}, {'resolved' if delta.resolved() else 'not resolved'}"
            f" at 2 SE); FedIT's client training time is {train:.1f}× this run's and its client"
            f" compute in all (features included) {total:.1f}× this run's.",
            "",
        ]
    return lines


def _full_estimate(grid: Grid, res: Results) -> str:
    """An estimate of the full grid's wall time, scaled from this grid's measured runs.

    Client work (features, clustering, training) scales with the rows a round touches times
    the rounds; the rest of a run's wall time (evaluation, set-up) with the evaluated items
    times the new tokens. Only meaningful when ``grid`` is smaller than :data:`FULL`.
    """
    if grid == FULL or not res:
        return ""
    work = (FULL.per_domain_train * FULL.fraction * FULL.rounds) / (
        grid.per_domain_train * grid.fraction * grid.rounds
    )
    rest = (FULL.max_eval * FULL.max_new_tokens) / (grid.max_eval * grid.max_new_tokens)
    total = 0.0
    for r in res.values():
        client = r.finish.get("total_client_s", 0.0) + r.finish.get("total_select_s", 0.0)
        wall = float((r.summary or {})["wall_s_this_session"])
        total += client * work + max(wall - client, 0.0) * rest
    return (
        f" Estimated from this grid's runs (client work scaled by {work:.1f}×, evaluation by"
        f" {rest:.1f}×; an estimate, not a measurement): about {total / 3600:.1f} h of"
        " one-thread wall time on this machine."
    )


def body(ctx: Context[Grid], res: Results) -> list[str]:
    """The setup, the results, the paper's figures and what differs from its setting."""
    grid = ctx.grid
    ref = res.get(REFERENCE)
    base = next((r for r in ref.metrics if r["round"] == 0 and "score" in r), None) if ref else None
    lines = [
        "## Setup",
        "",
        "- SmolLM2-135M-Instruct (bfloat16 autocast), LoRA r=8 α=16 on q,k,v,o; Adam lr 3e-4,"
        " one local epoch at batch size 1 (the official code's settings); FedAvg weighted by"
        " the rows trained on.",
        f"- Six-domain instruction suite, {grid.per_domain_train} training rows per domain;"
        f" `spam` held out of training ({grid.per_domain_train * 5} training rows in all) and"
        f" evaluated zero-shot; {grid.clients} clients by Dirichlet(0.5) over domains,"
        f" {grid.fraction:.0%} of them per round, {grid.rounds} rounds, seed {grid.seed}.",
        f"- Evaluation after the last round on {grid.max_eval} held-out items of the seen"
        f" domains (and the zero-shot domain's), greedy, {grid.max_new_tokens} new tokens:"
        " Rouge-L of every item against its reference, and each domain's own metric (`score`:"
        " Rouge-L, GSM8K final-number accuracy, label accuracy, mean over domains).",
        "- FedHDS: intra-client HDBSCAN min_cluster_size 2 (the paper's value for Dolly's"
        " mixed categories), inter-client 2; t-SNE perplexity min(30, n − 1). Random trains"
        " each sampled client on FedHDS's measured data fraction of its rows.",
        *(
            [
                f"- The rows marked 4× run {4 * grid.rounds} rounds (the same sampling, one"
                " evaluation after the last round): the control that asks whether a selection"
                " method catches up with FedIT when given more rounds at a fraction of its"
                " training time. Their times and bytes are those of all their rounds."
            ]
            if any(m.rounds_factor > 1 for m in methods(grid))
            else []
        ),
        "- t-SNE and HDBSCAN are scikit-learn's (Barnes-Hut t-SNE as in the official code;"
        " HDBSCAN's probability-weighted centroid, the centre the official code uses; reasons"
        " in the docstring of `src/fedfm/algorithms/fedhds.py`).",
        "- Times are seconds of client training, feature extraction and clustering summed over"
        " clients and rounds (all clients share this machine's 2 cores with other work, so they"
        " compare within this study only); bytes come from the audit ledger (*selection bytes"
        " up*: what clients sent in selection messages, all rounds; MB up and down include"
        " the adapter each selection message carries down for the features and the LoRA"
        " of training).",
        "",
    ]
    if base is not None:
        lines += [
            f"Before training (round 0, the same base model for every method): Rouge-L"
            f" {num(base.get('rougeL_all'))}, zero-shot {num(base.get('zeroshot/rougeL_all'))},"
            f" score {num(base.get('score'))}.",
            "",
        ]
    lines += ["## Results", "", *_main_table(grid, res), "", *_longer_lines(grid, res)]
    lines += [
        "Δ is the mean per-item Rouge-L difference from FedIT over the same evaluated items"
        " with its standard error (one seed: it measures the evaluation sample only).",
        "",
        "### Per domain: Rouge-L (own metric)",
        "",
        *_domain_table(grid, res),
        "",
        "## The paper's figures",
        "",
        "Dolly-15K, Dirichlet α = 0.5, the paper's 1.3B model (Table 2 Rouge-L, Table 3 speed-up of"
        " the whole federated tuning), the closest of the paper's settings to this study:",
        "",
        *table(
            ["method", "paper Rouge-L %", "paper speed-up"],
            [[m.label, *PAPER[m.key]] for m in methods(grid) if m.key in PAPER],
        ),
        "",
        "## What differs from the paper's setting",
        "",
        "- Model: SmolLM2-135M-Instruct instead of the paper's 1.3B and 3B models; Turbo's"
        " feature model: all-MiniLM-L6-v2 instead of GPT-2 (124M); data: the"
        " offline six-domain instruction suite (general instructions, GSM8K maths, medical,"
        " movie and question-type classification, spam held out) instead of"
        " Natural-Instructions or Dolly-15K.",
        f"- Scale: {grid.clients} clients and {grid.rounds} rounds here against the paper's"
        " 200 clients, 5% per round and 40 (NI) or 60 (Dolly) rounds. FedHDS trains on one"
        " row per selected cluster, about a dozen rows per round here, so a few rounds give"
        " it little to learn from: the 4× rows test whether more rounds close the gap. The"
        " paper's claim is about the end of a long run; this grid cannot test that end.",
        "- One seed; the SEs cover the evaluated items, not the partition or training noise.",
        "",
        f"The full grid (`fedfm reproduce fedhds`): {FULL.per_domain_train} rows per domain,"
        f" {FULL.clients} clients, {FULL.fraction:.0%} per round, {FULL.rounds} rounds,"
        f" {FULL.max_eval} evaluated items, {FULL.max_new_tokens} new tokens."
        + _full_estimate(grid, res),
        "",
    ]
    missing = [m.label for m in methods(grid) if m.key not in res]
    if missing:
        lines += ["## Not run", "", *[f"- {x}" for x in missing], ""]
    return lines


STUDY = register(
    Study(
        name="fedhds",
        summary="FedHDS, FedHDS-Turbo and selection baselines vs FedIT",
        full=FULL,
        quick=QUICK,
        jobs=jobs,
        read=read,
        readouts=readouts,
        title=lambda ctx: (
            "FedHDS reproduction: hierarchical data selection vs FedIT"
            + (" (quick grid)" if ctx.quick else "")
        ),
        body=body,
        reports=("fedhds.md", "fedhds.md"),
    )
)
