"""One self-contained HTML page for one run or several runs side by side.

``fedfm report RUN [RUN ...] --html`` writes it, and every run leaves its own ``report.html``.
The page needs nothing but itself: figures are embedded PNGs (``data:`` URIs), styles are
inline, there is no script and no link to fetch, so it opens offline and sends no request.

Sections, in the order a reader asks for them:

1. **Runs**: algorithm, task, rounds, final and best primary metric, bytes, failed clients,
   wall time, ε; each run's resolved config and the files it left (artefacts), folded.
2. **Curves**: the primary metric, then the losses, over rounds, runs overlaid (one colour per
   run in every figure).
3. **Breakdown**: per domain (``<metric>/<domain>`` keys, e.g. ``score/movie`` of the
   instruction task, and ``zeroshot/<metric>/<domain>`` of its held-out domains), the first
   evaluated round (round 0: the untrained base) beside the last; then, for classification
   domains, the **predicted-label histograms** beside the accuracy and the majority-class and
   uniform baselines, so that a scorer collapsed onto one label shows at once.
4. **Clients**: for personalised runs the mean and worst client over rounds, and every
   client's final values.
5. **Communication** (from ``audit.jsonl``, the bytes that crossed the wire): bytes per round
   and direction; totals per message kind, field and direction; and a check that every field
   a client sent is one its algorithm declares for that kind (an undeclared field is listed).
6. **Privacy** (``privacy.json``, where the run used DP): ε per mechanism and per client.
7. **Failures** (``failures.jsonl``) and **timings** (seconds per round, wall time).
8. **Items** (``eval_items.jsonl``, for tasks that score items, e.g. LLM runs): a few held-out
   items of the last evaluated round with each run's answer and score side by side.
9. **lm-evaluation-harness** (``lm_eval.json``, written by ``fedfm eval``): each task's scores.

Numbers are written plainly: seconds and MiB with one decimal and their unit, metrics with at
most four significant digits, counts as integers.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm import plots
from fedfm.core.audit import communication_bill, dp_clients, secagg_stages, unprotected
from fedfm.core.messages import MessageKind
from fedfm.core.runfolder import read_json, read_jsonl
from fedfm.errors import ConfigError

REPORT = "report.html"
ITEMS = "eval_items.jsonl"
LM_EVAL = "lm_eval.json"
LOSSES = ("train_loss", "loss")
ITEMS_SHOWN = 8


@dataclass
class RunData:
    """What a run folder holds, read once (missing optional files are empty)."""

    path: Path
    label: str
    summary: dict[str, Any]
    config_text: str
    rows: list[dict[str, Any]]
    client_rows: list[dict[str, Any]] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    privacy: dict[str, Any] | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    lm_eval: dict[str, Any] | None = None

    @property
    def primary(self) -> str:
        """The run's headline metric."""
        return str(self.summary.get("primary", "acc"))

    @property
    def algorithm(self) -> str:
        """The run's algorithm name."""
        return str(self.summary.get("algorithm", "?"))


def load_run(path: Path, summary: dict[str, Any] | None = None) -> RunData:
    """Reads a run folder.

    Args:
        path: The run folder.
        summary: Its summary when the caller has it (a run writing its own report).

    Raises:
        ConfigError: Not a finished fedfm run folder (no ``summary.json``).
        RunFolderError: A log is damaged (the message names the file).
    """
    if summary is None:
        if not (path / "summary.json").exists():
            raise ConfigError("run", f"{path} has no summary.json (unfinished or not a run folder)")
        summary = read_json(path / "summary.json")
    cfg = path / "config.yaml"
    items = read_jsonl(path / ITEMS)
    privacy = path / "privacy.json"
    harness = path / LM_EVAL
    return RunData(
        path=path,
        label=str(summary.get("name") or path.name),
        summary=summary,
        config_text=cfg.read_text(errors="replace") if cfg.exists() else "",
        rows=read_jsonl(path / "metrics.jsonl"),
        client_rows=read_jsonl(path / "client_metrics.jsonl"),
        audit=read_jsonl(path / "audit.jsonl"),
        failures=read_jsonl(path / "failures.jsonl"),
        privacy=read_json(privacy) if privacy.exists() else None,
        items=list(items[-1]["items"]) if items else [],
        lm_eval=read_json(harness) if harness.exists() else None,
    )


