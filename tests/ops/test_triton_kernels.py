"""Triton kernels vs their pure-torch references (and vs torch's own ops).

With a GPU the kernels run on CUDA (references stay on the CPU); without one, on CPU
tensors under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which is
slow: shapes are kept small (B <= 3, a handful of entries, short bags but one long one).
"""

import os

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dtrec.kernels import embedding_bag as K  # noqa: E402
from dtrec.kernels import embedding_bag_bwd as KB  # noqa: E402
from dtrec.kernels import reference as R  # noqa: E402
from dtrec.kernels import sorted_runs  # noqa: E402
from dtrec.kernels import update_rows as U  # noqa: E402
from dtrec.kernels.update_math import rowwise_adagrad_rows, sgd_rows  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")

DIMS = [1, 3, 127, 129, 256]
ROWS = [5, 6, 7, 4, 3]
# entries 2/5 share table 2 and 1/6 share table 1; out_cols are laid out in reverse order
ENTRY_TABLE = [0, 1, 2, 3, 4, 2, 1]
ENTRY_MEAN = [0, 1, 0, 1, 0, 1, 0]
B = 3

# The Triton interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest even), so
# a bf16 result may sit one bf16 ulp (<= 2**-7 relative) from the torch reference.
BF16_ULP = {"atol": 1e-6, "rtol": 2**-7}
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def dev(*tensors):
    """The tensors on the device the kernels run on (other arguments unchanged)."""
    moved = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]
    return moved[0] if len(moved) == 1 else moved


