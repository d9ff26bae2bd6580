#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch, then lplugins with its test, deepspeed, demo, ray and ft extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# find_spec, not import: importing deepspeed prints its accelerator warning on every run
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('lplugins', 'pytest', 'xdist', 'deepspeed', 'matplotlib', 'tensorboard', 'build', 'mkdocstrings_handlers.python', 'material', 'hydra', 'pytorch_lightning', 'ray', 'torchft', 'isal')))" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # torch first: a plain `torch` requirement would pull a multi-GB CUDA build
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test,deepspeed,demo,ray,ft]"
fi
