#!/usr/bin/env bash
# The test command: lint, type-check, then the test suite (every test has a timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner on every build
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/mkdocs build --strict --site-dir "${TMPDIR:-/tmp}/lplugins-site"  # not --quiet: it drops the warnings strict mode counts
.venv/bin/python -m pytest -q --timeout=300 -p no:cacheprovider "$@"