class Case:
    """Packed tables + a jagged batch in the layout of dtrec.kernels.embedding_bag (CPU)."""

    def __init__(
        self,
        dims=DIMS,
        rows=ROWS,
        entry_table=ENTRY_TABLE,
        entry_mean=ENTRY_MEAN,
        batch_size=B,
        lengths=None,
        dtype=torch.float32,
        idx_dtype=torch.int64,
        weighted=False,
        seed=0,
    ):
        g = torch.Generator().manual_seed(seed)
        self.B, self.num_entries = batch_size, len(entry_table)
        self.dims = torch.tensor(dims, dtype=torch.int32)
        self.rows = torch.tensor(rows, dtype=torch.int64)
        sizes = self.rows * self.dims
        self.table_offsets = torch.cumsum(sizes, 0) - sizes
        self.weights = torch.randn(int(sizes.sum()), generator=g).to(dtype)
        self.entry_table = torch.tensor(entry_table, dtype=torch.int32)
        self.mean = torch.tensor(entry_mean, dtype=torch.int8)
        entry_dims = self.dims[self.entry_table.long()].long()
        rev_cols = torch.cumsum(entry_dims.flip(0), 0) - entry_dims.flip(0)
        self.out_cols = rev_cols.flip(0).to(torch.int32)
        self.total_dim = int(entry_dims.sum())
        if lengths is None:
            lengths = torch.randint(1, 4, (self.num_entries * batch_size,), generator=g)
            if self.num_entries > 2:
                lengths[1] = 0  # an empty bag (entry 0 is sum-pooled)
                lengths[batch_size + 1] = 0  # an empty mean-pooled bag
                lengths[2 * batch_size] = 5  # a bag of one repeated id (below)
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths.cumsum(0)])
        ids = []
        for bag, n in enumerate(self.lengths.tolist()):
            num_rows = rows[entry_table[bag // batch_size]]
            ids.append(torch.randint(0, num_rows, (n,), generator=g))
        if self.num_entries > 2 and self.lengths[2 * batch_size] > 0:
            ids[2 * batch_size].fill_(int(ids[2 * batch_size][0]))
        self.values = torch.cat(ids).to(idx_dtype)
        self.psw = torch.rand(self.values.numel(), generator=g) + 0.5 if weighted else None

    def layout(self, weights=None):
        """Arguments shared by the forward launcher and its reference."""
        w = self.weights if weights is None else weights
        return (w, self.table_offsets, self.dims, self.entry_table, self.out_cols,
                self.values, self.offsets, self.B, self.total_dim, self.mean)  # fmt: skip

    def bwd_args(self, grad_out):
        return (grad_out, self.dims, self.rows, self.entry_table, self.out_cols, self.values,
                self.offsets, self.B, self.total_dim, self.mean, self.psw)  # fmt: skip

    def tables(self, weights=None, dtype=torch.float64):
        """Per-table ``[rows, dim]`` copies of a packed buffer (default: the weights)."""
        w = self.weights if weights is None else weights
        return [
            w[int(o) : int(o) + int(r) * int(d)].view(int(r), int(d)).to(dtype)
            for o, r, d in zip(self.table_offsets, self.rows, self.dims)
        ]

    def torch_forward(self, tables):
        """Pooled output ``[B, total_dim]`` from F.embedding_bag on each entry."""
        out = torch.zeros(self.B, self.total_dim, dtype=tables[0].dtype)
        for e in range(self.num_entries):
            t = int(self.entry_table[e])
            lo, hi = e * self.B, (e + 1) * self.B
            bag_offsets = self.offsets[lo : hi + 1]
            ids = self.values[bag_offsets[0] : bag_offsets[-1]].long()
            psw = None
            if self.psw is not None:
                psw = self.psw[bag_offsets[0] : bag_offsets[-1]].to(tables[0].dtype)
            pooled = F.embedding_bag(
                ids, tables[t], bag_offsets[:-1] - bag_offsets[0], mode="sum",
                per_sample_weights=psw,
            )  # fmt: skip
            if self.mean[e]:
                pooled = pooled / self.lengths[lo:hi].clamp(min=1)[:, None]
            col = int(self.out_cols[e])
            out[:, col : col + tables[t].shape[1]] = pooled
        return out


def fwd(case, weights=None, **kwargs):
    """Run the Triton forward on DEVICE; results back on the CPU."""
    psw = kwargs.pop("per_sample_weights", case.psw)
    result = K.embedding_bag_fwd(*dev(*case.layout(weights), psw), **kwargs)
    return tuple(r.cpu() for r in result) if isinstance(result, tuple) else result.cpu()


def bwd(case, grad_out, **kwargs):
    got = KB.embedding_bag_bwd_rows(*dev(*case.bwd_args(grad_out)), **kwargs)
    return KB.RowGrads(*(t.cpu() for t in got))


FWD_CASES = [
    (torch.float32, torch.int64, False),
    (torch.float32, torch.int32, True),
    (torch.bfloat16, torch.int64, True),
    (torch.bfloat16, torch.int32, False),
]


# None: the launcher's choice (several bags per program for these short bags); 1: one bag
# per program; 2: blocks of two bags, the last one partly past the batch.
BAGS_PER_PROGRAM = [None, 1, 2]


@pytest.mark.parametrize("bags", BAGS_PER_PROGRAM, ids=["auto", "one-bag", "two-bags"])
@pytest.mark.parametrize("dtype,idx_dtype,weighted", FWD_CASES)
def test_fwd_matches_reference_and_embedding_bag(dtype, idx_dtype, weighted, bags):
    case = Case(dtype=dtype, idx_dtype=idx_dtype, weighted=weighted, seed=1)
    out = fwd(case, bags_per_program=bags)
    assert out.dtype == dtype and out.shape == (B, case.total_dim)
    ref = R.embedding_bag_fwd_reference(*case.layout(), per_sample_weights=case.psw)
    exact = case.torch_forward(case.tables())
    tol = FP32 if dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # bf16 output is exact up to its own rounding (one ulp, see BF16_ULP)
    torch.testing.assert_close(out.double(), exact, **(FP32 if dtype == torch.float32 else
                                                       {"atol": 1e-5, "rtol": 2**-7}))  # fmt: skip
    # fp32 output of bf16 tables: only the fp32 accumulation's error remains
    out32 = fwd(case, out_dtype=torch.float32, max_dim=256, bags_per_program=bags)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), exact, **FP32)


