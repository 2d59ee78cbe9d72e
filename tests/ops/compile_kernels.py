"""Compile every dtrec Triton kernel for an H100/H200 (sm_90) without a GPU.

Triton's interpreter, which runs the kernel tests on CPU, accepts code its compiler
rejects (types, layouts, loops); this runs the compiler itself (Triton's bundled ptxas,
no device needed) on each kernel in the configurations the launchers use. Run without
``TRITON_INTERPRET`` (``@triton.jit`` must give compilable functions):

    PYTHONPATH=. python -m tests.ops.compile_kernels        # exit 1 if any kernel fails
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dtrec.kernels import embedding_bag as K
from dtrec.kernels import embedding_bag_bwd as KB
from dtrec.kernels import sorted_runs as SR
from dtrec.kernels import update_rows as U

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types: dict, constexprs: dict, num_warps: int = 4) -> object:
    """Compile ``fn`` for ``TARGET``; pointers default to fp32, scalars to int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
    src = ASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def kernel_cases() -> list[tuple]:
    """(name, kernel, argument types, constexprs, num_warps): each kernel in the
    configurations its launcher picks."""
    I64 = "*i64"
    I32 = "*i32"
    I8 = "*i8"
    cases = []
    fwd_types = dict(
        table_offsets_ptr=I64,
        dims_ptr=I32,
        entry_table_ptr=I32,
        out_cols_ptr=I64,
        values_ptr=I64,
        offsets_ptr=I64,
        mean_ptr=I8,
        bounds_ptr=I64,
        error_ptr=I32,
    )
    for bb, bl, nw in ((4, 1, 2), (1, 16, 4)):
        for bounds in (False, True):
            cases.append(
                (
                    f"fwd B{bb} L{bl} bounds={bounds}",
                    K._embedding_bag_fwd_kernel,
                    fwd_types,
                    dict(HAS_PSW=True, HAS_BOUNDS=bounds, BLOCK_B=bb, BLOCK_L=bl, BLOCK_D=128),
                    nw,
                )
            )
    cases.append(
        (
            "keys",
            SR._occurrence_keys_kernel,
            dict(
                values_ptr=I64,
                offsets_ptr=I64,
                entry_table_ptr=I32,
                row_base_ptr=I64,
                num_rows_ptr=I64,
                keys_ptr=I32,
                bag_of_ptr=I32,
                no_row="i64",
            ),
            dict(BLOCK_B=32, BLOCK_L=8),
            4,
        )
    )
    cases.append(
        (
            "run flags",
            SR._run_flags_kernel,
            dict(
                keys_ptr=I32,
                perm_ptr=I64,
                bag_of_ptr=I32,
                offsets_ptr=I64,
                mean_ptr=I8,
                out_cols_ptr=I64,
                src_ptr=I32,
                flags_ptr=I64,
                no_row="i64",
            ),
            dict(HAS_PSW=True, SHORT=32, CHUNK=256, BLOCK=1024),
            4,
        )
    )
    cases.append(
        (
            "run tables",
            SR._run_tables_kernel,
            dict(
                keys_ptr=I32,
                perm_ptr=I64,
                bag_of_ptr=I32,
                entry_table_ptr=I32,
                row_base_ptr=I64,
                dims_ptr=I32,
                flags_ptr=I64,
                cum_ptr=I64,
                starts_ptr=I64,
                unique_keys_ptr=I64,
                row_table_ptr=I32,
                row_ids_ptr=I64,
                row_dim_ptr=I32,
                item_run_ptr=I32,
                item_chunk_ptr=I32,
                counts_ptr=I64,
                no_row="i64",
            ),
            dict(BLOCK=1024),
            4,
        )
    )
    upd = dict(
        src_ptr=I32,
        starts_ptr=I64,
        row_dim_ptr=I32,
        counts_ptr=I64,
        grad_offsets_ptr=I32,
        row_table_ptr=I32,
        row_ids_ptr=I64,
        table_offsets_ptr=I64,
        state_offsets_ptr=I64,
        full_dims_ptr=I32,
        error_ptr=I32,
        item_run_ptr=I32,
        item_chunk_ptr=I32,
    )
    for kind in (0, 1, 2, 3):
        cases.append(
            (
                f"short KIND={kind}",
                KB._short_runs_kernel,
                upd,
                dict(KIND=kind, SHORT=32, BLOCK_R=4, BLOCK_D=128),
                1,
            )
        )
        cases.append(
            (
                f"long KIND={kind}",
                KB._long_runs_kernel,
                upd,
                dict(KIND=kind, CHUNK=256, BLOCK_L=4, BLOCK_D=128),
                1,
            )
        )
        cases.append(
            (
                f"partials KIND={kind}",
                KB._sum_partials_kernel,
                upd,
                dict(KIND=kind, CHUNK=256, BLOCK_C=16, BLOCK_D=128),
                4,
            )
        )
    urows = dict(
        state_offsets_ptr=I64,
        table_offsets_ptr=I64,
        dims_ptr=I32,
        full_dims_ptr=I32,
        row_table_ptr=I32,
        row_ids_ptr=I64,
        grad_offsets_ptr=I64,
        lr="fp32",
        eps="fp32",
        beta1="fp32",
        beta2="fp32",
        sqrt_bc2="fp32",
    )
    for kind in (1, 2, 3):
        for sq in (False, True):
            cases.append(
                (
                    f"update_rows KIND={kind} sq={sq}",
                    U._update_rows_kernel,
                    urows,
                    dict(KIND=kind, HAS_ROW_SQ_SUM=sq, BLOCK_R=8, BLOCK_D=128),
                    2,
                )
            )
    return cases


def main() -> int:
    bad = 0
    for name, fn, types, consts, nw in kernel_cases():
        try:
            compile_kernel(fn, types, consts, nw)
            print("ok  ", name)
        except Exception as exc:
            bad += 1
            print("FAIL", name, type(exc).__name__, str(exc)[:1500])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
