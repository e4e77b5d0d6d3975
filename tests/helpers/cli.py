"""The ``fedfm`` command run in the test process through its real entry point."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from fedfm import cli


def run_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> tuple[int, str, str]:
    """Runs ``fedfm ARGV`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fedfm", *argv])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err