@pytest.mark.parametrize("bags", [None, 2], ids=["auto", "two-bags"])
def test_fwd_long_bag(bags):
    case = Case(
        dims=[129, 3], rows=[50, 8], entry_table=[0, 1], entry_mean=[0, 0], batch_size=2,
        lengths=[1000, 0, 3, 2], weighted=True, seed=2,
    )  # fmt: skip
    exact = case.torch_forward(case.tables())
    torch.testing.assert_close(fwd(case, bags_per_program=bags).double(), exact, **FP32)
    case.mean[0], case.psw = 1, None  # mean over the long bag
    exact = case.torch_forward(case.tables())
    torch.testing.assert_close(fwd(case, bags_per_program=bags).double(), exact, **FP32)


@pytest.mark.parametrize("bags", BAGS_PER_PROGRAM[:2], ids=["auto", "one-bag"])
def test_fwd_bounds_flag_and_no_out_of_bounds_read(bags):
    case = Case(seed=3)
    # Surround the packed tables with NaN: any read past either end poisons the output.
    n, pad = case.weights.numel(), 512
    guarded = torch.full((n + 2 * pad,), float("nan"))
    guarded[pad : pad + n] = case.weights
    guarded = dev(guarded)
    weights = guarded[pad : pad + n]
    bounds = case.rows.clone()

    out, error = fwd(case, weights, bounds=dev(bounds), bags_per_program=bags)
    assert error.tolist() == [0, 0]
    torch.testing.assert_close(out, fwd(case, weights, bags_per_program=bags))

    bad_entry = 4  # reads the last table: its row ROWS[4] lies just past the buffer
    lo = int(case.offsets[bad_entry * B])
    assert case.lengths[bad_entry * B] > 0 and case.lengths[0] > 0
    case.values[lo] = ROWS[4]
    case.values[0] = -1  # entry 0 reads the first table: its row -1 lies before the buffer
    assert (
        fwd(case, weights, bags_per_program=bags).isnan().any()
    )  # the guard works: unchecked, the NaN is read
    out, error = fwd(case, weights, bounds=dev(bounds), bags_per_program=bags)
    assert error.tolist() == [1, bad_entry]
    assert torch.isfinite(out).all()
    ref, ref_bad = R.embedding_bag_fwd_reference(*case.layout(), bounds=bounds)
    assert bool(ref_bad)
    torch.testing.assert_close(out, ref)


def test_empty_batch():
    case = Case(dims=[3], rows=[4], entry_table=[0], entry_mean=[1], batch_size=2, lengths=[0, 0])
    torch.testing.assert_close(fwd(case), torch.zeros(2, 3))
    got = bwd(case, torch.randn(2, 3))
    assert got.unique_keys.numel() == 0 and got.grad_rows.numel() == 0


@pytest.mark.parametrize(
    "idx_dtype,weighted", [(torch.int64, False), (torch.int32, True)], ids=["i64", "i32-psw"]
)
def test_bwd_rows_matches_reference_and_autograd(idx_dtype, weighted):
    case = Case(idx_dtype=idx_dtype, weighted=weighted, seed=4)
    grad_out = torch.randn(B, case.total_dim)
    got = bwd(case, grad_out)
    ref = R.embedding_bag_bwd_rows_reference(*case.bwd_args(grad_out))
    for name in ("unique_keys", "row_table", "row_ids", "grad_offsets"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.grad_rows, ref.grad_rows, **FP32)

    tables = [t.requires_grad_() for t in case.tables()]
    case.torch_forward(tables).backward(grad_out.double())
    for k in range(got.unique_keys.numel()):
        t, r = int(got.row_table[k]), int(got.row_ids[k])
        off, dim = int(got.grad_offsets[k]), int(case.dims[t])
        torch.testing.assert_close(got.grad_rows[off : off + dim].double(), tables[t].grad[r],
                                   **FP32)  # fmt: skip
    # the dense gradient is zero outside the reported rows
    for t, table in enumerate(tables):
        untouched = torch.ones(table.shape[0], dtype=torch.bool)
        untouched[got.row_ids[got.row_table == t]] = False
        assert not table.grad[untouched].any()