def _labels(runs: Sequence[RunData]) -> None:
    """Makes run labels unique (two folders of the same name get their parent's name)."""
    seen: dict[str, int] = defaultdict(int)
    for r in runs:
        seen[r.label] += 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.path.parent.name}/{r.path.name}"


# ----------------------------------------------------------------------------- html pieces


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _num(v: Any, digits: int = 4) -> str:
    """A number written plainly.

    Integers with thousands separators, other numbers with at most ``digits`` significant digits
    (``0.6667``, ``0.5``, ``161.9``, ``2.5e-05``).
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _esc("" if v is None else v)
    if isinstance(v, int) or (v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    if abs(v) >= 10 ** (digits - 1):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
    return f"{v:.{digits}g}"


def _unit(v: Any, unit: str) -> str:
    """``161.9 s``, ``28.1 MiB``: one decimal and the unit (empty for a missing value)."""
    return "" if not isinstance(v, (int, float)) else f"{v:,.1f} {unit}"


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "") -> str:
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f"<th>{_esc(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_num(v)}</td>" for v in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _img(fig: Any, alt: str) -> str:
    return (
        f'<img class="plot" alt="{_esc(alt)}" src="data:image/png;base64,{plots.png_base64(fig)}">'
    )


def _mib(n: float) -> float:
    return n / 2**20


# ----------------------------------------------------------------------------- sections


def section_runs(runs: Sequence[RunData]) -> str:
    """The runs' headline figures and their configs."""
    head = ["run", "algorithm", "task", "rounds", "primary", "final", "best (round)"]
    head += ["up", "down", "failed clients", "wall time", "epsilon"]
    rows = []
    for r in runs:
        s, p = r.summary, r.primary
        best = s.get("best", {})
        task = s.get("task", {})
        eps = (s.get("privacy") or {}).get("epsilon")
        rows.append(
            [
                r.label,
                r.algorithm,
                f"{task.get('kind', '')} / {task.get('dataset', '')}",
                s.get("rounds"),
                p,
                s.get("final", {}).get(p),
                f"{_num(best.get(p))} ({best.get('round')})",
                _unit(_mib(s.get("bytes_up", 0)), "MiB"),
                _unit(_mib(s.get("bytes_down", 0)), "MiB"),
                s.get("failed_clients", 0),
                _unit(s.get("wall_s_this_session"), "s"),
                eps,
            ]
        )
    configs = "".join(
        f"<details><summary>config of {_esc(r.label)}</summary><pre>{_esc(r.config_text)}</pre>"
        "</details>"
        for r in runs
    )
    files = "".join(
        f"<details><summary>files {_esc(r.label)} left (artefacts)</summary>"
        + _table(
            ["file", "bytes", "sha256"],
            [[k, v.get("bytes"), v.get("sha256")] for k, v in r.summary["artefacts"].items()],
        )
        + "</details>"
        for r in runs
        if r.summary.get("artefacts")
    )
    return "<h2>Runs</h2>" + _table(head, rows) + configs + files


def _series(runs: Sequence[RunData], key: str) -> dict[str, list[tuple[float, float]]]:
    return {r.label: [(row["round"], row[key]) for row in r.rows if key in row] for r in runs}


def section_curves(runs: Sequence[RunData], palette: Mapping[str, str]) -> str:
    """The primary metric and the losses over rounds, runs overlaid."""
    out = ["<h2>Curves</h2>"]
    for metric in dict.fromkeys(r.primary for r in runs):
        series = _series(runs, metric)
        if any(series.values()):
            out.append(_img(plots.lines(series, metric, metric, palette), f"{metric} per round"))
    for loss in LOSSES:
        series = _series(runs, loss)
        if any(series.values()):
            out.append(_img(plots.lines(series, loss, loss, palette), f"{loss} per round"))
    return "".join(out)


ZEROSHOT = "zeroshot/"
NOT_METRICS = ("local", "n", "pred", "majority", "uniform", "bal_acc_se")
"""Key prefixes that are not per-domain metrics: per-client values, counts, and the label
histograms with their baselines (shown in their own table)."""


