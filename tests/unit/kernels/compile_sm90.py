"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU; run as a script.

The interpreter accepts code the compiler rejects (loop-carried types, early returns,
pointer casts, tile shapes tl.dot refuses), so CI also compiles the real kernels down to
cubin with the ptxas that ships with Triton. Must run with TRITON_INTERPRET unset, which is
why `test_compile_sm90.py` starts it in a subprocess. Prints one line per kernel.
"""

from __future__ import annotations

import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import block_ops, decode, kv_write, prefill

INDEX_ARGS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
INT64_ARGS = {"slot_mapping_ptr", "ids_ptr", "mapping_ptr", "table_ptr"}


def _arg_type(name: str, dtype: str) -> str:
    if name in INDEX_ARGS:
        return "*i32"
    if name in INT64_ARGS:
        return "*i64"
    if name.startswith("part_"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*" + dtype
    return "fp32" if name == "scale_log2" else "i32"


def compile_kernel(fn, dtype: str, constexprs: dict) -> None:
    """Compile `fn` for sm_90 with the given constexprs; raise on any compiler error."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype) for n in names}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    took = time.perf_counter() - start
    print(f"{fn.__name__} {dtype}: ok in {took:.1f}s, {compiled.metadata.shared} B shared")


def main() -> None:
    attn = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "PAGE": 16}
    for dtype, precision in (("fp16", "tf32"), ("bf16", "tf32"), ("fp32", "ieee")):
        tiles = {"BLOCK_D": 128, "DOT_PRECISION": precision, "UPCAST": False}
        for splits in (1, 4):
            compile_kernel(
                decode.decode_split_kernel,
                dtype,
                {**attn, **tiles, "NUM_SPLITS": splits, "BLOCK_G": 16, "BLOCK_N": 64},
            )
        compile_kernel(
            decode.decode_reduce_kernel,
            dtype,
            {"NUM_HEADS": 32, "HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_S": 4, "BLOCK_D": 128},
        )
        block_n = 32 if dtype == "fp32" else 64
        compile_kernel(
            prefill.prefill_kernel,
            dtype,
            {**attn, **tiles, "BLOCK_Q": 16, "BLOCK_M": 64, "BLOCK_N": block_n},
        )
    compile_kernel(
        kv_write.write_kv_kernel,
        "bf16",
        {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128},
    )
    movers = {"BLOCK_NUMEL": 16 * 8 * 128, "CHUNK": 4096}
    compile_kernel(block_ops.copy_blocks_kernel, "bf16", movers)
    for fn in (block_ops.gather_blocks_kernel, block_ops.scatter_blocks_kernel):
        compile_kernel(fn, "bf16", movers)


if __name__ == "__main__":
    main()
