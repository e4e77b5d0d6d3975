"""The set-up script that ``make quickstart`` and ``make test`` run first (``scripts/setup.sh``)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
SETUP = ROOT / "scripts" / "setup.sh"


def test_the_uv_it_installs_is_the_one_the_resolve_keeps() -> None:
    """uv installs fedfm's dependencies, and uv is one of them (flwr's): a pin outside flwr's
    range would have the resolve replace the installer that is running it."""
    pinned = re.search(r"^UV_VERSION=(\S+)$", SETUP.read_text(), re.MULTILINE)
    assert pinned is not None
    wants = [Requirement(r) for r in importlib.metadata.requires("flwr") or []]
    uv = next(r for r in wants if r.name == "uv")
    assert uv.specifier.contains(pinned.group(1))


def test_torch_is_asked_for_at_the_version_pyproject_pins() -> None:
    """The script resolves torch's wheel through pip's configuration before uv sees fedfm's
    requirements: the two pins must be one."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert str(torch.specifier).startswith("==")
    assert f'"torch{torch.specifier}"' in SETUP.read_text()


def test_an_unknown_option_is_refused_in_one_line() -> None:
    proc = subprocess.run(
        ["bash", str(SETUP), "--tests"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["setup: unknown option '--tests' (the only one is --test)"]