def _domain_key(row: Mapping[str, Any], key: str) -> tuple[str, str] | None:
    """``(metric, domain)`` of a ``[zeroshot/]<metric>/<domain>`` key whose metric is logged."""
    prefix = ZEROSHOT if key.startswith(ZEROSHOT) else ""
    base, _, domain = key.removeprefix(prefix).partition("/")
    if not domain or "/" in domain or f"{prefix}{base}" not in row:
        return None
    if base in NOT_METRICS or base.startswith("bytes") or not isinstance(row[key], (int, float)):
        return None
    return f"{prefix}{base}", domain


def domain_breakdown(run: RunData, rnd: int | None = None) -> dict[str, dict[str, float]]:
    """``{metric: {domain: value}}`` of round ``rnd`` (``None``: the last that has them).

    Only keys whose base metric is itself logged count (``score/movie`` beside ``score``,
    ``zeroshot/score/spam`` beside ``zeroshot/score``), so per-client (``local/...``) values,
    counts and histograms are not taken for domains.
    """
    rows = [r for r in run.rows if rnd is None or r.get("round") == rnd]
    for row in reversed(rows):
        found: dict[str, dict[str, float]] = defaultdict(dict)
        for k, v in row.items():
            got = _domain_key(row, k)
            if got is not None:
                found[got[0]][got[1]] = float(v)
        if found:
            return dict(found)
    return {}


def _evaluated_rounds(run: RunData) -> list[int]:
    """The first and the last round with per-domain values (one when they are the same)."""
    rounds = [int(r["round"]) for r in run.rows if domain_breakdown(run, int(r["round"]))]
    return sorted({rounds[0], rounds[-1]}) if rounds else []


def section_breakdown(runs: Sequence[RunData], palette: Mapping[str, str]) -> str:
    """Per-domain values of the first (the untrained base) and last evaluated rounds."""
    per_run: dict[str, dict[str, dict[str, float]]] = {}
    colours: dict[str, str] = {}
    for r in runs:
        rounds = _evaluated_rounds(r)
        for rnd in rounds:
            label = f"{r.label}, round {rnd}"
            per_run[label] = domain_breakdown(r, rnd)
            # The run's colour for its last round, half transparent for round 0 beside it.
            later = rnd != rounds[-1]
            colours[label] = palette[r.label] + ("80" if later else "")
    metrics = list(dict.fromkeys(m for b in per_run.values() for m in b))
    if not metrics:
        return ""
    out = ["<h2>Breakdown by domain</h2><p>Round 0 is the untrained base model.</p>"]
    for m in metrics:
        domains = sorted({d for b in per_run.values() for d in b.get(m, {})})
        values = {lab: [b.get(m, {}).get(d) for d in domains] for lab, b in per_run.items()}
        values = {lab: v for lab, v in values.items() if any(x is not None for x in v)}
        lines = _baselines(runs, m, domains)
        fig = plots.bars(domains, values, f"{m} by domain", m, colours, lines)
        out.append(_img(fig, m))
        out.append(_table(["run", *domains], [[lab, *v] for lab, v in values.items()]))
    return "".join(out) + section_histograms(runs)


BASELINES = {"acc": ("majority", "uniform"), "bal_acc": ("uniform",)}
"""The baselines drawn on a metric's chart: a majority-class answer scores ``majority/<d>``
in accuracy, and, like a uniform guess, 1 / (number of labels) in balanced accuracy."""
BASELINE_NAMES = {"majority": "majority class", "uniform": "uniform guess"}


def _baselines(
    runs: Sequence[RunData], metric: str, domains: Sequence[str]
) -> dict[str, list[float | None]]:
    """The baselines of ``metric`` per domain.

    The baselines of ``metric`` per domain, from the first run's last row that has them
    (gold labels do not change between rounds).
    """
    prefix = ZEROSHOT if metric.startswith(ZEROSHOT) else ""
    keys = BASELINES.get(metric.removeprefix(prefix), ())
    out: dict[str, list[float | None]] = {}
    for key in keys:
        name = "majority class or uniform" if metric.endswith("bal_acc") else BASELINE_NAMES[key]
        for row in reversed(runs[0].rows if runs else []):
            vals = [row.get(f"{prefix}{key}/{d}") for d in domains]
            if any(isinstance(v, (int, float)) for v in vals):
                out[name] = [float(v) if isinstance(v, (int, float)) else None for v in vals]
                break
    return out


