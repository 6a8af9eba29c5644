"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU; run as a script.

The interpreter accepts code the compiler rejects (loop-carried types, early returns,
pointer casts, tile shapes tl.dot refuses), so CI also compiles the real kernels down to
cubin with the ptxas that ships with Triton. Must run with TRITON_INTERPRET unset, which is
why `test_compile_sm90.py` starts it in a subprocess. Prints one line per kernel.

`--candidates` builds instead every launch configuration the GPU benchmark sweeps (bf16,
Llama-8B shapes) and fails on any that needs more shared memory than an H100/H200 block
may take, so the sweep on a lent GPU cannot die on a resource error.
"""

from __future__ import annotations

import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import block_ops, decode, kv_write, prefill
from pagedserve.kernels.launch import DECODE_CANDIDATES, PREFILL_CANDIDATES

INDEX_ARGS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
INT64_ARGS = {"slot_mapping_ptr", "ids_ptr", "mapping_ptr", "table_ptr"}
# Largest dynamic shared memory one block may use on sm_90 (227 KiB).
SM90_MAX_SHARED = 232448
ATTN = {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "PAGE": 16}


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


def compile_kernel(fn, dtype: str, constexprs: dict, types: dict | None = None, **options) -> int:
    """Compile `fn` for sm_90; raise on any compiler error; return its shared memory bytes.
    `types` overrides the type of some arguments (an fp8 pool's pointers are `*u8`)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype) for n in names}
    signature |= types or {}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    start = time.perf_counter()
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    took = time.perf_counter() - start
    shared = compiled.metadata.shared
    print(f"{fn.__name__} {dtype} {options or ''}: ok in {took:.1f}s, {shared} B shared")
    if shared > SM90_MAX_SHARED:
        raise RuntimeError(f"{fn.__name__} {options} needs {shared} B of shared memory")
    return shared


# The pool's row and format: full precision (ROW = HEAD_DIM), or 8-bit (1: e4m3, 2: e5m2,
# 3: int8) whose rows carry a 4-byte scale and whose pointers are bytes.
FULL = {"ROW": 128, "KV_FMT": 0}
KV8_POOL = {"key_cache_ptr": "*u8", "value_cache_ptr": "*u8"}


def _decode(
    dtype: str, precision: str, block_n: int, varlen: bool, kv: dict = FULL, **options
) -> None:
    tiles = {"BLOCK_D": 128, "DOT_PRECISION": precision, "UPCAST": False}
    constexprs = {**ATTN, **tiles, "VARLEN": varlen, "BLOCK_G": 16, "BLOCK_N": block_n, **kv}
    types = KV8_POOL if kv["KV_FMT"] else None
    compile_kernel(decode.decode_split_kernel, dtype, constexprs, types, **options)


def _prefill(
    dtype: str, precision: str, block_m: int, block_n: int, kv: dict = FULL, **options
) -> None:
    tiles = {"BLOCK_D": 128, "DOT_PRECISION": precision, "UPCAST": False}
    block_q = block_m // ATTN["GROUP"]
    constexprs = {**ATTN, **tiles, "BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_N": block_n}
    types = KV8_POOL if kv["KV_FMT"] else None
    compile_kernel(prefill.prefill_kernel, dtype, {**constexprs, **kv}, types, **options)


def compile_defaults() -> None:
    for dtype, precision in (("fp16", "tf32"), ("bf16", "tf32"), ("fp32", "ieee")):
        block_n = 32 if dtype == "fp32" else 64
        for varlen in (False, True):
            _decode(dtype, precision, block_n, varlen, num_warps=4, num_stages=2)
        for varlen in (False, True):
            compile_kernel(
                decode.decode_reduce_kernel,
                dtype,
                {"NUM_HEADS": 32, "HEAD_DIM": 128, "VARLEN": varlen, "BLOCK_S": 64,
                 "BLOCK_D": 128},
            )  # fmt: skip
        _prefill(dtype, precision, 64, block_n, num_warps=4, num_stages=2)
    # The 8-bit pool (`kv_cache_dtype`): bf16 queries over e4m3, e5m2 and int8 rows of 128 + 4
    # bytes.
    for fmt in (1, 2, 3):
        kv8 = {"ROW": 132, "KV_FMT": fmt}
        _decode("bf16", "tf32", 64, False, kv8, num_warps=4, num_stages=2)
        _prefill("bf16", "tf32", 64, 64, kv8, num_warps=4, num_stages=2)
    compile_kernel(
        kv_write.write_kv_kernel,
        "bf16",
        {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128},
    )
    movers = {"BLOCK_NUMEL": 16 * 8 * 128, "CHUNK": 4096}
    compile_kernel(block_ops.copy_blocks_kernel, "bf16", movers)
    for fn in (block_ops.gather_blocks_kernel, block_ops.scatter_blocks_kernel):
        compile_kernel(fn, "bf16", movers)


def compile_candidates() -> None:
    seen = set()
    for c in DECODE_CANDIDATES:
        key = (c.tile_n(128, torch.bfloat16), c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            _decode("bf16", "tf32", key[0], False, num_warps=c.num_warps, num_stages=c.num_stages)
    for c in PREFILL_CANDIDATES:
        block_n = c.tile_n(128, torch.bfloat16)
        _prefill("bf16", "tf32", c.block_m, block_n, num_warps=c.num_warps, num_stages=c.num_stages)


def main() -> None:
    if "--candidates" in sys.argv[1:]:
        compile_candidates()  # the defaults are built by the plain run
    else:
        compile_defaults()


if __name__ == "__main__":
    main()
