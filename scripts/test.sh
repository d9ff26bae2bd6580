#!/usr/bin/env bash
# The test command: lint, type-check, docs build, then the test suite (every test has a timeout).
#
#   bash scripts/test.sh            the default tier (what CI runs): every test but those marked `extended`
#   bash scripts/test.sh --all      every test (also: LPLUGINS_TESTS=all)
#   bash scripts/test.sh ARGS...    extra pytest arguments (a path, -k ...), given to both lanes below
#
# Two lanes at once: the multi-process tests (marked `distributed`), one at a time, and beside them,
# at a lower CPU priority, the checks and then the in-process tests (their output follows when both are done). Two 2-process
# jobs at once on a 2-core machine would starve each other's ranks (watchdogs and store timeouts measure
# wall time); one lane of in-process tests at `nice` only takes what the ranks leave.
# `extended` marks costly variants of behaviour a default-tier test already covers (docs/architecture.md,
# "Tests and tiers").
set -euo pipefail
cd "$(dirname "$0")/.."
tier="${LPLUGINS_TESTS:-default}"
if [ "${1:-}" = "--all" ]; then
    tier=all
    shift
fi
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# DeepSpeed JIT-builds its CPU ops (shm_comm) once; the default shared cache is rebuilt whenever another
# environment (another clone, .venv-oldest) built it last, so each environment keeps its own
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life banner on every build
# the ops are built (about 1.5 CPU-minutes on a fresh .venv, a no-op after) from the start, not in the first
# DeepSpeed test's timeout (one that comes first waits for the build's lock); a failure here shows up in the
# DeepSpeed tests themselves
.venv/bin/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 &
prebuild=$!
tiered=" and not extended"
if [ "$tier" = all ]; then
    tiered=""
fi
pytest=(.venv/bin/python -m pytest -q --timeout=300 -p no:cacheprovider)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# The second lane, at a lower CPU priority: the checks (lint, types, the strict docs build: not --quiet, which
# drops the warnings strict mode counts), then the in-process tests. The multi-process lane below is the
# longest, so it starts at once instead of after the checks.
(
    renice -n 10 -p "$BASHPID" >/dev/null
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
    "${pytest[@]}" -m "not distributed$tiered" "$@"
) >"$log" 2>&1 &
lane=$!
echo "== multi-process tests (the in-process tests run beside them; their output follows)"
rc_dist=0
"${pytest[@]}" -m "distributed$tiered" --durations=10 "$@" || rc_dist=$?
rc_local=0
wait "$lane" || rc_local=$?
wait "$prebuild" || true
echo "== checks and in-process tests"
cat "$log"
# 5 is pytest's "no test selected": fine for one lane (a path of only one kind), not for both
if [ "$rc_dist" = 5 ] && [ "$rc_local" = 5 ]; then
    exit 5
fi
for rc in "$rc_dist" "$rc_local"; do
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
        exit "$rc"
    fi
done