def label_histograms(run: RunData, rnd: int) -> dict[str, dict[str, float]]:
    """``{[zeroshot/]domain: {label: share, ..., "acc": .., "majority": .., "uniform": ..}}``."""
    row = next((r for r in run.rows if r.get("round") == rnd), {})
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for k, v in row.items():
        prefix = ZEROSHOT if k.startswith(ZEROSHOT) else ""
        parts = k.removeprefix(prefix).split("/")
        if parts[0] == "pred" and len(parts) == 3:
            out[prefix + parts[1]][parts[2]] = float(v)
    for domain, hist in out.items():
        prefix = ZEROSHOT if domain.startswith(ZEROSHOT) else ""
        name = domain.removeprefix(prefix)
        for key in ("acc", "bal_acc", "majority", "uniform"):
            value = row.get(f"{prefix}{key}/{name}")
            if isinstance(value, (int, float)):
                hist[key] = float(value)
    return dict(out)


HIST_COLUMNS = ("acc", "bal_acc", "majority", "uniform")
"""The columns beside a domain's predicted-label shares."""


def section_histograms(runs: Sequence[RunData]) -> str:
    """The predicted-label shares of each classification domain.

    The predicted-label shares of each classification domain, round 0 and the last round,
    beside the accuracy, the majority-class baseline and a uniform guess's expected accuracy.
    """
    tables: dict[str, list[list[Any]]] = defaultdict(list)
    labels: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        for rnd in _evaluated_rounds(r):
            for domain, hist in label_histograms(r, rnd).items():
                names = [k for k in hist if k not in HIST_COLUMNS]
                labels[domain] = list(dict.fromkeys([*labels[domain], *names]))
                tables[domain].append([f"{r.label}, round {rnd}", hist])
    if not tables:
        return ""
    out = [
        "<h3>Predicted labels</h3><p>Share of each domain's items answered with each label;"
        " <em>balanced acc</em> is the mean recall over the gold labels (a majority-class"
        " answer scores 1 / labels);"
        " <em>majority</em> is the accuracy of always answering the most frequent gold label,"
        " <em>uniform</em> that of a uniform guess.</p>"
    ]
    for domain in sorted(tables):
        head = ["run", *labels[domain], "acc", "balanced acc", "majority", "uniform"]
        rows = [
            [lab, *(h.get(k) for k in [*labels[domain], *HIST_COLUMNS])]
            for lab, h in tables[domain]
        ]
        out.append(f"<h4>{_esc(domain)}</h4>" + _table(head, rows))
    return "".join(out)


def section_lm_eval(runs: Sequence[RunData]) -> str:
    """Each run's lm-evaluation-harness scores (``fedfm eval``)."""
    rows = []
    for r in runs:
        res = r.lm_eval or {}
        for task, metrics in res.get("results", {}).items():
            n = res.get("n_samples", {}).get(task, {}).get("effective")
            for metric, value in metrics.items():
                if not metric.endswith("stderr"):
                    rows.append([r.label, task, metric, value, n])
    if not rows:
        return ""
    versions = sorted({str((r.lm_eval or {}).get("lm_eval")) for r in runs if r.lm_eval})
    return (
        "<h2>lm-evaluation-harness</h2>"
        f"<p>lm-eval {_esc(', '.join(versions))} on each run's global adapter"
        " (<code>fedfm eval</code>).</p>"
        + _table(["run", "task", "metric", "value", "documents"], rows)
    )


def section_clients(runs: Sequence[RunData], palette: Mapping[str, str]) -> str:
    """Mean and worst client over rounds, and each client's last values (personalised runs)."""
    out: list[str] = []
    for metric in dict.fromkeys(r.primary for r in runs):
        key = f"local/{metric}"
        series: dict[str, list[tuple[float, float]]] = {}
        styles: dict[str, str] = {}
        for r in runs:
            mean = [(row["round"], row[key]) for row in r.rows if key in row]
            worst = [(row["round"], row[f"{key}/worst"]) for row in r.rows if f"{key}/worst" in row]
            if mean:
                series[f"{r.label} (mean client)"] = mean
            if worst:
                series[f"{r.label} (worst client)"] = worst
                styles[f"{r.label} (worst client)"] = "--"
        if series:
            fig = plots.lines(
                series, f"{metric} on the clients' own splits", metric, palette, styles
            )
            out.append(_img(fig, f"mean and worst client {metric}"))
    for r in runs:
        if not r.client_rows:
            continue
        last = r.client_rows[-1]
        clients: dict[str, dict[str, float]] = last["clients"]
        keys = sorted({k for v in clients.values() for k in v})
        rows = [[cid, *[vals.get(k) for k in keys]] for cid, vals in sorted(clients.items())]
        out.append(
            f"<details><summary>every client of {_esc(r.label)}, round {last['round']}</summary>"
            + _table(["client", *keys], rows)
            + "</details>"
        )
    return ("<h2>Clients</h2>" + "".join(out)) if out else ""


