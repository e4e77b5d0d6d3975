"""FedHDS reproduction study: data fraction, Rouge-L and client time against FedIT.

``fedfm reproduce fedhds`` runs, on the six-domain instruction suite with the real
SmolLM2-135M-Instruct, split over clients by Dirichlet(0.5) over domains, a quarter of the
clients per round and the ``spam`` domain held out of training and evaluated zero-shot:
FedIT (every sampled client trains on all its rows), FedHDS, FedHDS-Turbo (all-MiniLM-L6-v2
features), Random (each client's rows at random, at the data fraction FedHDS measured in this
study), single-level (FedHDS without the inter-client step), GlobalSelect (every client's 2-D
points clustered on the server) and Coreset-Cent (the server clusters the pooled data: not
private, a reference). It writes ``docs/fedhds.md`` from the grid it ran (``--quick``: the
smaller grid :data:`QUICK`; the report says which).

Every method runs :mod:`fedfm.algorithms.fedhds` (FedIT as ``selection: all``, tested to give
the same adapter as ``algorithm: fedavg``), so all are evaluated alike: every held-out item by
Rouge-L against its reference (as Natural-Instructions' evaluation does, classification
included) and by its domain's own metric (``score``); per-item results are kept, so each
difference from FedIT comes with a paired standard error over the evaluated items (one seed:
the SE covers the evaluation sample, not partition or training randomness). Times and bytes
are those the runs measured and audited.

Resumable like the other studies: finished runs of the same config are skipped, unfinished
ones resumed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedfm.config import ConfigError, preset_dir
from fedfm.core.runfolder import read_jsonl
from fedfm.eval.compare import read_items
from fedfm.reproduce import STUDIES
from fedfm.reproduce.fedekd import run_job, run_status
from fedfm.reproduce.stats import Estimate, mean_se


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
    """

    per_domain_train: int
    per_domain_test: int
    clients: int
    fraction: float
    rounds: int
    max_eval: int
    max_new_tokens: int
    seed: int = 0


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


