"""``fedfm analyze RUN [RUN ...]``: FedSDR's analyses of finished runs, from their own files.

For each run (issue "FedSDR", point 5; the paper's figures beside ours in docs/fedsdr.md):

* **Answer distributions across clients, raw vs distilled**: mean pairwise Jensen-Shannon
  divergence and TF-IDF cosine (:mod:`fedfm.eval.compare`) between the clients' answers. The
  raw answers are each client's training data, rebuilt from the run's ``config.yaml``; the
  distilled ones are the kept rewrites in the clients' states of the run's last checkpoint
  (the experimenter's view of its simulated clients: none of it crossed the wire). A run
  without rewrites has the raw figures only.
* **Pairwise cosine between clients' updates** per round (``update_cos/mean`` and ``/min`` of
  ``metrics.jsonl``, logged when ``algo.update_cosines`` was on).
* **The rewrite paradox**: the round-0 statistics of FedSD (share of rewrites kept, the
  share of checked rewrites keeping the reference's answer, length ratio, filler-word rates).
* With several runs, the head-to-head win rate of each over the first on their shared items.

A path that is not a run folder is a config error naming ``run`` (one line, exit 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm.core.runfolder import read_jsonl
from fedfm.errors import ConfigError, FedfmError

REWRITE_KEYS = (
    ("fedsd/rows", "rows rewritten", 0),
    ("fedsd/kept_share", "rewrites kept", 3),
    ("fedsd/fallback_empty", "fallback: empty", 3),
    ("fedsd/fallback_truncated", "fallback: cut by the token limit", 3),
    ("fedsd/fallback_long_prompt", "fallback: prompt beyond the teacher's budget", 3),
    ("fedsd/fallback_leak", "fallback: leaked prompt", 3),
    ("fedsd/fallback_number", "fallback: final number changed (maths)", 3),
    ("fedsd/fallback_label", "fallback: label changed (classification)", 3),
    ("fedsd/fallback_reasoning", "fallback: chain of thought dropped (maths; rule of ours)", 3),
    ("fedsd/answer_kept", "checked rewrites keeping the reference's answer", 3),
    ("fedsd/length_ratio", "length ratio Σ words(ỹ) / Σ words(y), kept rewrites", 2),
    ("fedsd/filler_raw", "filler-word rate of the references (kept rows)", 4),
    ("fedsd/filler_distilled", "filler-word rate of the kept rewrites", 4),
)
DOMAIN_KEYS = (
    ("kept_share", "kept", 3),
    ("fallback_truncated", "cut", 3),
    ("fallback_long_prompt", "long prompt", 3),
    ("answer_kept", "answer kept", 3),
    ("length_ratio", "length ratio", 2),
)
"""Per-domain rewrite statistics (``fedsd/<key>/<domain>``) in the by-domain table."""
DISTRIBUTION_KEYS = (
    ("js_raw", "JS divergence, raw answers (bits)"),
    ("js_distilled", "JS divergence, distilled answers (bits)"),
    ("tfidf_raw", "TF-IDF cosine, raw answers"),
    ("tfidf_distilled", "TF-IDF cosine, distilled answers"),
)


@dataclass
class RunAnalysis:
    """What :func:`analyze_run` found in one run folder.

    Attributes:
        name: The run folder's name.
        distributions: ``js_raw``, ``tfidf_raw`` and, when the clients rewrote,
            ``js_distilled``, ``tfidf_distilled``; empty without a checkpoint.
        cosines: ``(round, mean, min)`` of the clients' update cosines, per logged round.
        rewrites: The round-0 rewrite statistics (``fedsd/...``); empty without rewrites.
        rewrites_by_domain: ``{domain: {key: value}}`` of :data:`DOMAIN_KEYS`.
        notes: Why a part is missing.
    """

    name: str
    distributions: dict[str, float] = field(default_factory=dict)
    cosines: list[tuple[int, float, float]] = field(default_factory=list)
    rewrites: dict[str, float] = field(default_factory=dict)
    rewrites_by_domain: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def check_run_folder(run: Path) -> None:
    """Refuses a path that is not a run folder (``config.yaml`` and ``metrics.jsonl``).

    Raises:
        ConfigError: Field ``run``.
    """
    if not run.is_dir():
        raise ConfigError("run", f"{run} is not a folder")
    for name in ("config.yaml", "metrics.jsonl"):
        if not (run / name).is_file():
            raise ConfigError("run", f"{run} is not a run folder (no {name})")


def client_answers(
    run: Path, cfg: Mapping[str, Any] | None = None
) -> tuple[dict[str, list[str]], dict[str, list[str]] | None]:
    """Each client's raw answers and, when it rewrote them, its distilled answers.

    Args:
        run: The run folder (its last checkpoint holds the clients' states).
        cfg: The run's config; ``None``: its ``config.yaml``.

    Returns:
        ``(raw, distilled)``; ``distilled`` is ``None`` when no client kept a distilled set.
        Rows whose rewrite fell back keep the reference in ``distilled``.

    Raises:
        FedfmError: The run has no checkpoint.
    """
    import yaml

    from fedfm.algorithms.fedsd import STATE_KEY
    from fedfm.config import load_config
    from fedfm.engine import resolve
    from fedfm.tasks.base import TASKS

    data = dict(cfg) if cfg is not None else yaml.safe_load((run / "config.yaml").read_text())
    run_cfg = load_config(data)
    _, task_cfg = resolve(run_cfg)
    task = TASKS.get(task_cfg.kind)(task_cfg, run_cfg)
    states = _client_states(run)
    raw: dict[str, list[str]] = {}
    dist: dict[str, list[str]] = {}
    rewrote = False
    for cid in task.client_ids():
        rows = task.client_data(cid).rows
        saved = states.get(cid, {}).get(STATE_KEY)
        kept = saved.get("outputs", {}) if isinstance(saved, dict) else {}
        rewrote |= isinstance(saved, dict)
        raw[cid] = [str(o) for o in rows["output"]]
        dist[cid] = [
            str(kept.get(str(i), o)) for i, o in zip(rows["id"], rows["output"], strict=True)
        ]
    return raw, (dist if rewrote else None)


def _client_states(run: Path) -> dict[str, Any]:
    folder = run / "checkpoints"
    latest = folder / "LATEST"
    if not latest.is_file():
        raise FedfmError(f"{run} has no checkpoint (no {latest})")
    meta = json.loads((folder / latest.read_text().strip() / "meta.json").read_text())
    clients = meta.get("clients", {})
    return clients if isinstance(clients, dict) else {}


def distribution_analysis(run: Path, cfg: Mapping[str, Any] | None = None) -> dict[str, float]:
    """JS divergence and TF-IDF cosine between clients' answers, raw (and distilled)."""
    from fedfm.eval.compare import js_divergence, tfidf_cosine

    raw, dist = client_answers(run, cfg)
    out = {"js_raw": js_divergence(raw), "tfidf_raw": tfidf_cosine(raw)}
    if dist is not None:
        out.update(js_distilled=js_divergence(dist), tfidf_distilled=tfidf_cosine(dist))
    return out


def update_cosine_rows(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, float]]:
    """``(round, mean, min)`` of every logged round with update cosines."""
    return [
        (int(r["round"]), float(r["update_cos/mean"]), float(r["update_cos/min"]))
        for r in rows
        if "update_cos/mean" in r and "update_cos/min" in r
    ]