def undeclared(run: RunData) -> list[str]:
    """Audit rows whose field the run's algorithm does not declare for that kind and direction.

    Returns:
        One line per distinct undeclared ``(kind, direction, field)``; a note when the
        algorithm is not registered in this installation (nothing can be checked).
    """
    import fedfm.algorithms  # noqa: F401  (registers the algorithms)
    from fedfm.algorithms.base import ALGORITHMS, kinds_of

    if run.algorithm not in ALGORITHMS:
        return [f"algorithm '{run.algorithm}' is not registered here: fields not checked"]
    from fedfm.core.secagg import secure_kinds

    algo = ALGORITHMS.get(run.algorithm)
    kinds = kinds_of(algo)
    if any(r.get("secagg") for r in run.audit):  # the kinds in their SecAgg+ form
        kinds = secure_kinds(kinds, algo.secure_fields, dp=False)
    bad: dict[tuple[str, str, str], int] = {}
    for row in run.audit:
        kind = kinds.get(row["kind"])
        arrays = row.get("type") == "arrays"
        if kind is None or row["field"] not in _declared(kind, row["direction"], arrays):
            k = (row["kind"], row["direction"], row["field"])
            bad[k] = bad.get(k, 0) + 1
    return [f"{k} {d} field '{f}' ({n} messages) is not declared" for (k, d, f), n in bad.items()]


def _declared(kind: MessageKind, direction: str, arrays: bool) -> tuple[str, ...]:
    if direction == "up":
        return kind.up_arrays if arrays else kind.up_meta
    return kind.down_arrays if arrays else kind.down_meta


def section_audit(runs: Sequence[RunData], palette: Mapping[str, str]) -> str:
    """Bytes per round and direction, totals per kind and field, the declared-fields check."""
    out = ["<h2>Communication (audit ledger)</h2>"]
    series: dict[str, list[tuple[float, float]]] = {}
    styles: dict[str, str] = {}
    for r in runs:
        per: dict[tuple[str, int], int] = defaultdict(int)
        for row in r.audit:
            per[(row["direction"], row["round"])] += int(row["bytes"])
        for d in ("up", "down"):
            pts = sorted((float(rnd), _mib(b)) for (dd, rnd), b in per.items() if dd == d)
            series[f"{r.label} ({d})"] = pts
            styles[f"{r.label} ({d})"] = "-" if d == "up" else ":"
    if any(series.values()):
        fig = plots.lines(
            series, "bytes per round (up: solid, down: dotted)", "MiB", palette, styles
        )
        out.append(_img(fig, "bytes per round"))
    for r in runs:
        tot: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for row in r.audit:
            key = (row["kind"], row["field"], row.get("type", ""), row["direction"])
            tot[key][0] += int(row["bytes"])
            tot[key][1] += 1
        rows = [[*k, b, n] for k, (b, n) in sorted(tot.items())]
        problems = undeclared(r)
        check = (
            '<p class="ok">every field that crossed the wire is declared by '
            f"{_esc(r.algorithm)}'s message kinds</p>"
            if not problems
            else '<p class="bad">' + "<br>".join(_esc(p) for p in problems) + "</p>"
        )
        head = ["kind", "field", "type", "direction", "bytes", "messages"]
        out.append(f"<h3>{_esc(r.label)}</h3>" + _table(head, rows) + check)
        if stages := secagg_stages(r.audit):
            head = ["stage", "what left the clients", "bytes up", "bytes down"]
            out.append(_secagg_guarantee(r) + _table(head, stages))
        out.append(_bill(r))
        out.append(_per_round_bytes(r))
    return "".join(out)


