"""Checks of key material on disk: private keys 600 in a 700 folder."""

from __future__ import annotations

import stat
from pathlib import Path


def mode(path: Path) -> int:
    """The permission bits of ``path`` (e.g. ``0o600``)."""
    return stat.S_IMODE(path.stat().st_mode)


def assert_key_modes(folder: Path) -> None:
    """Every private key in ``folder`` is 600, the folder 700, public files not writable by
    others."""
    assert mode(folder) == 0o700, oct(mode(folder))
    for p in folder.iterdir():
        if p.suffix == ".key":
            assert mode(p) == 0o600, f"{p.name}: {oct(mode(p))}"
        else:
            assert mode(p) & 0o022 == 0, f"{p.name}: {oct(mode(p))}"
