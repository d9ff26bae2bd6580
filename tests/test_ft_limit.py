"""``ft_ddp``'s all-reduce time limit: a survivor whose peer moved on without closing its connections
fails the all-reduce after the adaptive limit, not after the whole ``timeout`` (real gloo processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lplugins.strategies._ft_limit import FLOOR_S, AllreduceLimit
from tests._dist import ROOT, free_port

pytest.importorskip("torchft")


def test_the_limit_adapts_to_completed_all_reduces_within_the_floor_and_the_cap() -> None:
    limit = AllreduceLimit("auto", cap_s=30.0)
    assert limit.seconds() == 30.0  # nothing seen: the strategy's timeout
    for _ in range(5):
        limit.observe(0.01)
    assert limit.seconds() == FLOOR_S
    for _ in range(64):
        limit.observe(0.5)
    assert limit.seconds() == 5.0  # 10 x the median
    for _ in range(64):
        limit.observe(10.0)
    assert limit.seconds() == 30.0  # never above the timeout
    assert AllreduceLimit(0.25, cap_s=30.0).seconds() == 0.25


_GROUP = """
import json, sys, time
import torch
from datetime import timedelta
from torch.distributed import AllreduceOptions, TCPStore
from lplugins.strategies._ft_limit import AllreduceLimit, bounded_gloo

rank, port, bounded = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "bounded"
store = TCPStore("127.0.0.1", port, 3, rank == 0, wait_for_workers=False)
limit = AllreduceLimit("auto", cap_s=20.0)
if bounded:
    pg = bounded_gloo(20.0, limit)
else:
    from torchft import ProcessGroupGloo
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
pg.configure(f"127.0.0.1:{port}/quorum_1", f"replica_{rank}", rank, 3)
t = torch.ones(1000)
for _ in range(5):  # the steps all three groups took
    began = time.monotonic()
    pg.allreduce([t], AllreduceOptions()).wait()
    limit.observe(time.monotonic() - began)
if rank == 2:  # failed the step and moved on: alive, connections open, not in this all-reduce
    time.sleep(25)
else:
    limit_s = limit.seconds()  # 2 s (the floor) unless a loaded machine made the 5 all-reduces slower
    began = time.monotonic()
    try:
        pg.allreduce([t], AllreduceOptions()).wait()
        error = None
    except RuntimeError as err:
        error = str(err)
    print(json.dumps({"rank": rank, "waited_s": time.monotonic() - began, "error": error, "limit_s": limit_s}),
          flush=True)
"""


def _survivors(tmp_path: Path, mode: str) -> list[dict[str, object]]:
    script = tmp_path / "group.py"
    script.write_text(textwrap.dedent(_GROUP))
    port = free_port()
    argv = [[sys.executable, str(script), str(r), str(port), mode] for r in range(3)]
    procs = [subprocess.Popen(a, cwd=ROOT, stdout=subprocess.PIPE, text=True) for a in argv]
    try:
        out = [procs[r].communicate(timeout=40)[0] for r in (0, 1)]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [json.loads(line) for text in out for line in text.splitlines() if line.startswith("{")]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_survivor_fails_the_all_reduce_after_the_limit_not_the_timeout(tmp_path: Path) -> None:
    results = _survivors(tmp_path, "bounded")
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        limit_ms = float(result["limit_s"]) * 1000  # type: ignore[arg-type]
        assert limit_ms < 10_000, result  # 10x the median all-reduce, far below torchft's timeout here (20 s)
        waited = re.search(r"Timed out waiting (\d+)ms", str(result["error"]))
        assert waited and abs(int(waited.group(1)) - limit_ms) <= 1, result  # the limit, not the timeout
        assert float(result["waited_s"]) < 10.0, result  # type: ignore[arg-type]


def test_the_first_all_reduce_of_each_quorum_runs_under_the_timeout() -> None:
    """A group that just joined may take its first step slowly: each new quorum's first all-reduce gets the cap."""
    from datetime import timedelta

    from torch.distributed import AllreduceOptions, TCPStore

    from lplugins.strategies._ft_limit import bounded_gloo

    limit = AllreduceLimit("auto", cap_s=20.0)
    for _ in range(5):
        limit.observe(0.01)
    pg = bounded_gloo(20.0, limit)
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    timeouts = []
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{store.port}/quorum_{quorum}", "replica_0", 0, 1)
        for _ in range(2):
            timeouts.append(pg._opts_hook(AllreduceOptions()).timeout)
    assert timeouts == [timedelta(seconds=s) for s in (20.0, FLOOR_S, 20.0, FLOOR_S)]
