"""The README's and the docs pages' ```python blocks run, or say why they do not.

Every ```python block in README.md and docs/*.md is preceded (on the line right above it)
by one of:

* ``<!-- run: world=N -->``: a whole script, as launched by ``torchrun --nproc-per-node N``
  (it calls ``init_process_group`` itself); run on CPU in an N-rank gloo world.
* ``<!-- run: after=readme world=N -->``: a fragment that continues the README's usage
  example: it runs in a copy of that example's namespace (``Model``, ``mesh``, ``plan``...).
* ``<!-- not-run: why -->``: a fragment that needs what a page only names (a TorchRec
  model, a data loader, a checkpoint directory).

A block with none of these fails ``test_every_block_is_run_or_marked``. The runnable blocks
of one world size run in one launch of N plain processes with torchrun's environment
(a launch costs a few seconds here: process start and ``import torch``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!--\s*(run|not-run)\s*:\s*(.*?)\s*-->\s*$")
README_MAX_LINES = 200
LAUNCH_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repo root
    line: int  # 1-based line of the opening fence
    source: str
    marker: tuple[str, str] | None  # ("run" | "not-run", its arguments)

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown page, each with the marker on the line above."""
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{path}:{i + 1}: unclosed ```python block"
            m = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            blocks.append(
                Block(
                    page=str(path.relative_to(ROOT)),
                    line=i + 1,
                    source="\n".join(lines[i + 1 : end]) + "\n",
                    marker=(m.group(1), m.group(2)) if m else None,
                )
            )
            i = end
        i += 1
    return blocks


def run_args(block: Block) -> dict[str, str]:
    """``world=2 after=readme`` -> {"world": "2", "after": "readme"}; checks the keys."""
    args = dict(kv.split("=", 1) for kv in block.marker[1].split())
    assert set(args) <= {"world", "after"}, f"{block.label}: unknown run option in {args}"
    assert args.get("after", "readme") == "readme", f"{block.label}: after= must be readme"
    assert int(args.get("world", "1")) >= 1, f"{block.label}: world= must be >= 1"
    return args


ALL_BLOCKS = [b for page in PAGES for b in python_blocks(page)]


def test_every_block_is_run_or_marked():
    unmarked = [b.label for b in ALL_BLOCKS if b.marker is None]
    assert not unmarked, (
        "```python blocks without a <!-- run: ... --> or <!-- not-run: why --> line right "
        f"above them: {unmarked}"
    )
    no_reason = [b.label for b in ALL_BLOCKS if b.marker == ("not-run", "")]
    assert not no_reason, f"<!-- not-run: --> without a reason: {no_reason}"
    for b in ALL_BLOCKS:
        if b.marker[0] == "run":
            run_args(b)


def test_readme_is_short_and_its_examples_run_here():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
    readme = [b for b in ALL_BLOCKS if b.page == "README.md"]
    assert readme, "README.md has no ```python block"
    assert all(b.marker[0] == "run" for b in readme), "every README example must run"


# The script each rank runs: the blocks in order, each under its label, a fragment in a
# copy of the README example's namespace. Exits 1 with the failing block's label.
_RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.argv[1])
base = None
for b in blocks:
    if b["after"]:
        assert base is not None, b["label"] + ": after=readme, but the README example has not run"
        ns = dict(base)
    else:
        ns = {"__name__": "__main__"}
    try:
        exec(compile(b["source"], b["label"], "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print("EXAMPLE FAILED: " + b["label"], file=sys.stderr)
        sys.exit(1)
    if b["page"] == "README.md" and not b["after"] and base is None:
        base = ns
print("EXAMPLES OK", len(blocks))
import torch.distributed as dist
if dist.is_initialized():  # else gloo's threads may abort the exit when a peer left first
    dist.barrier()
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, blocks: list[dict]) -> None:
    """Run the blocks on ``world`` CPU processes with torchrun's environment."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "",  # the CPU launch line, whatever the machine
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RUNNER, json.dumps(blocks)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of {world} failed:\n{out[-6000:]}"


def _runnable_by_world() -> dict[int, list[dict]]:
    """Runnable blocks grouped by world size, README first, identical scripts run once."""
    groups: dict[int, list[dict]] = {}
    seen: set[tuple[int, str, bool]] = set()
    for b in sorted(ALL_BLOCKS, key=lambda b: b.page != "README.md"):
        if b.marker is None or b.marker[0] != "run":
            continue
        args = run_args(b)
        world, after = int(args.get("world", "1")), "after" in args
        if (world, b.source, after) in seen:
            continue  # e.g. docs/usage.md repeats the README's example
        seen.add((world, b.source, after))
        groups.setdefault(world, []).append(
            {"label": b.label, "page": b.page, "source": b.source, "after": after}
        )
    return groups


@pytest.mark.parametrize("world", sorted(_runnable_by_world()))
def test_examples_run(world):
    _launch(world, _runnable_by_world()[world])
