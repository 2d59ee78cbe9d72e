"""Every wrapper of dtrec._torch_compat, called for real: a torch upgrade that moves a
private API dtrec relies on fails here, by name, before anything else does."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from dtrec import _torch_compat as compat

DTREC = Path(__file__).resolve().parent.parent / "dtrec"


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    compat.init_fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def gloo_world_of_one() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("x",))
    finally:
        dist.destroy_process_group()


def test_fake_process_group_and_default_store() -> None:
    with fake_world(5, 8):
        assert (dist.get_rank(), dist.get_world_size()) == (5, 8)
        store = compat.default_store()
        store.set("dtrec/test", "ok")
        assert store.get("dtrec/test") == b"ok"
    assert not dist.is_initialized()


def test_mesh_flatten_concatenate_and_root() -> None:
    with fake_world(6, 8):
        root = DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2), mesh_dim_names=("a", "b", "r"))
        assert compat.root_mesh(root) is root
        flat = compat.flatten_mesh_dims(root["a", "b"], "ab")
        assert flat.mesh_dim_names == ("ab",) and flat.size() == 4
        view = compat.concatenate_meshes([flat, root["r"]])
        assert view.mesh_dim_names == ("ab", "r")
        assert view.mesh.tolist() == torch.arange(8).reshape(4, 2).tolist()
        assert tuple(view.get_coordinate()) == (3, 0)
        assert dist.get_process_group_ranks(view.get_group("ab")) == [0, 2, 4, 6]
        assert dist.get_process_group_ranks(view.get_group("r")) == [6, 7]
        assert compat.root_mesh(view) is root and compat.root_mesh(flat) is root
        split = compat.unflatten_mesh_dim(flat, "ab", (4, 1), ("s", "one"))
        assert split.mesh_dim_names == ("s", "one") and split.mesh.shape == (4, 1)
        assert compat.root_mesh(split) is root


def test_local_shape_and_offset() -> None:
    with fake_world(3, 4):
        mesh = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("x",))
        assert compat.local_shape_and_offset((11, 6), mesh, [Shard(0)]) == ((2, 6), (9, 0))
        assert compat.local_shape_and_offset((11, 6), mesh, [Shard(1)]) == ((11, 0), (0, 6))


def test_queue_backward_callback_runs_when_backward_ends() -> None:
    events: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: compat.queue_backward_callback(lambda: events.append("end")) or g)
    x.register_hook(lambda g: events.append("leaf grad") or g)
    y.sum().backward()
    assert events == ["leaf grad", "end"]


def test_current_backward_id_tells_backward_calls_apart() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(compat.current_backward_id())
            return grad

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    Probe.apply(x).sum().backward()
    assert compat.current_backward_id() == -1
    assert len(seen) == 2 and min(seen) >= 0 and seen[0] != seen[1]


def test_dtensor_with_layout_keeps_the_given_stride() -> None:
    with gloo_world_of_one() as mesh:
        local = torch.arange(6.0).view(2, 3)
        d = compat.dtensor_with_layout(local, mesh, [Shard(1)], (2, 3), (3, 1))
        assert isinstance(d, DTensor) and d.stride() == (3, 1) and d.placements == (Shard(1),)
        assert d.to_local().data_ptr() == local.data_ptr()


def test_sharded_tensor_assembled_and_recognised() -> None:
    """A one-rank ShardedTensor of two row shards (TorchRec's state-dict values)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    full = torch.arange(12.0).view(4, 3)
    with gloo_world_of_one():
        shards = [
            Shard(full[0:1].clone(), ShardMetadata([0, 0], [1, 3], "rank:0/cpu")),
            Shard(full[1:4].clone(), ShardMetadata([1, 0], [3, 3], "rank:0/cpu")),
        ]
        sharded = init_from_local_shards(shards, 4, 3)
        assert compat.is_sharded_tensor(sharded) and not compat.is_sharded_tensor(full)
        assert torch.equal(compat.sharded_tensor_full(sharded), full)


def test_op_argument_names() -> None:
    assert compat.op_argument_names(torch.ops.aten.add.Tensor) == ["self", "other", "alpha"]


def test_contiguous_dtensor_and_implicit_replication() -> None:
    with gloo_world_of_one() as mesh:
        local = torch.arange(12.0).view(4, 3)
        made = compat.contiguous_dtensor(local, mesh, [Shard(0)], (4, 3))
        assert isinstance(made, DTensor) and made.placements == (Shard(0),)
        assert made.shape == (4, 3) and made.stride() == (3, 1)
        assert made.to_local().data_ptr() == local.data_ptr() and not made.requires_grad
        assert compat.implicit_replication_enabled() is False
        with implicit_replication():
            assert compat.implicit_replication_enabled() is True


def test_picklable_dtensor_saves_a_view_at_an_offset(tmp_path) -> None:
    with gloo_world_of_one() as mesh:
        flat = torch.arange(20.0)
        view = flat[8:].view(3, 4)
        placed = DTensor.from_local(view, mesh, [Replicate()])
        made = compat.picklable_dtensor(placed)
        assert made.storage_offset() == 0 and made._local_tensor is placed._local_tensor
        assert made.placements == placed.placements and made.shape == placed.shape
        torch.save(made, tmp_path / "t.pt")
        loaded = torch.load(tmp_path / "t.pt")
        assert isinstance(loaded, DTensor) and torch.equal(loaded.to_local(), view)
        assert compat.picklable_dtensor(loaded) is loaded  # offset 0 already


@torch.library.custom_op("dtrec_compat_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_dtensor_op_handlers_route_an_op() -> None:
    op = torch.ops.dtrec_compat_test.twice.default
    seen = []

    def handler(op_call, args, kwargs):  # type: ignore[no-untyped-def]
        seen.append(compat.op_argument_names(op_call))
        (x,) = args
        local = op_call(x.to_local())
        return compat.contiguous_dtensor(local, x.device_mesh, x.placements, x.shape)

    handlers = compat.dtensor_op_handlers()
    with gloo_world_of_one() as mesh:
        x = distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])
        handlers[op] = handler
        try:
            out = _twice(x)
        finally:
            del handlers[op]
        assert seen == [["x"]] and isinstance(out, DTensor)
        assert out.to_local().tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_traced_broadcast_copies_the_source_rank_tensors() -> None:
    with gloo_world_of_one():
        buffer = torch.arange(4.0)
        compat.traced_broadcast_([buffer], 0)
        assert buffer.tolist() == [0.0, 1.0, 2.0, 3.0]

        @torch.compile(backend="eager", fullgraph=True)
        def traced(t: torch.Tensor) -> torch.Tensor:
            compat.traced_broadcast_([t], 0)
            return t + 1

        assert traced(buffer).tolist() == [1.0, 2.0, 3.0, 4.0]


