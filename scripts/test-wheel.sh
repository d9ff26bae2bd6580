#!/usr/bin/env bash
# The package as a user installs it, outside this clone: build the wheel and the sdist, install the wheel
# (non-editable, every extra) into a fresh virtual environment, then run the CLI, a smoke test and the demo
# from a directory that is not the clone. Then the sdist, into the same environment, and the smoke test again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m build --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel="$(ls "$work"/dist/lplugins-*.whl)"
sdist="$(ls "$work"/dist/lplugins-*.tar.gz)"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "torch==2.13.0"  # the CPU build first (a plain torch requirement pulls CUDA)
"$py" -m pip install --quiet "$wheel[deepspeed,demo]"
smoke="$PWD/scripts/smoke.py"
cd "$work"  # nothing of the clone on sys.path from here
"$work/venv/bin/lplugins" --version
"$py" -m lplugins list >/dev/null
"$py" -c "import lplugins, pathlib; assert 'site-packages' in lplugins.__file__, lplugins.__file__; assert (pathlib.Path(lplugins.__file__).parent / 'py.typed').exists()"
"$py" "$smoke" "$work/smoke"
"$work/venv/bin/lplugins" demo --epochs 2 --out "$work/demo" >"$work/demo.log" 2>&1 || { cat "$work/demo.log"; exit 1; }
test -s "$work/demo/demo.png"
"$py" -m pip install --quiet --no-deps --force-reinstall "$sdist"
"$py" "$smoke" "$work/smoke-sdist"
echo "wheel and sdist OK: $(basename "$wheel"), $(basename "$sdist")"
