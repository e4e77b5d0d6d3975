"""The ``fedfm`` command answers without importing the heavy libraries it does not need.

Each command runs in a fresh interpreter that reports, on exit, which heavy modules were
imported (``sys.modules``): the help, ``fedfm list``, ``fedfm report`` and the refusals that
the command line, the run config or the TLS files decide must import none of torch,
transformers or flwr. Their start times are ``benchmarks/cli_start.py``'s figures. ``fedfm
list`` reads a manifest of the registries; it must still equal the registries themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedfm import catalog
from helpers import REPO

SRC = REPO / "src"
HEAVY = ("torch", "transformers", "flwr", "peft", "datasets", "sklearn")

# Runs `fedfm ARGV` through the entry point and writes the heavy modules it imported.
PROBE = """
import atexit, json, sys
report, *argv = sys.argv[1:]
heavy = {heavy!r}
atexit.register(lambda: open(report, "w").write(json.dumps(
    sorted(m for m in heavy if m in sys.modules))))
sys.argv = ["fedfm", *argv]
from fedfm.cli import main
main()
"""


def imported(tmp_path: Path, *argv: str) -> tuple[int, list[str], str]:
    """``(exit code, heavy modules imported, stderr)`` of ``fedfm ARGV`` in a new process."""
    report = tmp_path / "imported.json"
    report.unlink(missing_ok=True)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), str(report), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    return out.returncode, json.loads(report.read_text()), out.stderr


def _run_folder(folder: Path) -> Path:
    """The two files ``fedfm report`` reads, as a finished run writes them."""
    folder.mkdir(parents=True)
    summary = {"name": folder.name, "algorithm": "fedavg", "rounds": 1, "primary": "acc",
               "final": {"acc": 0.5}, "bytes_up": 10, "bytes_down": 20}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"round": 0, "acc": 0.4}, {"round": 1, "acc": 0.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _key(tmp_path: Path) -> Path:
    from fedfm.runtime.flower.tls import make_node_key

    return make_node_key(tmp_path / "keys", "node0")[0]


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["serve", "--help"], 0),
        (["client", "--help"], 0),
        (["eval", "--help"], 0),
        (["reproduce", "--help"], 0),
        (["list"], 0),
        (["run", "tabular-fedavg", "train.lr=-1"], 2),
        (["serve", "tabular-fedavg", "rounds=-1", "--insecure"], 2),
        (["serve", "tabular-fedavg", "--certificates", "missing"], 2),
        (["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"], 2),
        (["flower-certs", "out", "--days", "0"], 2),
    ],
)
def test_the_command_line_answers_without_torch_transformers_or_flwr(tmp_path, argv, code):
    got, heavy, err = imported(tmp_path, *argv)
    assert got == code, err
    assert heavy == [], f"fedfm {' '.join(argv)} imported {heavy}"


def test_report_and_a_client_refusal_import_none_of_them(tmp_path):
    runs = [_run_folder(tmp_path / "runs" / n) for n in ("a", "b")]
    code, heavy, err = imported(tmp_path, "report", *map(str, runs), "--out", str(tmp_path / "c"))
    assert code == 0 and heavy == [], (heavy, err)
    assert (tmp_path / "c" / "compare.png").exists()
    client = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    code, heavy, err = imported(tmp_path, *client, "--insecure", "--auth-key", str(_key(tmp_path)))
    assert code == 2 and heavy == [] and "node authentication needs TLS" in err


def test_the_list_manifest_equals_the_registries():
    """``catalog.json`` is what the registries hold (after a registration changed, write it
    again with ``python -m fedfm.catalog``). Built in a new process: tests register plugins
    (a toy task, test algorithms) in this one."""
    code = "import json; from fedfm import catalog; print(json.dumps(catalog.build()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        check=True,
    )
    assert catalog.load() == json.loads(out.stdout), (
        "src/fedfm/catalog.json is out of date: run `python -m fedfm.catalog`"
    )
