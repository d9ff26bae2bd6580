#!/usr/bin/env bash
# The main job: set up, then run the lplugins demo (see README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lplugins demo "$@"
