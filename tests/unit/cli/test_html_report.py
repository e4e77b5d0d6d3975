"""The run report: one self-contained HTML page per run, and a comparison of several runs.

The browser test renders the page in headless Chromium (Debian's ``chromium``) with every
request sent to a closed loopback port (``--proxy-server``, no name resolution), reads the
DOM after load and Chromium's network log, and checks that the page asked for nothing: a
control page with one remote image shows that the check sees a request when there is one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedfm.cli import app
from fedfm.config import load_config
from fedfm.html_report import _baselines, load_run, render, undeclared
from fedfm.runtime import run


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    overrides = [f"out_dir={tmp_path}", f"name={name}", "train.steps=2", *extra]
    cfg = load_config("tabular-fedavg", [*overrides, "rounds=2", "threads=1"])
    run(cfg, progress=False)
    return tmp_path / name


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("runs")
    return _run(tmp, "fedavg"), _run(tmp, "prox", "algorithm=fedprox", "algo.mu=1.0")


def test_every_run_leaves_a_self_contained_report(two_runs: tuple[Path, Path]) -> None:
    page = (two_runs[0] / "report.html").read_text()
    for section in ("Runs", "Curves", "Clients", "Communication (audit ledger)", "Failures"):
        assert f"<h2>{section}" in page
    assert len(re.findall(r'<img class="plot"[^>]*src="data:image/png;base64,', page)) >= 4
    # Nothing to fetch: no remote or relative reference anywhere in the page.
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith("data:") for r in refs), refs
    assert "every field that crossed the wire is declared by fedavg" in page


def test_the_declared_fields_check_finds_an_undeclared_field(two_runs: tuple[Path, Path]) -> None:
    data = load_run(two_runs[0])
    assert undeclared(data) == []
    data.audit.append({**data.audit[-1], "direction": "up", "field": "secret", "type": "meta"})
    [problem] = undeclared(data)
    assert "field 'secret'" in problem and "not declared" in problem
    assert "secret" in render([data])


def test_report_html_compares_runs_through_the_command(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["report", *map(str, two_runs), "--html", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"html report written: {out / 'report.html'}" in res.output.replace("\n", "")
    page = (out / "report.html").read_text()
    # Both runs in the headline table and in the overlaid curves' legend.
    assert ">fedavg<" in page and ">prox<" in page and ">fedprox<" in page


def test_per_domain_breakdown_and_items_side_by_side(tmp_path: Path) -> None:
    """An LLM-style run: ``score/<domain>`` keys and ``eval_items.jsonl`` (hand-made files)."""
    runs = []
    for name, answers in (("base", ["no", "spam"]), ("tuned", ["yes", "ham"])):
        d = tmp_path / name
        d.mkdir()
        summary = {"name": name, "algorithm": "fedavg", "primary": "score", "rounds": 1}
        (d / "summary.json").write_text(json.dumps({**summary, "final": {}}))
        rows = [
            {"round": 0, "score": 0.4, "score/movie": 0.125, "score/spam": 0.625},
            {"round": 1, "score": 0.5, "score/movie": 0.25, "score/spam": 0.75},
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        items = [
            {"id": i, "domain": dom, "prompt": f"q{i}", "reference": "yes", "answer": a, "score": 1}
            for i, (dom, a) in enumerate(zip(("movie", "spam"), answers, strict=True))
        ]
        (d / "eval_items.jsonl").write_text(json.dumps({"round": 1, "items": items}) + "\n")
        runs.append(load_run(d))
    page = render(runs)
    assert "<h2>Breakdown by domain" in page
    # The untrained base (round 0) beside the last round, numbers written plainly.
    assert "<td>base, round 0</td><td>0.125</td><td>0.625</td>" in page
    assert "<td>tuned, round 1</td><td>0.25</td><td>0.75</td>" in page
    assert "<h2>Held-out items, side by side" in page
    assert "no [score 1]" in page and "yes [score 1]" in page


def test_plain_numbers_label_histograms_and_harness_scores(tmp_path: Path) -> None:
    d = tmp_path / "llm"
    d.mkdir()
    summary = {
        "name": "llm",
        "algorithm": "fedavg",
        "primary": "score",
        "rounds": 1,
        "final": {"score": 0.6666666},
        "wall_s_this_session": 161.88,
        "bytes_up": int(28.1252 * 2**20),
    }
    (d / "summary.json").write_text(json.dumps(summary))
    hist = {"acc": 0.25, "acc/qtype": 0.25, "majority/qtype": 0.3, "uniform/qtype": 1 / 6}
    hist |= {"bal_acc": 0.5, "bal_acc/qtype": 0.5}
    rows = [
        {"round": 0, **hist, "pred/qtype/abbreviation": 0.95, "pred/qtype/human": 0.05},
        {"round": 1, **hist, "pred/qtype/abbreviation": 0.1, "pred/qtype/human": 0.9},
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    harness = {"lm_eval": "0.4.13", "results": {"trec": {"acc": 0.35}}, "n_samples": {}}
    (d / "lm_eval.json").write_text(json.dumps(harness))
    page = render([load_run(d)])
    assert "<td>161.9 s</td>" in page and "<td>28.1 MiB</td>" in page
    assert "<td>0.6667</td>" in page and "161.8800" not in page
    # The histogram shows round 0's collapse onto one label beside the baselines.
    assert "<h3>Predicted labels" in page
    head = "<th>run</th><th>abbreviation</th><th>human</th><th>acc</th><th>balanced acc</th>"
    assert head + "<th>majority</th>" in page
    cells = "<td>0.95</td><td>0.05</td><td>0.25</td><td>0.5</td><td>0.3</td>"
    assert f"<td>llm, round 0</td>{cells}" in page
    # The accuracy chart draws both baselines; the balanced one, 1 / labels.
    run = load_run(d)
    assert _baselines([run], "acc", ["qtype"]) == {
        "majority class": [0.3],
        "uniform guess": [1 / 6],
    }
    assert _baselines([run], "bal_acc", ["qtype"]) == {"majority class or uniform": [1 / 6]}
    assert "<h2>lm-evaluation-harness" in page and "<td>trec</td><td>acc</td><td>0.35</td>" in page


def test_tensorboard_logging_writes_each_round(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run(tmp_path, "tb", "log.tensorboard=true")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "metrics/acc" in tags and "bytes/bytes_up" in tags
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [e.step for e in acc.Scalars("metrics/acc")]
    assert steps == [r["round"] for r in rows if "acc" in r]
    assert [e.value for e in acc.Scalars("bytes/bytes_up")] == [r["bytes_up"] for r in rows]


# ----------------------------------------------------------------------------- the browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Every request goes to a closed loopback port and no host name resolves, so nothing can
# leave the machine whatever the page or the browser asks for.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--no-pings",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
]


def _render(page: Path, tmp_path: Path) -> tuple[str, set[str]]:
    """The DOM after load, and the URLs the page (not the browser itself) requested."""
    assert CHROMIUM is not None
    netlog = tmp_path / f"{page.stem}-net.json"
    res = subprocess.run(
        [CHROMIUM, *FLAGS, f"--log-net-log={netlog}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    events = json.loads(netlog.read_text())["events"]
    # The browser's own background requests carry the initiator "not an origin"; a request
    # made by a page opened from a file carries its opaque origin "null".
    asked = {
        e["params"]["url"]
        for e in events
        if "url" in e.get("params", {})
        and e["params"].get("initiator") not in (None, "not an origin")
        and not e["params"]["url"].startswith(("data:", "file:"))
    }
    return res.stdout, asked


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_the_page_renders_in_chromium_and_asks_for_nothing(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    control = tmp_path / "control.html"
    control.write_text('<html><body><img src="http://127.0.0.1:9/probe.png"></body></html>')
    _, asked = _render(control, tmp_path)
    assert asked == {"http://127.0.0.1:9/probe.png"}  # the check sees a request

    dom, asked = _render(two_runs[0] / "report.html", tmp_path)
    assert asked == set()
    assert len(re.findall(r'<img class="plot"', dom)) >= 4
    assert dom.count("<table") >= 3 and "<h2>Communication (audit ledger)</h2>" in dom


def test_an_llm_run_keeps_its_items_and_shows_them(tmp_path: Path) -> None:
    from helpers.bases import INSTRUCTION
    from helpers.config import make_config

    cfg = load_config(make_config(INSTRUCTION, tmp_path, name="llm", rounds=1, plots=True))
    run(cfg, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "llm" / "eval_items.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert {"id", "domain", "prompt", "reference", "answer", "score"} <= set(rows[-1]["items"][0])
    page = (tmp_path / "llm" / "report.html").read_text()
    assert "<h2>Held-out items, side by side" in page and "<h2>Breakdown by domain" in page
