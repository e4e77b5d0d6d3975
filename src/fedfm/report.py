"""Plots of one run and comparison tables across runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fedfm import plots
from fedfm.core.runfolder import RunFolder, read_json, read_jsonl
from fedfm.errors import ConfigError

HEADLINE = ("acc", "macro_f1", "rmse", "rougeL", "score", "loss", "train_loss")


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` (a torn last line skipped; damage is one error naming it)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise ConfigError("run", f"{run_dir} has no metrics.jsonl: not a fedfm run folder")
    return read_jsonl(path)


def _numeric_keys(rows: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            # Counts and sizes are not metrics: they get no metric panel.
            count = k in ("round", "time_s", "failed", "failed_messages", "clients", "n")
            count = count or k.endswith("/n")
            skip = k in keys or count
            if not skip and isinstance(v, (int, float)) and not k.startswith("bytes"):
                keys.append(k)
    return keys


def plot_run(run_dir: Path) -> list[Path]:
    """Writes ``metrics.png`` (each metric vs round) and ``bytes.png`` into the run folder."""
    rows = read_rows(run_dir)
    keys = [k for k in _numeric_keys(rows) if "/" not in k or k.split("/")[0] in ("local", "test")]
    keys = keys[:12]
    out = []
    if keys:
        n = len(keys)
        cols = min(3, n)
        nrows = (n + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
        for ax, k in zip(axes.flat, keys, strict=False):
            pts = [(r["round"], r[k]) for r in rows if k in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
            ax.set_title(k)
            plots.integer_rounds(ax)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.tight_layout()
        out.append(run_dir / "metrics.png")
        fig.savefig(out[-1], dpi=90)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3))
    rounds = [r["round"] for r in rows]
    for key in ("bytes_up", "bytes_down"):
        ax.plot(rounds, [r.get(key, 0) / 2**20 for r in rows], marker="o", ms=3, label=key)
    plots.integer_rounds(ax)
    ax.set_ylabel("MiB (audit ledger)")
    ax.legend()
    fig.tight_layout()
    out.append(run_dir / "bytes.png")
    fig.savefig(out[-1], dpi=90)
    plt.close(fig)
    return out


def compare(run_dirs: list[Path], out: Path | None = None) -> str:
    """A markdown table of the runs' final metrics and bytes, plus a comparison plot.

    The table gives each run's GB up and down; ``bill.md`` beside ``compare.md`` gives each
    client's too (the communication bill, :func:`bill_table`).

    The table counts each run's failed clients (client failures over all rounds, from its
    summary), so a run that lost clients is not mistaken for one that did not. The plot
    shows the first run's primary metric against the round for the runs that log it; runs
    without it are left out of the plot and its legend.

    When every run kept its evaluated items, a second table gives each run's head-to-head win
    rate over the first run (:func:`fedfm.eval.compare.win_rate_table`).

    Args:
        run_dirs: Run folders.
        out: Where to write ``compare.png`` (and ``compare.md``); no files when None.

    Returns:
        The markdown table.
    """
    summaries = []
    for d in run_dirs:
        s = d / "summary.json"
        if not s.exists():
            raise ConfigError("run", f"{d} has no summary.json (unfinished or not a run folder)")
        summaries.append((d, read_json(s), read_rows(d)))
    cols = [k for k in HEADLINE if any(k in s["final"] for _, s, _ in summaries)]
    private = any("privacy" in s for _, s, _ in summaries)
    head = ["run", "algorithm", "rounds", *cols, "failed clients", "GB up", "GB down"]
    head += ["MiB up", "MiB down"]
    head += ["epsilon (delta)"] if private else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d, s, _ in summaries:
        vals = [f"{s['final'][c]:.4f}" if c in s["final"] else "" for c in cols]
        mib = [str(s.get("failed_clients", ""))]
        bill = _bill(s)
        mib += [f"{bill['gb_up']:.6f}", f"{bill['gb_down']:.6f}"]
        mib += [f"{s['bytes_up'] / 2**20:.2f}", f"{s['bytes_down'] / 2**20:.2f}"]
        if private:  # the run's epsilon from its privacy ledger; blank for a non-DP run
            p = s.get("privacy")
            mib.append(f"{p['epsilon']:.3g} ({p['delta']:g})" if p else "")
        lines.append(
            "| " + " | ".join([d.name, s["algorithm"], str(s["rounds"]), *vals, *mib]) + " |"
        )
    table = "\n".join(lines)
    for d, s, _ in summaries:  # a guarantee that does not hold against the server says so
        warning = (s.get("privacy") or {}).get("warning")
        if warning:
            table += f"\n\n{d.name}: {warning}."
    wins = None
    if all(RunFolder(d).items.exists() for d in run_dirs):  # runs whose task scored items
        from fedfm.eval.compare import win_rate_table  # torch: only for such runs

        wins = win_rate_table(run_dirs)
    if wins is not None:
        table += f"\n\nHead-to-head on the same held-out items (ties count half):\n\n{wins}"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(table + "\n")
        (out / "bill.md").write_text(bill_table([(d.name, s) for d, s, _ in summaries]) + "\n")
        primary = summaries[0][1]["primary"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for d, _, rows in summaries:
            pts = [(r["round"], r[primary]) for r in rows if primary in r]
            if pts:  # a run without the metric has no line, so no legend entry either
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=d.name)
        plots.integer_rounds(ax)
        ax.set_ylabel(primary)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "compare.png", dpi=90)
        plt.close(fig)
    return table


def _bill(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary's communication bill; a summary written before it had one: run totals."""
    if "comm" in summary:
        return summary["comm"]
    up, down = summary.get("bytes_up", 0), summary.get("bytes_down", 0)
    return {"gb_up": up / 1e9, "gb_down": down / 1e9, "per_client": {}}


def bill_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The communication bill as markdown: GB up and down per client and for each run."""
    lines = ["Communication (GB = 10^9 bytes, from the audit ledger):", ""]
    lines += ["| run | client | GB up | GB down |", "|---|---|---|---|"]
    for name, s in runs:
        bill = _bill(s)
        for cid, v in bill["per_client"].items():
            lines.append(f"| {name} | {cid} | {v['gb_up']:.6f} | {v['gb_down']:.6f} |")
        lines.append(f"| {name} | all | {bill['gb_up']:.6f} | {bill['gb_down']:.6f} |")
    return "\n".join(lines)


def default_out(run_dirs: list[Path]) -> Path:
    """Where ``fedfm report`` writes without ``--out``: ``compare/`` next to the first run."""
    return run_dirs[0].parent / "compare"