def test_bwd_rows_deterministic_with_hot_rows():
    # table 0 has 2 rows: its ~40 occurrences fall on two segments longer than BLOCK_L
    case = Case(
        dims=[129, 3], rows=[2, 5], entry_table=[0, 0, 1, 1], entry_mean=[0, 1, 0, 0],
        batch_size=2, lengths=[9, 12, 0, 11, 3, 1, 2, 0], weighted=True, seed=5,
    )  # fmt: skip
    grad_out = torch.randn(2, case.total_dim)
    first, second = bwd(case, grad_out), bwd(case, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref = R.embedding_bag_bwd_rows_reference(*case.bwd_args(grad_out))
    torch.testing.assert_close(first.grad_rows, ref.grad_rows, **FP32)


def _hot_row_case(seed):
    """Table 0 (dim 300: two column blocks) has rows read 37, 6 and 2 times; table 1 is cold."""
    case = Case(
        dims=[300, 5], rows=[3, 40], entry_table=[0, 1, 0], entry_mean=[0, 1, 1], batch_size=2,
        lengths=[30, 0, 9, 3, 5, 10], weighted=True, seed=seed,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    hot = torch.tensor([0] * 37 + [1] * 6 + [2] * 2)
    hot = hot[torch.randperm(hot.numel(), generator=g)].to(case.values.dtype)
    case.values[:30], case.values[42:] = hot[:30], hot[30:]  # entries 0 and 2 read table 0
    return case


@pytest.mark.parametrize("int32_keys", [True, False], ids=["i32-keys", "i64-keys"])
def test_bwd_rows_hot_row_split_into_chunks(monkeypatch, int32_keys):
    """chunk_size=8: row 0 (37 ids) is summed as 5 chunks + partials, row 1 (6) as one long
    segment, row 2 (2) and table 1's rows by the row-block kernel; all match the reference."""
    if not int32_keys:
        monkeypatch.setattr(sorted_runs, "_INT32_KEYS", 0)
    case = _hot_row_case(seed=16)
    grad_out = torch.randn(2, case.total_dim)
    ref = R.embedding_bag_bwd_rows_reference(*case.bwd_args(grad_out))
    assert ref.row_table.tolist()[:3] == [0, 0, 0]
    for chunk_size in (8, 16, None):
        got = bwd(case, grad_out, chunk_size=chunk_size)
        for name in ("unique_keys", "row_table", "row_ids", "grad_offsets"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        torch.testing.assert_close(got.grad_rows, ref.grad_rows, **FP32)


def test_bwd_rows_deterministic_with_split_rows():
    case = _hot_row_case(seed=17)
    grad_out = torch.randn(2, case.total_dim)
    first, second = bwd(case, grad_out, chunk_size=8), bwd(case, grad_out, chunk_size=8)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- optimizers


def _touched(case, seed):
    """Random distinct touched rows of every table with random fp32 grads, as RowGrads."""
    g = torch.Generator().manual_seed(seed)
    tables, ids = [], []
    for t, r in enumerate(case.rows.tolist()):
        pick = torch.randperm(r, generator=g)[: max(1, r // 2)].sort().values
        ids.append(pick)
        tables.append(torch.full_like(pick, t))
    row_table = torch.cat(tables).to(torch.int32)
    row_dim = case.dims.long()[row_table.long()]
    grad_offsets = torch.cumsum(row_dim, 0) - row_dim
    grad_rows = torch.randn(int(row_dim.sum()), generator=g)
    return KB.RowGrads(None, row_table, torch.cat(ids), grad_offsets, grad_rows)


def _dense_grads(case, grads):
    dense = [torch.zeros(int(r), int(d)) for r, d in zip(case.rows, case.dims)]
    for k in range(grads.row_table.numel()):
        t, r, off = int(grads.row_table[k]), int(grads.row_ids[k]), int(grads.grad_offsets[k])
        dense[t][r] = grads.grad_rows[off : off + int(case.dims[t])]
    return dense


def _rows_args(case, grads):
    return (case.table_offsets, case.dims, grads.row_table, grads.row_ids, grads.grad_rows,
            grads.grad_offsets)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgd_update_rows(dtype):
    case = Case(dtype=dtype, seed=6)
    grads = _touched(case, seed=7)
    w, w_ref = dev(case.weights.clone()), case.weights.clone()
    U.sgd_update_rows(w, *dev(*_rows_args(case, grads)), 0.1)
    R.sgd_update_rows_reference(w_ref, *_rows_args(case, grads), 0.1)
    tol = BF16_ULP if dtype == torch.bfloat16 else FP32  # a GPU may fuse w - lr * g to an fma
    torch.testing.assert_close(w.cpu().float(), w_ref.float(), **tol)
    for new, old, g in zip(case.tables(w.cpu(), torch.float32), case.tables(dtype=torch.float32),
                           _dense_grads(case, grads)):  # fmt: skip
        torch.testing.assert_close(new, sgd_rows(old, g, 0.1).to(dtype).float(), **tol)


def _dense_rowwise_adagrad(table, state, grad, lr, eps):
    """The optimizer's row-wise Adagrad math on the rows with a nonzero gradient."""
    rows = (grad != 0).any(1).nonzero().flatten()
    g = grad[rows]
    new, acc = rowwise_adagrad_rows(table[rows], state[rows], g, g.square().sum(1), grad.shape[1],
                                    lr, eps)  # fmt: skip
    return table.index_copy(0, rows, new), state.index_copy(0, rows, acc)


@pytest.mark.parametrize(
    "dtype,row_blocks",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
    ids=["fp32", "bf16", "fp32-column-loop"],
)
def test_rowwise_adagrad_update_rows(monkeypatch, dtype, row_blocks):
    if not row_blocks:  # rows wider than the row-block kernel's limit: one program per row
        monkeypatch.setattr(U, "_ADAGRAD_MAX_BLOCK_D", 128)
    case = Case(dtype=dtype, seed=8)
    grads = _touched(case, seed=9)
    state_offsets = torch.cumsum(case.rows, 0) - case.rows
    state0 = torch.rand(int(case.rows.sum())) * 0.1
    w, state = dev(case.weights.clone(), state0.clone())
    w_ref, state_ref = case.weights.clone(), state0.clone()
    lr, eps = 0.05, 1e-8
    U.rowwise_adagrad_update_rows(w, state, *dev(state_offsets, *_rows_args(case, grads)), lr,
                                  eps)  # fmt: skip
    R.rowwise_adagrad_update_rows_reference(
        w_ref, state_ref, state_offsets, *_rows_args(case, grads), lr, eps
    )
    w, state = w.cpu(), state.cpu()
    torch.testing.assert_close(state, state_ref, atol=1e-6, rtol=1e-6)
    tol = BF16_ULP if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(w.float(), w_ref.float(), **tol)
    if dtype == torch.float32:
        tables = case.tables(dtype=torch.float32)
        for t, g in enumerate(_dense_grads(case, grads)):
            rows = slice(int(state_offsets[t]), int(state_offsets[t] + case.rows[t]))
            want_w, want_s = _dense_rowwise_adagrad(tables[t], state0[rows], g, lr, eps)
            torch.testing.assert_close(case.tables(w, torch.float32)[t], want_w)
            torch.testing.assert_close(state[rows], want_s)


def test_rowwise_adagrad_column_shards_match_full_table():
    """Two column shards given the all-reduced row_sq_sum update like the whole table."""
    dims, rows = [129, 6], [4, 3]
    full = Case(dims=dims, rows=rows, entry_table=[0, 1], entry_mean=[0, 0], seed=10)
    grads = _touched(full, seed=11)
    state_offsets = torch.tensor([0, rows[0]])
    state0 = torch.rand(sum(rows)) * 0.1
    lr, eps = 0.05, 1e-8
    want, want_state = full.weights.clone(), state0.clone()
    R.rowwise_adagrad_update_rows_reference(
        want, want_state, state_offsets, *_rows_args(full, grads), lr, eps
    )

    dense = _dense_grads(full, grads)
    touched = list(zip(grads.row_table.tolist(), grads.row_ids.tolist()))
    row_sq_sum = torch.stack([dense[t][r].pow(2).sum() for t, r in touched])
    tables = full.tables(dtype=torch.float32)
    split = [[(0, 65), (65, 129)], [(0, 3), (3, 6)]]  # per table: column range of each shard
    pieces = []
    for s in range(2):
        cols = [slice(*split[t][s]) for t in range(2)]
        shard = Case(dims=[c.stop - c.start for c in cols], rows=rows, entry_table=[0, 1],
                     entry_mean=[0, 0])  # fmt: skip
        shard.weights = torch.cat([tables[t][:, cols[t]].flatten() for t in range(2)])
        row_dim = shard.dims.long()[grads.row_table.long()]
        shard_grads = grads._replace(
            grad_rows=torch.cat([dense[t][r][cols[t]] for t, r in touched]),
            grad_offsets=torch.cumsum(row_dim, 0) - row_dim,
        )
        w, state = dev(shard.weights, state0.clone())
        U.rowwise_adagrad_update_rows(
            w, state, *dev(state_offsets, *_rows_args(shard, shard_grads)), lr, eps,
            row_sq_sum=dev(row_sq_sum), full_dims=dev(full.dims),
        )  # fmt: skip
        torch.testing.assert_close(state.cpu(), want_state, atol=1e-6, rtol=1e-6)
        pieces.append(shard.tables(w.cpu(), torch.float32))
    for t in range(2):
        got = torch.cat([pieces[0][t], pieces[1][t]], dim=1)
        torch.testing.assert_close(got, full.tables(want, torch.float32)[t], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_update_rows_matches_reference(dtype):
    case = Case(dtype=dtype, seed=12)
    grads = _touched(case, seed=13)
    n = case.weights.numel()
    m0, v0 = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    w, m, v = dev(case.weights.clone(), m0.clone(), v0.clone())
    w_ref, m_ref, v_ref = case.weights.clone(), m0.clone(), v0.clone()
    hyper = (0.1, 0.9, 0.999, 1e-8, 3)
    U.adam_update_rows(w, m, v, *dev(*_rows_args(case, grads)), *hyper)
    R.adam_update_rows_reference(w_ref, m_ref, v_ref, *_rows_args(case, grads), *hyper)
    torch.testing.assert_close(m.cpu(), m_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v.cpu(), v_ref, atol=1e-7, rtol=1e-5)
    tol = BF16_ULP if dtype == torch.bfloat16 else FP32
    torch.testing.assert_close(w.cpu().float(), w_ref.float(), **tol)


def test_adam_update_rows_matches_torch_adam():
    """Same rows touched every step: equals torch.optim.Adam on the dense gradients."""
    case = Case(seed=14)
    grads = _touched(case, seed=15)
    n = case.weights.numel()
    w, m, v = dev(case.weights.clone(), torch.zeros(n), torch.zeros(n))
    params = [t.to(torch.float32).clone().requires_grad_() for t in case.tables()]
    opt = torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    for step in range(1, 4):
        grads = grads._replace(grad_rows=grads.grad_rows * (1.0 + step))
        U.adam_update_rows(w, m, v, *dev(*_rows_args(case, grads)), 1e-2, 0.9, 0.99, 1e-8, step)
        for p, g in zip(params, _dense_grads(case, grads)):
            p.grad = g
        opt.step()
    for got, want in zip(case.tables(w.cpu(), torch.float32), params):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- fused backward + step


def _hot_adagrad_case(seed):
    """Like ``_hot_row_case`` with rows narrow enough for the fused row-wise Adagrad."""
    case = _hot_row_case(seed)
    narrow = Case(dims=[200, 5], rows=[3, 40], entry_table=[0, 1, 0], entry_mean=[0, 1, 1],
                  batch_size=2, lengths=case.lengths, weighted=True, seed=seed)  # fmt: skip
    narrow.values = case.values
    return narrow


@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "split-rows"])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("case_fn", ["small", "hot"])
def test_bwd_update_matches_bwd_rows_then_update(kind, chunk_size, case_fn):
    """The fused pass updates exactly the rows (and state) the two-pass path does."""
    from dtrec.kernels import row_updates as F_

    if case_fn == "small":
        case = Case(weighted=True, seed=18)
    else:
        case = (_hot_adagrad_case if kind == "rowwise_adagrad" else _hot_row_case)(seed=19)
    grad_out = torch.randn(case.B, case.total_dim, generator=torch.Generator().manual_seed(20))
    n, state_offsets = case.weights.numel(), torch.cumsum(case.rows, 0) - case.rows
    lr, eps, b1, b2, step, scale = 0.05, 1e-8, 0.9, 0.99, 2, 0.5
    if kind == "rowwise_adagrad":
        state0, state20 = torch.rand(int(case.rows.sum())) * 0.1, torch.zeros(1)
        hyper, code = [lr, eps, 0, 0, 1, scale], F_.ROWWISE_ADAGRAD
    elif kind == "adam":
        state0, state20, state_offsets = torch.randn(n) * 0.1, torch.rand(n) * 0.01, None
        hyper = [lr / (1 - b1**step), eps, b1, b2, (1 - b2**step) ** 0.5, scale]
        code = F_.ADAM
    else:
        state0, state20, hyper, code = torch.zeros(1), torch.zeros(1), [lr, 0, 0, 0, 1, scale], 1
    state_offsets = case.table_offsets if state_offsets is None else state_offsets

    # two passes: row grads, then the standalone update kernel
    w, state, state2 = dev(case.weights.clone(), state0.clone(), state20.clone())
    grads = bwd(case, grad_out, chunk_size=chunk_size)
    grads = grads._replace(grad_rows=grads.grad_rows * scale)
    rows = dev(*_rows_args(case, grads))
    if kind == "sgd":
        U.sgd_update_rows(w, *rows, lr)
    elif kind == "rowwise_adagrad":
        U.rowwise_adagrad_update_rows(w, state, dev(state_offsets), *rows, lr, eps)
    else:
        U.adam_update_rows(w, state, state2, *rows, lr, b1, b2, eps, step)

    fused_w, fused_state, fused_state2 = dev(case.weights.clone(), state0.clone(), state20.clone())
    update = F_.FusedRowUpdate(
        code, fused_w, *dev(case.table_offsets, torch.tensor(hyper, dtype=torch.float32)),
        fused_state, dev(state_offsets), fused_state2, dev(case.dims),
    )  # fmt: skip
    got = KB.embedding_bag_bwd_rows(
        *dev(*case.bwd_args(grad_out)[:10]), dev(case.psw), chunk_size=chunk_size, update=update
    )
    assert got is None  # nothing stored, nothing read back
    torch.testing.assert_close(fused_w.cpu(), w.cpu(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused_state.cpu(), state.cpu(), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(fused_state2.cpu(), state2.cpu(), atol=1e-7, rtol=1e-5)
    assert not torch.equal(fused_w.cpu(), case.weights)


def test_bwd_update_rowwise_adagrad_rejects_wide_rows():
    from dtrec.kernels import row_updates as F_

    case = _hot_row_case(seed=21)  # dim 300: two column blocks
    z = dev(torch.zeros(int(case.rows.sum())))
    update = F_.FusedRowUpdate(
        F_.ROWWISE_ADAGRAD, dev(case.weights), dev(case.table_offsets), dev(torch.ones(6)), z,
        dev(case.rows * 0), z, dev(case.dims),
    )  # fmt: skip
    with pytest.raises(ValueError, match="dims <="):
        KB.embedding_bag_bwd_rows(*dev(*case.bwd_args(torch.randn(2, case.total_dim))),
                                 update=update)  # fmt: skip


def _dense(case, grads):
    """Per-table dense fp32 gradients from RowGrads."""
    dense = [torch.zeros(int(r), int(d)) for r, d in zip(case.rows, case.dims)]
    for k in range(grads.row_table.numel()):
        t, r, off = int(grads.row_table[k]), int(grads.row_ids[k]), int(grads.grad_offsets[k])
        dense[t][r] = grads.grad_rows[off : off + int(case.dims[t])]
    return dense


@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "split-rows"])
def test_bwd_rows_skip_ids_outside_their_table(chunk_size):
    """A bad id (negative, or past its table, which would be another table's row) gives no
    row a gradient: the same dense gradient as the batch with that id weighted 0."""
    case = _hot_row_case(seed=22)
    grad_out = torch.randn(2, case.total_dim, generator=torch.Generator().manual_seed(23))
    bad = {0: -1, 3: 3, 44: 40}  # entry 0 (positions 0-29) and 2 (42-56) read table 0 (3 rows)
    zeroed = Case.__new__(Case)
    zeroed.__dict__.update(case.__dict__)
    zeroed.psw = case.psw.clone()
    for pos in bad:
        zeroed.psw[pos] = 0.0
    want = _dense(case, R.embedding_bag_bwd_rows_reference(*zeroed.bwd_args(grad_out)))
    case.values = case.values.clone()
    for pos, row in bad.items():
        case.values[pos] = row
    got = bwd(case, grad_out, chunk_size=chunk_size)
    assert int(got.unique_keys.max()) < int(case.rows.sum())  # no row of a bad id
    for g, w in zip(_dense(case, got), want):
        torch.testing.assert_close(g, w, **FP32)

    every = Case.__new__(Case)  # every id bad: no row at all
    every.__dict__.update(case.__dict__)
    every.values = torch.full_like(case.values, -5)
    assert bwd(every, grad_out, chunk_size=chunk_size).unique_keys.numel() == 0


def test_bwd_update_waits_for_nothing_and_skips_while_the_error_flag_is_set():
    from benchmarks.probes.step import StepCounter
    from dtrec.kernels import row_updates as F_

    case = _hot_row_case(seed=24)
    grad_out = dev(torch.randn(2, case.total_dim))
    w, error = dev(case.weights.clone()), dev(torch.tensor([1, 0], dtype=torch.int32))
    hyper = dev(torch.tensor([0.1, 0, 0, 0, 1, 1.0]))
    update = F_.FusedRowUpdate(F_.SGD, w, dev(case.table_offsets), hyper, w,
                               dev(case.table_offsets), w, dev(case.dims), error)  # fmt: skip
    args = dev(*case.bwd_args(grad_out))
    rows = int(case.rows.sum())
    with StepCounter(w.device) as counts:
        KB.embedding_bag_bwd_rows(*args, max_dim=300, total_rows=rows, chunk_size=8,
                                  update=update)  # fmt: skip
    assert counts.total_syncs() == 0, counts.syncs
    assert torch.equal(w.cpu(), case.weights)  # the flag was set: no row written
    error.zero_()
    KB.embedding_bag_bwd_rows(*args, max_dim=300, total_rows=rows, chunk_size=8, update=update)
    assert not torch.equal(w.cpu(), case.weights)
