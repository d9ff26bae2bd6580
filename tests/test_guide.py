"""``docs/from-the-lightning-guide.md``: every counterpart of the seed guide's snippets is executed.

The page marks each counterpart with ``<!-- counterpart: ID (HOW) -->`` right before a ```python
block (the convention is stated at the top of the page). The blocks are run in a few batches, each
in a subprocess, so that the test process never holds a process group or changed env vars:

* ``cpu`` and ``composed``: one interpreter runs them all, one after the other;
* ``ddp``: one script runs them all on 2 processes started by Lightning's launcher (gloo);
* ``spawn``: each is its own script (``start_method="spawn"`` re-imports it);
* ``nodes:*``: a driver starts the runner twice, as two nodes; before each block the runner sets the
  variables a launcher would (``NODE_RANK``; ``SLURM_*``; Kubeflow's ``RANK``/``WORLD_SIZE``) and
  afterwards destroys the process group, so each block forms its own job.

Every block runs in a fresh namespace holding the prelude's names, in its own working directory, and
must finish without an exception on every process. ``test_counterpart[ID]`` fails for the block ID.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests._dist import free_port, run_script

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from-the-lightning-guide.md"
SEED = Path("/work/shared/seed/000_7024f505e072af6c.txt")

MARKER = re.compile(
    r"^<!-- counterpart: (?P<id>[a-z0-9-]+) \((?P<how>[a-z:]+)\) -->\n```python\n(?P<code>.*?)^```$",
    flags=re.M | re.S,
)
HOWS = ("prelude", "cpu", "composed", "ddp", "spawn", "nodes:standard", "nodes:slurm", "nodes:kubeflow")


def _blocks() -> list[dict[str, str]]:
    return [m.groupdict() for m in MARKER.finditer(PAGE.read_text())]


BLOCKS = _blocks()
PRELUDE = next((b["code"] for b in BLOCKS if b["how"] == "prelude"), "")
COUNTERPARTS = [b for b in BLOCKS if b["how"] != "prelude"]

# One runner for every batch. argv: spec.json, output directory, label ("local", "ddp", "node0", "node1").
RUNNER = r"""
import json, os, sys, traceback

spec = json.load(open(sys.argv[1]))
out_dir, label = sys.argv[2], sys.argv[3]
restore_env = label != "ddp"  # Lightning's launcher leaves LOCAL_RANK set on rank 0: later Trainers must see it
base_env = dict(os.environ)
prelude = {"__name__": "__main__"}
exec(compile(spec["prelude"], "<prelude>", "exec"), prelude)
results = {}


def rank():
    if label == "ddp":
        return os.environ.get("LOCAL_RANK", "0")
    return label


for block in spec["blocks"]:
    workdir = os.path.join(out_dir, "work", block["id"])
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    os.environ.update(block.get("env", {}).get(label, {}))
    print(f"=== {block['id']} ({label})", flush=True)
    try:
        exec(compile(block["code"], f"<counterpart {block['id']}>", "exec"), dict(prelude))
        results[block["id"]] = "ok"
    except BaseException:
        results[block["id"]] = traceback.format_exc()
        print(results[block["id"]], file=sys.stderr, flush=True)
    finally:
        if label.startswith("node"):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        if restore_env:
            os.environ.clear()
            os.environ.update(base_env)
    with open(os.path.join(out_dir, f"results-{rank()}.json"), "w") as f:
        json.dump(results, f)