# --------------------------------------------------------------------------- one place

# Files still allowed private torch uses outside _torch_compat (none today); delete an
# entry once its file is clean.
PENDING: dict[str, str] = {}


def private_torch_uses(path: Path) -> list[str]:
    """Imports of private torch modules and ``._private`` attributes of torch names."""
    tree = ast.parse(path.read_text())
    torch_names = {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            torch_names |= {a.asname or a.name for a in node.names}
            private = [p for p in node.module.split(".") if p.startswith("_")]
            private += [a.name for a in node.names if a.name.startswith("_")]
            if private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and "._" in alias.name:
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            dunder = node.attr.startswith("__") and node.attr.endswith("__")
            if isinstance(root, ast.Name) and root.id in torch_names and not dunder:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_private_torch_apis_only_in_torch_compat() -> None:
    offenders = {}
    for path in sorted(DTREC.rglob("*.py")):
        rel = str(path.relative_to(DTREC.parent))
        if rel == "dtrec/_torch_compat.py":
            continue
        uses = private_torch_uses(path)
        if uses and rel not in PENDING:
            offenders[rel] = uses
    assert not offenders, f"private torch APIs outside dtrec/_torch_compat.py: {offenders}"


def test_pending_entries_still_needed() -> None:
    stale = [p for p in PENDING if not private_torch_uses(DTREC.parent / p)]
    assert not stale, f"delete these PENDING entries, the files are clean: {stale}"


def test_private_use_scanner_sees_them(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch.distributed.tensor import DTensor\n"
        "from torch.distributed._composable import replicate\n"
        "DTensor._op_dispatcher\ntorch.autograd.Variable._execution_engine\n"
        "x.__class__\n"
    )
    assert private_torch_uses(path) == [
        "m.py:3 from torch.distributed._composable import",
        "m.py:4 ._op_dispatcher",
        "m.py:5 ._execution_engine",
    ]
    with pytest.raises(AssertionError):
        assert not private_torch_uses(path)


def test_foreach_norm_and_mul() -> None:
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([1.0])
    assert [n.item() for n in compat.foreach_norm([a, b], 2.0, None)] == [5.0, 1.0]
    compat.foreach_mul_([a, b], torch.tensor(2.0))
    assert a.tolist() == [6.0, 8.0] and b.tolist() == [2.0]
    compat.foreach_copy_([a, b], [torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [3.0]


def test_local_block_and_same_layout() -> None:
    with gloo_world_of_one() as mesh:
        local = torch.arange(6.0).view(2, 3)
        a = compat.dtensor_with_layout(local, mesh, [Replicate()], (2, 3), (3, 1))
        b = compat.dtensor_with_layout(local.clone(), mesh, [Replicate()], (2, 3), (3, 1))
        c = compat.dtensor_with_layout(local.clone(), mesh, [Shard(0)], (2, 3), (3, 1))
        assert compat.local_block(a) is local
        assert compat.same_dtensor_layout(a, b) and not compat.same_dtensor_layout(a, c)
        assert not compat.same_dtensor_layout(
            a, compat.contiguous_dtensor(local, mesh, [Replicate()], (3, 2))
        )


def test_dtensor_like_shares_the_spec() -> None:
    with gloo_world_of_one() as mesh:
        param = compat.contiguous_dtensor(torch.zeros(2, 3), mesh, [Replicate()], (2, 3))
        grad = compat.dtensor_like(torch.ones(2, 3), param)
        assert grad._spec is param._spec and compat.same_dtensor_layout(grad, param)
        assert grad.to_local().tolist() == [[1.0] * 3] * 2
        with pytest.raises(ValueError, match="cannot take the layout"):
            compat.dtensor_like(torch.ones(3, 2).t(), param)


def test_move_to_mesh_keeps_the_object() -> None:
    with gloo_world_of_one() as mesh:
        other = DeviceMesh("cpu", [[0]], mesh_dim_names=("a", "b"))
        param = compat.contiguous_dtensor(torch.ones(2, 3), mesh, [Replicate()], (2, 3))
        local = compat.local_block(param)
        compat.move_to_mesh(param, other)
        assert param.device_mesh is other and param.placements == (Replicate(), Replicate())
        assert compat.local_block(param) is local and tuple(param.shape) == (2, 3)
        assert (param * 2).device_mesh is other
        sharded = compat.contiguous_dtensor(torch.ones(2, 3), mesh, [Shard(0)], (2, 3))
        with pytest.raises(ValueError, match="only a replicated"):
            compat.move_to_mesh(sharded, other)


def test_check_split_sizes_passes_sizes_that_add_up_and_refuses_others() -> None:
    compat.check_split_sizes([2, 0, 3], 5)
    with pytest.raises(RuntimeError):
        compat.check_split_sizes([2, 2], 5)
    with pytest.raises(RuntimeError):
        compat.check_split_sizes([-1, 6], 5)


def test_fsdp_managed_reads_fully_shards_flag() -> None:
    from torch.distributed.fsdp import fully_shard

    with gloo_world_of_one() as mesh:
        outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
        assert not compat.fsdp_managed(outer[0])
        fully_shard(outer, mesh=mesh)
        assert compat.fsdp_managed(outer) and compat.fsdp_managed(outer[0])