def rewrite_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The round-0 rewrite statistics of a run's log rows (empty without rewrites)."""
    zero = next((r for r in rows if int(r.get("round", -1)) == 0), {})
    return {k: float(zero[k]) for k, _, _ in REWRITE_KEYS if k in zero}


def rewrite_stats_by_domain(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """``{domain: {key: value}}`` of the round-0 per-domain rewrite statistics."""
    zero = next((r for r in rows if int(r.get("round", -1)) == 0), {})
    out: dict[str, dict[str, float]] = {}
    for k, v in zero.items():
        head, _, domain = k.rpartition("/")
        key = head.removeprefix("fedsd/")
        if head.startswith("fedsd/") and "/" not in key and domain:
            out.setdefault(domain, {})[key] = float(v)
    return out


def analyze_run(run: Path) -> RunAnalysis:
    """Every analysis of one run folder (see the module doc).

    Raises:
        ConfigError: ``run`` is not a run folder.
    """
    check_run_folder(run)
    rows = read_jsonl(run / "metrics.jsonl")
    out = RunAnalysis(
        run.name,
        cosines=update_cosine_rows(rows),
        rewrites=rewrite_stats(rows),
        rewrites_by_domain=rewrite_stats_by_domain(rows),
    )
    try:
        out.distributions = distribution_analysis(run)
    except FedfmError as e:  # e.g. no checkpoint yet: the other parts still stand
        out.notes.append(f"answer distributions not measured: {e}")
    if not out.cosines:
        out.notes.append("no update cosines logged (algo.update_cosines was off)")
    if not out.rewrites:
        out.notes.append("no rewrites (FedSD was off)")
    return out


def _f(x: float | None, digits: int) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def format_analyses(runs: Sequence[RunAnalysis], wins: Sequence[str] = ()) -> str:
    """The analyses as markdown, one column per run."""
    names = [r.name for r in runs]
    lines = ["## Answer distributions across clients", ""]
    lines += _table(
        ["measure", *names],
        [[label, *(_f(r.distributions.get(k), 4) for r in runs)] for k, label in DISTRIBUTION_KEYS],
    )
    rounds = sorted({rnd for r in runs for rnd, _, _ in r.cosines})
    lines += ["", "## Pairwise cosine between clients' updates (mean / min over pairs)", ""]
    body = []
    for rnd in rounds:
        cells = []
        for r in runs:
            got = [(m, lo) for k, m, lo in r.cosines if k == rnd]
            cells.append(f"{got[0][0]:.4f} / {got[0][1]:.4f}" if got else "—")
        body.append([str(rnd), *cells])
    lines += _table(["round", *names], body) if body else ["No run logged update cosines."]
    lines += ["", "## Rewrite statistics (the rewrite paradox)", ""]
    lines += _table(
        ["statistic", *names],
        [[label, *(_f(r.rewrites.get(k), d) for r in runs)] for k, label, d in REWRITE_KEYS],
    )
    by_domain = [
        [r.name, d, *(_f(v.get(k), digits) for k, _, digits in DOMAIN_KEYS)]
        for r in runs
        for d, v in sorted(r.rewrites_by_domain.items())
    ]
    if by_domain:
        lines += ["", "## Rewrite statistics by domain (shares of the domain's rows)", ""]
        lines += _table(["run", "domain", *(label for _, label, _ in DOMAIN_KEYS)], by_domain)
    if wins:
        lines += ["", "## Head to head (each run over the first)", "", *wins]
    notes = [f"- {r.name}: {n}" for r in runs for n in r.notes]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def analyze(runs: Sequence[Path]) -> str:
    """``fedfm analyze``'s output for ``runs`` (every path checked before any work)."""
    if not runs:
        raise ConfigError("run", "give at least one run folder")
    for run in runs:
        check_run_folder(run)
    found = [analyze_run(run) for run in runs]
    wins: list[str] = []
    if len(runs) > 1:
        from fedfm.eval.compare import win_rate_table

        table = win_rate_table(list(runs))
        wins = table.splitlines() if table else ["The runs share no evaluated item."]
    return format_analyses(found, wins)
