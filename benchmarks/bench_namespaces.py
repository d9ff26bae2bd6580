"""Two Lightning namespaces: what lplugins costs a process that does not use them.

1. Startup: ``import lightning.pytorch`` in a fresh interpreter with lplugins' ``lplugins_names.pth``
   (the ``LPLUGINS_AUTO_NAMES`` switch, off) processed at startup vs without it, every other ``.pth``
   of the environment processed in both (goal <= 1.01x). The two kinds of interpreter alternate.
2. ``import lplugins`` and ``lplugins.load()`` in fresh interpreters with both namespaces installed vs
   ``pytorch_lightning`` hidden (as if only ``lightning`` were installed), alternating (goal: no
   measurable change). Also whether ``load()`` imported ``pytorch_lightning``.
3. The same in a ``pytorch_lightning`` process (``import pytorch_lightning`` first): both installed vs
   ``lightning`` hidden, and whether ``load()`` imported ``lightning.pytorch``.

Run: ``.venv/bin/python benchmarks/bench_namespaces.py [--repeats N]``. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import time

PTH = "lplugins_names.pth"

# A site-packages directory processed like ``site`` does, except lplugins' switch when told to skip it.
STARTUP = f"""
import os, sys, time
t0 = time.perf_counter()
directory, skip = sys.argv[1], sys.argv[2] == "skip"
sys.path.append(directory)
for name in sorted(os.listdir(directory)):
    if not name.endswith(".pth") or (skip and name == {PTH!r}):
        continue
    for line in open(os.path.join(directory, name)):
        line = line.rstrip()
        if line.startswith("import ") or line.startswith("import\\t"):
            exec(line)
        elif line and not line.startswith("#") and os.path.exists(line):
            sys.path.append(line)
import lightning.pytorch
print(time.perf_counter() - t0)
"""

LOAD = """
import importlib, sys, time
used, other, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "hide":
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name == other or name.startswith(other + "."):
                raise ModuleNotFoundError(name)
    sys.meta_path.insert(0, Hide())
importlib.import_module(used)
t0 = time.perf_counter()
import lplugins
t1 = time.perf_counter()
lplugins.load()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, other in sys.modules)
"""
#: (the namespace the process uses, the top-level package of the other one)
PROCESSES = {
    "lightning": ("lightning.pytorch", "pytorch_lightning"),
    "pytorch_lightning": ("pytorch_lightning", "lightning"),
}


def _python(args: list[str], env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}
    ).stdout.strip()


def bench_startup(repeats: int) -> dict[str, float]:
    directory = next(d for d in site.getsitepackages() if os.path.exists(os.path.join(d, PTH)))
    times: dict[str, list[float]] = {"with": [], "without": []}
    env = {"LPLUGINS_AUTO_NAMES": ""}
    for i in range(repeats):
        for kind in ("with", "without") if i % 2 == 0 else ("without", "with"):
            out = _python(["-S", "-c", STARTUP, directory, "keep" if kind == "with" else "skip"], env)
            times[kind].append(float(out))
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    return {
        "startup_with_switch_off_s": round(with_s, 4),
        "startup_without_lplugins_pth_s": round(without_s, 4),
        "startup_ratio": round(with_s / without_s, 3),
        "startup_fastest_ratio": round(min(times["with"]) / min(times["without"]), 3),
    }


def bench_load(repeats: int, process: str = "lightning") -> dict[str, float | bool]:
    used, other = PROCESSES[process]
    runs: dict[str, list[tuple[float, float, bool]]] = {"both": [], "one": []}
    for i in range(repeats):
        for kind in ("both", "one") if i % 2 == 0 else ("one", "both"):
            out = _python(["-c", LOAD, used, other, "show" if kind == "both" else "hide"])
            imp, load, imported = out.split()
            runs[kind].append((float(imp), float(load), imported == "True"))

    def median(kind: str, index: int) -> float:
        return statistics.median(r[index] for r in runs[kind])  # type: ignore[misc]

    prefix = "" if process == "lightning" else "pl_process_"
    imports = "load_imports_pytorch_lightning" if process == "lightning" else "pl_process_load_imports_lightning"
    return {
        f"{prefix}import_both_installed_ms": round(1000 * median("both", 0), 2),
        f"{prefix}import_one_installed_ms": round(1000 * median("one", 0), 2),
        f"{prefix}import_ratio": round(median("both", 0) / median("one", 0), 3),
        f"{prefix}load_both_installed_ms": round(1000 * median("both", 1), 2),
        f"{prefix}load_one_installed_ms": round(1000 * median("one", 1), 2),
        f"{prefix}load_ratio": round(median("both", 1) / median("one", 1), 3),
        imports: any(r[2] for r in runs["both"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="fresh interpreters per variant")
    args = parser.parse_args()
    started = time.perf_counter()
    figures: dict[str, object] = {
        **bench_startup(args.repeats),
        **bench_load(args.repeats),
        **bench_load(args.repeats, "pytorch_lightning"),
    }
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(
        f"import lightning.pytorch with lplugins' switch off vs without it: {figures['startup_ratio']}x (median),"
        f" {figures['startup_fastest_ratio']}x (fastest); import lplugins with both namespaces installed vs one:"
        f" {figures['import_ratio']}x; load(): {figures['load_ratio']}x; load() imported pytorch_lightning:"
        f" {figures['load_imports_pytorch_lightning']}; in a pytorch_lightning process: import"
        f" {figures['pl_process_import_ratio']}x, load() {figures['pl_process_load_ratio']}x, load() imported"
        f" lightning: {figures['pl_process_load_imports_lightning']}"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