def _secagg_guarantee(run: RunData) -> str:
    """What SecAgg+ promised this run, with its threshold (DESIGN.md principle 19)."""
    t = next((row["secagg/threshold"] for row in run.rows if "secagg/threshold" in row), "t")
    return (
        f"<p>SecAgg+ (threshold t = {_esc(t)}): against an honest-but-curious server colluding"
        " with fewer than t clients, the server learned only the sum of the vectors it got;"
        " a round with fewer than t survivors, or fewer than t shares of a secret, failed"
        " before anything was unmasked. SecAgg+ bytes per stage:</p>"
    )


def _bill(run: RunData) -> str:
    """The communication bill: GB (10⁹ bytes) up and down per client and for the run."""
    bill = communication_bill(run.audit)
    rows = [[c, v["gb_up"], v["gb_down"]] for c, v in bill["per_client"].items()]
    rows.append(["all clients", bill["gb_up"], bill["gb_down"]])
    head = ["client", "GB up", "GB down"]
    return "<p>communication bill (GB = 10⁹ bytes)</p>" + _table(head, rows)


def _per_round_bytes(run: RunData) -> str:
    """A folded table: bytes per round for every (kind, direction)."""
    per: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in run.audit:
        per[row["round"]][f"{row['kind']} {row['direction']}"] += int(row["bytes"])
    cols = sorted({c for v in per.values() for c in v})
    rows = [[rnd, *[per[rnd].get(c, 0) for c in cols]] for rnd in sorted(per)]
    return (
        "<details><summary>bytes per round, by message kind and direction</summary>"
        + _table(["round", *cols], rows)
        + "</details>"
    )


def _dp_fields(r: RunData) -> str:
    """What left the run's DP clients: any field that is not a DP output or public, in red."""
    clients = dp_clients(r.audit)
    if not clients:
        return ""
    bad = unprotected(r.audit)
    if not bad:
        return (
            f'<p class="ok">Only DP mechanism outputs and public values left the '
            f"{len(clients)} DP clients (audit ledger).</p>"
        )
    rows = [[b["kind"], b["field"], b["clients"], ", ".join(map(str, b["rounds"]))] for b in bad]
    return (
        '<p class="bad">Fields DP clients sent that are neither a DP mechanism\'s output nor'
        " public (not covered by the ε above):</p>"
        + _table(["kind", "field", "DP clients", "rounds"], rows, "bad")
    )


def section_privacy(runs: Sequence[RunData]) -> str:
    """The privacy section: ε per mechanism and per client from each run's ``privacy.json``.

    ε per mechanism and per client from each run's ``privacy.json``, its relation, where
    its noise came from, and any unnoised field its DP clients sent (audit ledger).
    """
    out: list[str] = []
    for r in runs:
        p = r.privacy
        if not p:
            continue
        run_eps = p.get("run", {})
        out.append(
            f"<h3>{_esc(r.label)}</h3><p>run: ε = {_num(run_eps.get('epsilon'))} at "
            f"δ = {_num(p.get('delta'))} ({_esc(p.get('accountant'))}; worst client "
            f"{_esc(run_eps.get('worst_client'))}; {_esc(p.get('composition', ''))})</p>"
        )
        if p.get("relation"):
            out.append(f"<p>neighbouring relation: {_esc(p['relation'])}</p>")
        if p.get("warning"):
            out.append(f'<p class="bad">{_esc(p["warning"])}</p>')
        if p.get("user_level"):
            out.append(
                "<p>client-level DP-FedAvg:</p>"
                + _table(["", ""], [[k, v] for k, v in p["user_level"].items()])
            )
        out.append(_dp_fields(r))
        mech = [[k, v.get("epsilon_max")] for k, v in p.get("mechanisms", {}).items()]
        out.append(_table(["mechanism", "max ε over clients"], mech))
        clients = [
            [c, v.get("epsilon"), ", ".join(f"{m}: {e:.3g}" for m, e in v["mechanisms"].items())]
            for c, v in p.get("clients", {}).items()
        ]
        out.append(
            "<details><summary>per client</summary>"
            + _table(["client", "ε", "per mechanism"], clients)
            + "</details>"
        )
    return ("<h2>Privacy ledger</h2>" + "".join(out)) if out else ""


