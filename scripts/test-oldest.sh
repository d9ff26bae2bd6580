#!/usr/bin/env bash
# The oldest supported Lightning: a second virtual environment, .venv-oldest, with lightning==2.6.0
# (the lower end of pyproject.toml's range and of CHECKED_VERSIONS in src/lplugins/_lightning.py),
# then the Lightning-internals guard and a fast, representative subset of the unit tests under it.
# The newest supported Lightning is what scripts/test.sh installs in .venv and tests in full.
# The subset runs in-process tests only, on 2 pytest-xdist workers (LPLUGINS_TEST_WORKERS; 0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-oldest
OLDEST=2.6.0
if ! "$VENV/bin/python" -c "import lightning, lplugins, pytest, xdist, deepspeed, sys; sys.exit(lightning.__version__ != '$OLDEST')" 2>/dev/null; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch first: a plain `torch` requirement would pull a multi-GB CUDA build
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet "lightning==$OLDEST"
    "$VENV/bin/python" -m pip install --quiet -e ".[test,deepspeed]" "lightning==$OLDEST"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}"  # see scripts/test.sh
"$VENV/bin/python" -c "import lightning; print(f'lightning {lightning.__version__} (oldest supported)')"
# the guard first, then what touches Lightning most: composition, checkpoints, accumulation, rank zero
"$VENV/bin/python" -m pytest -q --timeout=300 -p no:cacheprovider -m "not distributed" \
    -n "${LPLUGINS_TEST_WORKERS:-2}" \
    tests/test_lightning_internals.py \
    tests/test_compose.py \
    tests/test_manager.py \
    tests/test_lightning_cli.py \
    tests/test_checkpoint.py \
    tests/test_checkpoint_io.py \
    tests/test_accumulation.py \
    tests/test_precision.py \
    tests/test_rankzero.py \
    tests/test_metrics.py \
    "$@"
