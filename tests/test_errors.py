"""docs/errors.md is true: every row's error is raised, with that type and that message.

Each row of the doc carries an id (``E001``), the exception type and an example message
(``…`` marks elided text). ``tests/error_cases.py`` triggers each id; the test checks the
type by name and matches the message against the doc's example. Ids in the doc and in
the cases must agree, so neither can drift from the other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.error_cases import LOCAL, WORLD, WORLD_SIZE, message, run_world_cases
from tests.multiprocess import run_world

# Checkpoint cases save and load unsharded models without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
_ROW = re.compile(r"^\|\s*(E\d{3})\s*\|.*\|\s*(\w+)\s*\|\s*`(.+)`\s*\|\s*$")


@dataclass(frozen=True)
class Row:
    error_id: str
    exception: str
    example: str

    def matches(self, text: str) -> bool:
        pattern = ".*?".join(re.escape(part) for part in self.example.split("…"))
        return re.search(pattern, text, re.DOTALL) is not None


def doc_rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| E"):
            m = _ROW.match(line)
            assert m, f"docs/errors.md: malformed row {line!r}"
            assert m.group(1) not in rows, f"docs/errors.md: duplicate id {m.group(1)}"
            rows[m.group(1)] = Row(m.group(1), m.group(2), m.group(3))
    return rows


ROWS = doc_rows()


def test_every_row_has_a_case_and_every_case_a_row() -> None:
    assert not set(LOCAL) & set(WORLD)
    cases = set(LOCAL) | set(WORLD)
    assert sorted(set(ROWS) - cases) == [], "rows without a case in tests/error_cases.py"
    assert sorted(cases - set(ROWS)) == [], "cases without a row in docs/errors.md"


def check(row: Row, kind: str, text: str) -> None:
    assert kind == row.exception, f"{row.error_id}: raised {kind}: {text}"
    assert row.matches(text), f"{row.error_id}: message {text!r} != doc {row.example!r}"


@pytest.mark.parametrize("error_id", sorted(LOCAL))
def test_local(error_id: str, tmp_path: Path) -> None:
    row = ROWS[error_id]
    try:
        LOCAL[error_id](tmp_path)
    except Exception as exc:  # noqa: BLE001 - the type is checked against the doc
        check(row, type(exc).__name__, message(exc))
    else:
        pytest.fail(f"{error_id}: nothing raised (doc: {row.exception}: {row.example})")


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(WORLD_SIZE, run_world_cases, timeout=120)


@pytest.mark.parametrize("error_id", sorted(WORLD))
def test_world(error_id: str, world_results: list[dict]) -> None:
    row = ROWS[error_id]
    for rank in WORLD[error_id]:
        got = world_results[rank][error_id]
        assert got is not None, f"{error_id}: nothing raised on rank {rank}"
        check(row, *got)


def test_rejected_batch_changes_nothing_and_the_next_step_runs(world_results) -> None:
    for rank, r in enumerate(world_results):
        assert r["unchanged"], rank
        assert r["next_step"] is None, (rank, r["next_step"])
        assert r["updated"], rank


def test_refused_offloaded_batch_changes_nothing_and_the_next_step_runs(world_results) -> None:
    """A batch too big for a device cache (E323 / E324) fails on every rank before any
    weight changes; the next batch trains."""
    for rank, r in enumerate(world_results):
        assert r["offloaded_unchanged"], rank
        assert r["offloaded_next_step"] is None, (rank, r["offloaded_next_step"])


def test_e349_says_when_the_planner_chose_fully_sharded(monkeypatch) -> None:
    """E349 when ``distribute_module(plan=None, sync_every=k)`` finds the planner fully
    sharded a table (its replicated shard does not fit a rank's memory): the doc's message,
    then that the planner chose it and how to keep whole shards; nothing is built first.
    With room for the replicated shard the same call plans exact 2D and builds."""
    import os

    import dtrec
    from tests.fake_world import fake_world
    from tests.test_planner_fully_sharded import BIG, Model

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Topology.cpu(): memory per rank = RAM / LOCAL_WORLD_SIZE; 100 MB here, where BIG's
    # row-wise shard on S = 2 (132 MB) does not fit and its owner slice on R = 2 does
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(int(ram // 100e6)))
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 2)
        assert dtrec.plan(Model(BIG), mesh)["sparse.big"].fully_sharded  # the premise
        with pytest.raises(ValueError) as info:
            dtrec.distribute_module(Model(BIG), mesh, None, dtrec.optim.SGD(0.1), sync_every=2)
    text = message(info.value)
    check(ROWS["E349"], "ValueError", text.replace("'sparse.big'", "'t0'"))
    assert "the planner (plan=None" in text and "chose fully sharded 2D" in text
    assert "pin their specs (plan={'sparse.big': RowWise()}" in text
    assert "memory_per_rank=" in text
    # a pinned fully sharded table is the user's choice: E349 without the planner's part
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 2)
        pinned = {"sparse.big": dtrec.placements.RowWise(fully_sharded=True)}
        with pytest.raises(ValueError, match="use sync_every=None$"):
            dtrec.distribute_module(Model(BIG), mesh, pinned, dtrec.optim.SGD(0.1), sync_every=2)