def section_failures_and_time(runs: Sequence[RunData], palette: Mapping[str, str]) -> str:
    """Failed clients (each logged failure) and seconds per round."""
    out = ["<h2>Failures and timings</h2>"]
    for r in runs:
        if r.failures:
            rows = [
                [f["round"], f.get("client"), f.get("kind"), f.get("error")] for f in r.failures
            ]
            out.append(
                f"<h3>{_esc(r.label)}: {len(r.failures)} failures</h3>"
                + _table(["round", "client", "kind", "error"], rows[:200])
            )
        else:
            out.append(f"<p>{_esc(r.label)}: no client failed.</p>")
    series = _series(runs, "time_s")
    if any(series.values()):
        out.append(_img(plots.lines(series, "seconds per round", "s", palette), "time per round"))
    return "".join(out)


def section_items(runs: Sequence[RunData], shown: int = ITEMS_SHOWN) -> str:
    """A few held-out items with each run's answer and score, matched by item id."""
    with_items = [r for r in runs if r.items]
    if not with_items:
        return ""
    by_run = [{str(it.get("id")): it for it in r.items} for r in with_items]
    ids = [str(it.get("id")) for it in with_items[0].items]
    # Spread the shown items over domains: the first of each domain, then the next, ...
    order: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        order[str(by_run[0][i].get("domain", ""))].append(i)
    picked: list[str] = []
    while len(picked) < min(shown, len(ids)):
        for dom in list(order):
            if order[dom] and len(picked) < shown:
                picked.append(order[dom].pop(0))
    head = ["item", "domain", "prompt", "reference"] + [r.label for r in with_items]
    # The chat template's system turn opens every prompt: show what differs.
    shared = _common_prefix([str(by_run[0][i].get("prompt", "")) for i in picked])
    rows = []
    for i in picked:
        first = by_run[0][i]
        cells = [
            i,
            first.get("domain", ""),
            _short(str(first.get("prompt", ""))[len(shared) :], 300),
            _short(first.get("reference", ""), 200),
        ]
        for b in by_run:
            it = b.get(i)
            cells.append(
                f"{_short(it.get('answer', ''), 300)} [score {_num(it.get('score'))}]" if it else ""
            )
        rows.append(cells)
    return "<h2>Held-out items, side by side</h2>" + _table(head, rows, "items")


def _common_prefix(texts: Sequence[str]) -> str:
    """The longest string every text starts with (empty for fewer than two texts)."""
    if len(texts) < 2:
        return ""
    lo, hi = min(texts), max(texts)  # the common prefix of all is that of these two
    n = next((k for k, (a, b) in enumerate(zip(lo, hi, strict=False)) if a != b), len(lo))
    return lo[:n]


def _short(text: Any, n: int) -> str:
    s = str(text)
    return s if len(s) <= n else s[: n - 1] + "…"


STYLE = """
body{font-family:sans-serif;max-width:1100px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f2f2f2} .items td{max-width:260px;white-space:pre-wrap}
img.plot{display:block;margin:.5em 0;max-width:100%} pre{background:#f7f7f7;padding:.5em}
.ok{color:#05662e} .bad{color:#a00000;font-weight:bold} h2{border-bottom:1px solid #ddd}
"""


def render(runs: Sequence[RunData], title: str | None = None) -> str:
    """The whole page."""
    _labels(runs)
    palette = plots.colours(r.label for r in runs)
    title = title or "fedfm report: " + ", ".join(r.label for r in runs)
    body = [
        section_runs(runs),
        section_curves(runs, palette),
        section_breakdown(runs, palette),
        section_clients(runs, palette),
        section_audit(runs, palette),
        section_privacy(runs),
        section_failures_and_time(runs, palette),
        section_items(runs),
        section_lm_eval(runs),
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        # No request may leave the page: not even for a favicon.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "img-src data:; style-src 'unsafe-inline'\">"
        f'<link rel="icon" href="data:,"><title>{_esc(title)}</title><style>{STYLE}</style>'
        f"</head><body><h1>{_esc(title)}</h1>{''.join(body)}</body></html>"
    )


def write_html(run_dirs: Sequence[Path], out: Path, title: str | None = None) -> Path:
    """Writes the report of ``run_dirs`` to ``out`` (atomically) and returns its path."""
    page = render([load_run(Path(d)) for d in run_dirs], title)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


def write_run_report(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Writes ``report.html`` of a finished run into its folder."""
    page = render([load_run(run_dir, summary)])
    out = run_dir / REPORT
    tmp = out.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
