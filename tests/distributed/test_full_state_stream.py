"""``full_state_dict`` of offloaded tables streams their blocks through the device by rounds.

An offloaded table lives in host memory because it does not fit the device: assembling
it must not move a whole block (nor the world's blocks) to the device at once
(``dtrec.sharded.tables.tensor._assembled``, issue 31). With the round size cut to 4 KiB, a
2-rank world trains the device model and the 5%-cache model side by side (row-, column-
and table-wise, row-wise Adagrad) for 3 steps; the full weights and fused optimizer
states of both, assembled by rounds, must be bitwise equal, and no rank may send more
than 4 KiB in any gather of a table's data.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

ROUND_BYTES = 4096


def _assemble_by_rounds(rank: int, world: int) -> dict:
    import dtrec
    import dtrec.sharded.tables.tensor as tensor_module
    from tests.distributed.test_offload import _batches, _build, _differences, _state, _step

    tensor_module._STREAM_BYTES = ROUND_BYTES
    sent: list[int] = []
    varied, sized = tensor_module.all_gather_varied, tensor_module.all_gather_sized

    def record(data, kind) -> None:
        if kind == "full_tensor":
            sent.append(data.numel() * data.element_size())

    def recorded_varied(data, group, kind):  # a block streamed alone
        record(data, kind)
        return varied(data, group, kind)

    def recorded_sized(data, sizes, group, kind):  # small blocks gathered together
        record(data, kind)
        return sized(data, sizes, group, kind)

    tensor_module.all_gather_varied = recorded_varied
    tensor_module.all_gather_sized = recorded_sized
    mesh = dtrec.init_mesh("cpu", world)
    out = {}
    for kind in ("row_wise", "column_wise", "table_wise"):
        plain = _build(mesh, kind, "adagrad", {})
        cached = _build(mesh, kind, "adagrad", {"cache_fraction": 0.05})
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            kjt, target = _batches(gen)[rank]
            _step(*plain, kjt, target, False)
            _step(*cached, kjt, target, False)
        sent.clear()
        differ = _differences(_state(plain[0]), _state(cached[0]))
        out[kind] = {"differ": differ, "most": max(sent), "gathers": len(sent)}
    return out


@pytest.fixture(scope="module")
def assembled() -> list[dict]:
    return run_world(2, _assemble_by_rounds, timeout=900)


@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "table_wise"])
def test_full_state_of_offloaded_tables_streams_by_rounds(assembled, kind: str) -> None:
    for rank, per_rank in enumerate(assembled):
        got = per_rank[kind]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ"
        assert got["most"] <= ROUND_BYTES, got
        assert got["gathers"] > 20, got  # 3 tables of 2000-4000 rows: many rounds each
