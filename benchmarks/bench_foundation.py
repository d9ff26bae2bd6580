"""Foundation benchmarks, side by side with stock Lightning in the same run.

1. ``import lplugins`` on top of ``import lightning`` (fresh interpreters, median of N), bytecode cached as
   an install leaves it.
2. Discovery and registration of 100 generated, installed entry-point plugins, beyond importing
   their modules (median of N).
3. Per-step time (CPU time of the training thread) of a Trainer built through ``lplugins.compose``
   vs the stock Trainer on a BoringModel, interleaved runs in alternating order, median step time.

Run: ``.venv/bin/python benchmarks/bench_foundation.py``. The last line is JSON.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPEATS = 7


def _run(code: str, *paths: str, env: dict[str, str] | None = None) -> str:
    import os

    full_env = dict(os.environ if env is None else env)
    if paths:
        full_env["PYTHONPATH"] = ":".join(paths)
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, env=full_env).stdout.strip()


def _bytecode_env() -> dict[str, str]:
    """Bytecode written and read as in any normal install (pip compiles it; Lightning's is cached).

    ``PYTHONDONTWRITEBYTECODE`` (set on some machines, this one included) would otherwise make an
    editable checkout compile every lplugins module in every interpreter while Lightning's are cached:
    about 30 ms more, which no installed user pays. lplugins' ``__pycache__`` is written once, first.
    """
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}


def bench_import() -> dict[str, float]:
    code = textwrap.dedent(
        """
        import time
        t0 = time.perf_counter(); import lightning.pytorch; t1 = time.perf_counter()
        import lplugins; t2 = time.perf_counter()
        lplugins.load(); t3 = time.perf_counter()
        import sys
        heavy = [m for m in ('deepspeed', 'ray', 'torchft', 'pytorch_lightning') if m in sys.modules]
        print(t1 - t0, t2 - t1, t3 - t2, ','.join(heavy) or '-')
        """
    )
    env = _bytecode_env()
    _run(code, env=env)  # writes lplugins' bytecode, as an install does
    lightning, extra, load, both = [], [], [], []
    for _ in range(REPEATS):
        a, b, c, heavy = _run(code, env=env).split()
        assert heavy == "-", f"import lplugins + load() imported {heavy}"
        lightning.append(float(a))
        extra.append(float(b))
        load.append(float(c))
        both.append(float(b) + float(c))
    return {
        "import_lightning_ms": 1000 * statistics.median(lightning),
        "import_lplugins_extra_ms": 1000 * statistics.median(extra),
        "load_builtins_ms": 1000 * statistics.median(load),
        "import_and_load_extra_ms": 1000 * statistics.median(both),
        "import_and_load_extra_ratio": statistics.median(both) / statistics.median(lightning),
    }


def _make_plugins(site: Path, n: int) -> None:
    for i in range(n):
        mod = site / f"bench_plugin_{i:03d}.py"
        mod.write_text(
            textwrap.dedent(
                f"""
                def _factory(**kw):
                    from lightning.pytorch.strategies import DDPStrategy
                    return DDPStrategy(**kw)

                def lplugins_register_strategies(register):
                    register("bench_ddp_{i:03d}", _factory, description="generated")

                def lplugins_register_callbacks(register):
                    register("bench_cb_{i:03d}", _factory, description="generated")
                """
            )
        )
        dist = site / f"bench_plugin_{i:03d}-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bench-plugin-{i:03d}\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(f"[lplugins]\nbench{i:03d} = bench_plugin_{i:03d}\n")


def bench_discovery(n: int = 100) -> dict[str, float]:
    code = textwrap.dedent(
        f"""
        import gc, importlib, time
        import lightning.pytorch, lplugins
        from lplugins import PluginManager
        # a full collection over torch's and Lightning's heap costs ~140 ms here; start each timed part
        # with fresh GC counters so that one does not land, by chance, in one of them
        gc.collect()
        t0 = time.perf_counter(); m0 = PluginManager().load(autoload=False); t1 = time.perf_counter(); m0.close()
        gc.collect()
        t2 = time.perf_counter()
        for i in range({n}):
            importlib.import_module(f"bench_plugin_{{i:03d}}")
        t3 = time.perf_counter()
        gc.collect()
        t4 = time.perf_counter(); m = PluginManager().load(); t5 = time.perf_counter()
        assert len([p for p in m.plugins() if not p.builtin]) == {n}, m.plugins()
        print(t1 - t0, t3 - t2, t5 - t4)
        """
    )
    builtins_only, imports, with_plugins = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        _make_plugins(Path(tmp), n)
        for _ in range(REPEATS):
            a, b, c = _run(code, tmp).split()
            builtins_only.append(float(a))
            imports.append(float(b))
            with_plugins.append(float(c))
    return {
        "discovery_plugins": n,
        "discovery_module_import_ms": 1000 * statistics.median(imports),
        "discovery_registration_beyond_import_ms": 1000
        * (statistics.median(with_plugins) - statistics.median(builtins_only)),
    }


def bench_steps(steps: int = 400, rounds: int = 8) -> dict[str, float]:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lplugins

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        # CPU time of the training thread: on a shared 2-core machine wall time swings by 20 % between two
        # identical stock runs; thread time does not count the time other processes took the core
        def on_train_batch_start(self, *args: object) -> None:
            self._t = time.thread_time()

        def on_train_batch_end(self, *args: object) -> None:
            self.times.append(time.thread_time() - self._t)

    common = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    stock_t, composed_t = [], []
    for i in range(rounds):
        order = ("stock", "composed") if i % 2 == 0 else ("composed", "stock")  # alternate: no order bias
        for which in order:
            timer = StepTimer()
            kwargs = dict(common, callbacks=[timer])
            if which == "composed":
                kwargs = lplugins.compose(**kwargs, precision="auto")
            pl.Trainer(**kwargs).fit(BoringModel())
            median = statistics.median(timer.times[50:])
            (stock_t if which == "stock" else composed_t).append(median)
    stock, composed = statistics.median(stock_t), statistics.median(composed_t)
    return {"step_stock_us": 1e6 * stock, "step_composed_us": 1e6 * composed, "step_ratio": composed / stock}


def main() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    figures: dict[str, float] = {}
    figures.update(bench_import())
    print(f"import: {figures}", file=sys.stderr)
    figures.update(bench_discovery())
    print(f"discovery: {figures}", file=sys.stderr)
    figures.update(bench_steps())
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