"""

# Starts the runner twice, as two nodes, and waits for both.
NODES_DRIVER = r"""
import os, subprocess, sys
runner, spec, out = sys.argv[1:4]
env = {k: v for k, v in os.environ.items()
       if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
procs = [subprocess.Popen([sys.executable, runner, spec, out, f"node{n}"], env=env) for n in (0, 1)]
sys.exit(max(p.wait(timeout=280) for p in procs))
"""


def _node_env(how: str, node: int, port: int) -> dict[str, str]:
    kind = how.split(":", 1)[1]
    if kind == "standard":
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node)}
    if kind == "slurm":  # what srun sets for a 2-node allocation with one task per node
        return {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    if kind == "kubeflow":  # what a PyTorchJob sets in each pod
        return {
            "KUBERNETES_PORT": "tcp://10.0.0.1:443",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(node),
        }
    raise AssertionError(f"unknown nodes kind {how!r}")


class _Batches:
    """Runs each batch of blocks once; keeps what every process reported.

    The batches the selected tests need are started together, in threads (each is a subprocess
    waiting on its children), and each test waits for its own batch.
    """

    def __init__(self, base: Path, keys: set[str]) -> None:
        self.base = base
        self.pool = ThreadPoolExecutor(max_workers=max(len(keys), 1))
        self.futures = {key: self.pool.submit(self._run, key) for key in sorted(keys)}

    def run(self, key: str) -> tuple[dict[str, dict[str, str]], str]:
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self._run, key)
        return self.futures[key].result()

    def _spec(self, directory: Path, blocks: list[dict[str, Any]]) -> tuple[Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        spec = directory / "spec.json"
        spec.write_text(json.dumps({"prelude": PRELUDE, "blocks": blocks}))
        runner = directory / "runner.py"
        runner.write_text(RUNNER)
        return runner, spec

    def _collect(self, directory: Path) -> dict[str, dict[str, str]]:
        return {p.stem.split("-", 1)[1]: json.loads(p.read_text()) for p in directory.glob("results-*.json")}

    def _run(self, key: str) -> tuple[dict[str, dict[str, str]], str]:
        directory = self.base / key.replace(":", "-")
        blocks: list[dict[str, Any]]
        if key == "local":
            blocks = [b for b in COUNTERPARTS if b["how"] in ("cpu", "composed")]
            runner, spec = self._spec(directory, blocks)
            res = run_script(runner.read_text(), directory, timeout=300, args=[str(spec), str(directory), "local"])
        elif key == "ddp":
            blocks = [b for b in COUNTERPARTS if b["how"] == "ddp"]
            runner, spec = self._spec(directory, blocks)
            res = run_script(runner.read_text(), directory, timeout=300, args=[str(spec), str(directory), "ddp"])
        elif key == "nodes":
            blocks = []
            for b in COUNTERPARTS:
                if b["how"].startswith("nodes:"):
                    port = free_port()
                    env = {f"node{n}": _node_env(b["how"], n, port) for n in (0, 1)}
                    blocks.append({**b, "env": env})
            runner, spec = self._spec(directory, blocks)
            res = run_script(
                NODES_DRIVER, directory, timeout=300, args=[str(runner), str(spec), str(directory)], name="driver.py"
            )
        else:  # one spawn block
            block = next(b for b in COUNTERPARTS if b["id"] == key)
            directory.mkdir(parents=True, exist_ok=True)
            res = run_script(PRELUDE + "\n" + block["code"], directory, timeout=240, name="train.py")
            status = "ok" if res.returncode == 0 else f"exit {res.returncode}"
            return {"0": {key: status}}, res.stdout[-1000:] + res.stderr[-3000:]
        return self._collect(directory), res.stdout[-1000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def batches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Batches]:
    selected = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and item.path == Path(__file__) and "block" in callspec.params:
            selected.append(callspec.params["block"])
    runs = _Batches(tmp_path_factory.mktemp("guide"), {_batch_key(b) for b in selected})
    yield runs
    runs.pool.shutdown(wait=True)


EXPECTED_PROCESSES = {"cpu": ["local"], "composed": ["local"], "ddp": ["0", "1"], "spawn": ["0"]}


def _batch_key(block: dict[str, str]) -> str:
    how = block["how"]
    if how in ("cpu", "composed"):
        return "local"
    if how == "ddp":
        return "ddp"
    if how.startswith("nodes:"):
        return "nodes"
    return block["id"]


def _param(block: dict[str, str]) -> Any:
    marks = [pytest.mark.timeout(600)]
    if block["how"] not in ("cpu", "composed"):
        marks.append(pytest.mark.distributed)
    return pytest.param(block, id=block["id"], marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in COUNTERPARTS])
def test_counterpart(block: dict[str, str], batches: _Batches) -> None:
    results, output = batches.run(_batch_key(block))
    processes = EXPECTED_PROCESSES.get(block["how"], ["node0", "node1"])
    for process in processes:
        status = results.get(process, {}).get(block["id"], "did not run (the process ended before this block)")
        assert status == "ok", (
            f"counterpart {block['id']!r} ({block['how']}) failed on process {process}:\n{status}\n"
            f"--- output tail of the batch\n{output}"
        )


def test_page_follows_its_convention() -> None:
    text = PAGE.read_text()
    assert BLOCKS and BLOCKS[0]["how"] == "prelude", "the page must start with the prelude counterpart"
    assert [b["how"] for b in BLOCKS].count("prelude") == 1
    ids = [b["id"] for b in BLOCKS]
    assert len(ids) == len(set(ids)), "counterpart ids must be unique"
    for block in BLOCKS:
        assert block["how"] in HOWS, f"{block['id']}: unknown HOW {block['how']!r}; allowed: {HOWS}"
    # every marker is followed by a python block (a marker the regex missed would silently skip a check)
    assert text.count("<!-- counterpart:") == len(BLOCKS) + 1  # + the one in the explanation (a text block)
    # every section after the explanation has a counterpart that is executed
    sections = re.split(r"^## ", text, flags=re.M)[2:]
    for section in sections:
        title = section.splitlines()[0]
        if title in ("How the counterparts are checked", "The rest of the guide"):
            continue
        assert MARKER.search(section), f"section {title!r} has no executed counterpart"


def test_page_links_only_to_docs_pages() -> None:
    text = PAGE.read_text()
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("#"):
            anchor = target[1:]
            headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
            # Python-Markdown's toc slugify (what mkdocs renders): drop what is not a word character, space or
            # hyphen (backticks, colons, parentheses), then join the words with single hyphens
            slugs = {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}
            assert anchor in slugs, f"link to missing section {target!r}"
            continue
        assert "://" not in target, f"external link {target!r}: link only to pages in docs/"
        assert (PAGE.parent / target.split("#")[0]).is_file(), f"link to missing page {target!r}"


def _seed_snippets() -> list[str]:
    lines = [line[1:] if line.startswith("+") else line for line in SEED.read_text().splitlines()]
    return re.findall(r"^```\w*\n(.*?)^```", "\n".join(lines), flags=re.M | re.S)


def _norm(line: str) -> str:
    line = line.split("  #")[0].strip().replace("'", '"')
    return re.sub(r"\s+", " ", line)


def _key_line(snippet: str) -> str:
    for raw in snippet.splitlines():
        line = _norm(raw)
        if not line or line in ("{", "}", ")") or line.startswith(("import ", "from ", "class ", "def ", "return")):
            continue
        if line.startswith("#") and not line.startswith("#SBATCH"):
            continue
        if line.startswith(("super().", "python ", "trainer.fit(", "loss = ...")):
            continue
        return line
    return [_norm(raw) for raw in snippet.splitlines() if _norm(raw)][-1]  # e.g. "python train.py"


@pytest.mark.skipif(not SEED.is_file(), reason="the seed guide is not on this machine")
def test_every_guide_snippet_is_quoted() -> None:
    """Each of the guide's code blocks has a section on the page that quotes its first meaningful line."""
    page = "\n".join(_norm(line) for line in PAGE.read_text().splitlines())
    snippets = _seed_snippets()
    assert len(snippets) >= 30, "the seed guide changed: re-check the page against it"
    missing = [_key_line(s) for s in snippets if _key_line(s) not in page]
    assert not missing, "guide snippets without a section on the page (first meaningful line shown):\n" + "\n".join(
        missing
    )


if __name__ == "__main__":  # pragma: no cover - debugging aid: list the blocks
    for b in BLOCKS:
        print(b["id"], b["how"], file=sys.stderr)