METHODS = (
    Method("fedhds", "FedHDS", {"selection": "hierarchical"}),
    Method(
        "turbo", "FedHDS-Turbo", {"selection": "hierarchical", "feature_model": "all-minilm-l6-v2"}
    ),
    Method("fedit", "FedIT (all data)", {"selection": "all"}),
    Method("random", "Random (FedHDS's fraction)", {"selection": "random"}),
    Method("single", "Single-level (FedHDS‡)", {"selection": "single-level"}),
    Method("global", "GlobalSelect", {"selection": "global"}),
    Method("cent", "Coreset-Cent (not private)", {"selection": "centralised"}, private=False),
    Method("fedhds-x4", "FedHDS, 4× the rounds", {"selection": "hierarchical"}, rounds_factor=4),
    Method(
        "turbo-x4",
        "FedHDS-Turbo, 4× the rounds",
        {"selection": "hierarchical", "feature_model": "all-minilm-l6-v2"},
        rounds_factor=4,
    ),
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


def _preset() -> dict[str, Any]:
    data = yaml.safe_load((preset_dir() / "fedhds.yaml").read_text())
    assert isinstance(data, dict)
    return data


def job_config(method: Method, grid: Grid, out: Path, budget: float | None) -> dict[str, Any]:
    """The run config of one method of the grid."""
    cfg = _preset()
    rounds = method.rounds(grid)
    cfg.update(name=method.key, seed=grid.seed, rounds=rounds, out_dir=str(out))
    cfg.update(eval_every=rounds, eval_before=method.key == REFERENCE, plots=False)
    cfg["algo"] = {**cfg["algo"], **method.algo}
    if method.key == "random" and budget is not None:
        cfg["algo"]["random_budget"] = round(budget, 6)
    task = cfg["task"]
    task["source_options"] = {
        "per_domain_train": grid.per_domain_train,
        "per_domain_test": grid.per_domain_test,
    }
    task.update(max_eval=grid.max_eval, max_new_tokens=grid.max_new_tokens)
    cfg["partition"] = {**cfg["partition"], "num_clients": grid.clients}
    cfg["clients"] = {**cfg["clients"], "fraction": grid.fraction}
    cfg["threads"] = 1  # one torch thread per run: studies share the machine
    return cfg


# ----------------------------------------------------------------------------- reading runs


@dataclass
class RunResult:
    """What the report reads from one finished run."""

    final: dict[str, Any]
    finish: dict[str, float]
    bytes_up: int
    bytes_down: int
    wall_s: float
    items: list[dict[str, Any]]
    base: dict[str, Any] | None
    select_up: int = 0


def read_run(run: Path, rounds: int) -> RunResult | None:
    """The results of a finished run, or None."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if summary.get("rounds") != rounds:
        return None
    rows = read_jsonl(run / "metrics.jsonl", need_round=False)
    try:
        items = read_items(run, rounds)
    except ConfigError:
        items = []
    base = next((r for r in rows if r["round"] == 0 and "score" in r), None)
    return RunResult(
        summary["final"],
        summary.get("finish", {}),
        int(summary["bytes_up"]),
        int(summary["bytes_down"]),
        float(summary["wall_s_this_session"]),
        items,
        base,
        _select_uplink(run),
    )


def _select_uplink(run: Path) -> int:
    """Bytes clients sent in selection messages (centroids, or GlobalSelect's 2-D points)."""
    path = run / "audit.jsonl"
    if not path.exists():
        return 0
    rows = read_jsonl(path, need_round=False)
    return sum(int(r["bytes"]) for r in rows if r["kind"] == "select" and r["direction"] == "up")


def paired_items(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], key: str, zeroshot: bool
) -> Estimate:
    """Mean and SE of the per-item difference ``a − b`` of ``key`` over the items both have."""

    def index(items: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
        return {
            (str(i["domain"]), str(i["id"])): float(i[key])
            for i in items
            if bool(i.get("zeroshot")) == zeroshot
        }

    ia, ib = index(a), index(b)
    return mean_se([ia[k] - ib[k] for k in sorted(set(ia) & set(ib))])


# ----------------------------------------------------------------------------- the report


def _f(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ratio(ref: float, x: float) -> str:
    return f"{ref / x:.1f}×" if x > 0 else "—"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _main_table(res: Mapping[str, RunResult]) -> list[str]:
    ref = res.get(REFERENCE)
    head = (
        "| method | Rouge-L (seen) | Δ vs FedIT ± SE | Rouge-L (zero-shot) | score (own metrics)"
        " | zero-shot score | data fraction | client train s | train speed-up | feature + "
        "cluster s | client total s | total speed-up | server select s | selection bytes up"
        " | MB up | MB down |"
    )
    lines = [head, "|" + "---|" * 16]
    for m in METHODS:
        r = res.get(m.key)
        if r is None:
            lines.append(f"| {m.label} | not run |" + " |" * 14)
            continue
        fin, t = r.final, r.finish
        delta = paired_items(r.items, ref.items, "rougeL", False) if ref else None
        d = "—" if delta is None or m.key == REFERENCE else delta.fmt(3, signed=True)
        fc = t.get("total_feature_s", 0.0) + t.get("total_cluster_s", 0.0)
        ref_train = ref.finish.get("total_train_s", 0.0) if ref else 0.0
        ref_total = ref.finish.get("total_client_s", 0.0) if ref else 0.0
        cells = [
            m.label,
            _f(fin.get("rougeL_all")),
            d,
            _f(fin.get("zeroshot/rougeL_all")),
            _f(fin.get("score")),
            _f(fin.get("zeroshot/score")),
            _f(t.get("data_fraction"), 4),
            _f(t.get("total_train_s"), 1),
            _ratio(ref_train, t.get("total_train_s", 0.0)) if ref else "—",
            _f(fc, 1),
            _f(t.get("total_client_s"), 1),
            _ratio(ref_total, t.get("total_client_s", 0.0)) if ref else "—",
            _f(t.get("total_select_s"), 2),
            f"{r.select_up:,}",
            _mb(r.bytes_up),
            _mb(r.bytes_down),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _domain_table(res: Mapping[str, RunResult]) -> list[str]:
    domains = sorted(
        {k.split("/", 1)[1] for r in res.values() for k in r.final if k.startswith("rougeL_all/")}
    )
    lines = ["| method | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for m in METHODS:
        if m.key in res:
            fin = res[m.key].final
            lines.append(
                f"| {m.label} | "
                + " | ".join(
                    f"{_f(fin.get(f'rougeL_all/{d}'))} ({_f(fin.get(f'score/{d}'), 2)})"
                    for d in domains
                )
                + " |"
            )
    return lines


def _paper_table() -> list[str]:
    lines = ["| method | paper Rouge-L % | paper speed-up |", "|---|---|---|"]
    for m in (m for m in METHODS if m.key in PAPER):
        rouge, speed = PAPER[m.key]
        lines.append(f"| {m.label} | {rouge} | {speed} |")
    return lines


def _target_lines(res: Mapping[str, RunResult]) -> list[str]:
    hds, ref = res.get("fedhds"), res.get(REFERENCE)
    if hds is None or ref is None:
        return ["The target cannot be checked: FedHDS or FedIT did not finish.", ""]
    train = ref.finish["total_train_s"] / max(hds.finish["total_train_s"], 1e-9)
    total = ref.finish["total_client_s"] / max(hds.finish["total_client_s"], 1e-9)
    delta = paired_items(hds.items, ref.items, "rougeL", False)
    ok_time = train >= 10
    ok_rouge = hds.final.get("rougeL_all", 0.0) >= ref.final.get("rougeL_all", 0.0)
    verdict = "met" if ok_time and ok_rouge else "not met"
    return [
        f"**Target** (FedHDS needs at least 10× less client training time than FedIT at a"
        f" Rouge-L no lower than FedIT's): **{verdict}** in this run. Client training time:"
        f" {train:.1f}× less ({'≥' if ok_time else '<'} 10×); Rouge-L on the seen domains"
        f" {_f(hds.final.get('rougeL_all'))} against {_f(ref.final.get('rougeL_all'))}"
        f" (paired difference over items {delta.fmt(3, signed=True)}, so"
        f" {'resolved' if delta.resolved() else 'not resolved'} at 2 SE).",
        "",
        f"Feature extraction and clustering change the total: with them, FedHDS's client"
        f" compute is {total:.1f}× less than FedIT's (training alone: {train:.1f}×); FedHDS"
        f" runs the LLM forward over every sampled client's rows each round, so at a small"
        f" coreset the features dominate its client time.",
        "",
        *_longer_lines(res),
    ]


def _longer_lines(res: Mapping[str, RunResult]) -> list[str]:
    """One sentence per method run for more rounds: does it catch up with FedIT, at what cost."""
    ref = res.get(REFERENCE)
    lines = []
    for m in METHODS:
        r = res.get(m.key)
        if m.rounds_factor == 1 or r is None or ref is None:
            continue
        delta = paired_items(r.items, ref.items, "rougeL", False)
        train = ref.finish["total_train_s"] / max(r.finish["total_train_s"], 1e-9)
        total = ref.finish["total_client_s"] / max(r.finish["total_client_s"], 1e-9)
        lines += [
            f"{m.label}: Rouge-L {_f(r.final.get('rougeL_all'))} against FedIT's"
            f" {_f(ref.final.get('rougeL_all'))} (paired difference"
            f" {delta.fmt(3, signed=True)}, {'resolved' if delta.resolved() else 'not resolved'}"
            f" at 2 SE); FedIT's client training time is {train:.1f}× this run's and its client"
            f" compute in all (features included) {total:.1f}× this run's.",
            "",
        ]
    return lines


def _full_estimate(grid: Grid, res: Mapping[str, RunResult]) -> str:
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
        total += client * work + max(r.wall_s - client, 0.0) * rest
    return (
        f" Estimated from this grid's runs (client work scaled by {work:.1f}×, evaluation by"
        f" {rest:.1f}×; an estimate, not a measurement): about {total / 3600:.1f} h of"
        " one-thread wall time on this machine."
    )


def write_report(grid: Grid, out: Path, report: Path, command: str, notes: Sequence[str]) -> Path:
    """Writes the markdown report from the runs in ``out``."""
    res = {m.key: r for m in METHODS if (r := read_run(out / m.key, m.rounds(grid))) is not None}
    base = res[REFERENCE].base if REFERENCE in res else None
    n_train = grid.per_domain_train * 5
    lines = [
        "# FedHDS reproduction: hierarchical data selection vs FedIT",
        "",
        f"Generated by `{command}` from the runs in `{out}`"
        " (:mod:`fedfm.reproduce.fedhds`); every number below was measured by these runs.",
        "",
        "## Setup",
        "",
        "- SmolLM2-135M-Instruct (bfloat16 autocast), LoRA r=8 α=16 on q,k,v,o; Adam lr 3e-4,"
        " one local epoch at batch size 1 (the official code's settings); FedAvg weighted by"
        " the rows trained on.",
        f"- Six-domain instruction suite, {grid.per_domain_train} training rows per domain;"
        f" `spam` held out of training ({n_train} training rows in all) and evaluated"
        f" zero-shot; {grid.clients} clients by Dirichlet(0.5) over domains, {grid.fraction:.0%}"
        f" of them per round, {grid.rounds} rounds, seed {grid.seed}.",
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
            if any(m.rounds_factor > 1 for m in METHODS)
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
            f" {_f(base.get('rougeL_all'))}, zero-shot {_f(base.get('zeroshot/rougeL_all'))},"
            f" score {_f(base.get('score'))}.",
            "",
        ]
    lines += ["## Results", "", *_main_table(res), "", *_target_lines(res)]
    lines += [
        "Δ is the mean per-item Rouge-L difference from FedIT over the same evaluated items"
        " with its standard error (one seed: it measures the evaluation sample only).",
        "",
        "### Per domain: Rouge-L (own metric)",
        "",
        *_domain_table(res),
        "",
        "## The paper's figures",
        "",
        "Dolly-15K, Dirichlet α = 0.5, the paper's 1.3B model (Table 2 Rouge-L, Table 3 speed-up of"
        " the whole federated tuning), the closest of the paper's settings to this study:",
        "",
        *_paper_table(),
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
        "## Budget and wall time",
        "",
        *notes,
        "",
        *[f"- `{m.key}`: {res[m.key].wall_s / 60:.1f} min wall" for m in METHODS if m.key in res],
        "",
        f"The full grid (`fedfm reproduce fedhds`): {FULL.per_domain_train} rows per domain,"
        f" {FULL.clients} clients, {FULL.fraction:.0%} per round, {FULL.rounds} rounds,"
        f" {FULL.max_eval} evaluated items, {FULL.max_new_tokens} new tokens."
        + _full_estimate(grid, res),
        "",
    ]
    missing = [m.label for m in METHODS if m.key not in res]
    if missing:
        lines += ["## Not run", "", *[f"- {x}" for x in missing], ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines))
    return report


# ----------------------------------------------------------------------------- running


def run_grid(grid: Grid, out: Path) -> list[str]:
    """Runs what is missing, FedHDS first (Random takes its measured data fraction).

    Returns:
        Lines on the study's wall time and load, and any failed run.
    """
    out.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()
    executed, failed = 0, []
    budget: float | None = None
    for method in METHODS:
        if method.key == "random":
            hds = read_run(out / "fedhds", grid.rounds)
            budget = hds.finish.get("data_fraction") if hds else None
            if not budget:
                failed.append("random: skipped, FedHDS has no measured data fraction")
                continue
        cfg = job_config(method, grid, out, budget)
        if run_status(cfg) != "done":
            executed += 1
        _, err = run_job(cfg)
        if err:
            failed.append(f"{method.key}: {err}")
    wall = time.perf_counter() - t0
    record = {"wall_s": wall, "runs": executed, "load_start": load0, "load_end": os.getloadavg()}
    with (out / "timing.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    lines = []
    for r in read_jsonl(out / "timing.jsonl", need_round=False):
        if r["runs"]:
            ls = ", ".join(f"{x:.1f}" for x in r["load_start"])
            le = ", ".join(f"{x:.1f}" for x in r["load_end"])
            lines.append(
                f"- One invocation: {r['runs']} runs in {r['wall_s'] / 60:.1f} min wall;"
                f" load averages (1, 5, 15 min) {ls} at the start, {le} at the end."
            )
    return lines + [f"- Failed: {x}" for x in failed]


@STUDIES.register("fedhds", "FedHDS, FedHDS-Turbo and selection baselines vs FedIT")
def fedhds_study(out: Path, quick: bool) -> Path:
    """The registered study: either grid writes docs/fedhds.md (the report names its grid)."""
    grid = QUICK if quick else FULL
    out = Path(out) / ("fedhds-quick" if quick else "fedhds")
    notes = run_grid(grid, out)
    report = Path("docs") / "fedhds.md"
    command = "fedfm reproduce fedhds" + (" --quick" if quick else "")
    return write_report(dataclasses.replace(grid), out, report, command, notes)
