"""The CPU attention backend: a C++ kernel that reads the paged KV pool in place.

The torch reference gathers every sequence's whole context out of the pool into a contiguous
copy, per layer and per step, then calls SDPA once per group of sequences. This backend hands
the pool, the block tables and the packed queries to one C++ op per layer
(`csrc/cpu_paged_attention.cpp`): it walks each sequence's blocks with an online softmax,
copying nothing larger than one block of one head, and runs every decode and short prefill
chunk of the batch in that one call, spread over torch's intra-op threads. Sequences with more
than `MAX_IN_PLACE_QUERY` new tokens still take the reference's gather + SDPA.

Why C++ rather than `torch.compile` or a batched torch gather, measured on the SmolLM2-135M
attention shape (9 query / 3 KV heads, head_dim 64, block 16, float32, 1 thread, best of 15;
`python -m pagedserve.bench.cpu_attention --compile`), decode, ms per call:

    batch x max context   torch (reference)   cpu (this op)   gather + 1 SDPA   torch.compile
    1 x 1000                     0.37              0.10              0.21             0.40
    8 x 300                      1.27              0.40              0.78             2.72
    32 x 300                    10.3               1.29              8.09            12.7
    64 x 1000                  130                32.5             105              108

Float32 decodes have since taken a two-pass path (every score of the context, one vectorised
softmax per row, then the values), not the per-block online softmax with a scalar exp: the
same cells, measured at a load average of ~10 (so the reference's column rose too), now give
0.055, 0.29, 0.80 and 10.0 ms (reference 0.32, 2.45, 5.70, 92.1).

The op wins every cell of batch 1-64 x context 16-1,000 (3-8x over the reference); the
compiled arm also cost 17 s to compile in the process and 6-14 s per new shape bucket. Long
query runs are the exception (see `MAX_IN_PLACE_QUERY`). The op costs one build per machine
(~25 s of compiler CPU time; cached by torch under `TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`, rebuilt only when the source or flags change) and well under a
second to load per process.

The build needs only the C++ compiler torch's own extension machinery uses (`c++`, found at
run time); without one, `cpu_paged_available()` is False and `auto` keeps the torch reference.
KV writes and block copies are the reference's (`index_copy_`), already in place.

A bfloat16 pool is read as it is: the op loads each vector of keys or values and widens it to
float in registers (decode: the two-pass path above; short prefill chunks: the value sums), so
the context is never copied to float32 and all its arithmetic is float32.

An 8-bit pool (`kv_quant`: fp8 or int8) goes to the op as its bytes with its format code; the
op dequantises one block of one head at a time into scratch (codes through a 256-entry table,
times the row's scale), so no full-precision copy of the context is made.
"""

from __future__ import annotations

import functools

import torch

from pagedserve.kernels._checks import check_decode, check_prefill
from pagedserve.kernels.cpu_build import CSRC, build_and_load, loads
from pagedserve.kernels.kv_quant import as_bytes, format_code
from pagedserve.kernels.reference import prefill_one_sequence

# Sequences with more new tokens than this leave the op for the reference's gather + SDPA:
# SDPA's blocked GEMMs beat the op's loops on long query runs, where the one gather of the
# context costs 1/q_len of the attention itself (`bench/cpu_attention.py --prefill`).
MAX_IN_PLACE_QUERY = 32


@functools.cache
def _load() -> None:
    """Build (first time on a machine) and load the op `torch.ops.pagedserve_cpu`.

    Raises:
        RuntimeError, OSError, ImportError: when the build or the load fails.
    """
    build_and_load("pagedserve_cpu_attention", CSRC / "cpu_paged_attention.cpp")


@functools.cache
def cpu_paged_available() -> bool:
    """Whether the C++ op builds and loads here (built once per machine, then cached)."""
    return loads(_load, "CPU paged-attention kernel unavailable, using the torch reference")


def _int32(index: torch.Tensor) -> torch.Tensor:
    return index.to(torch.int32).contiguous()


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged context.

    Same contract as `paged_prefill_attention_ref` (decodes are sequences of one new token).
    Every sequence with at most `MAX_IN_PLACE_QUERY` new tokens (decodes, short chunks) runs in
    one call of the op, reading the pool in place; each longer one runs through the
    reference's per-sequence gather + SDPA.
    Raises ValueError, from the op, when a sequence has more new tokens than context, its
    context needs more blocks than its table has columns, or a table entry it reads is outside
    the pool; table entries past a sequence's last block (padding, -1) are never read.
    """
    check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    out = _attend_in_place(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale
    )
    starts = query_start_loc.tolist()
    long_runs = [
        s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > MAX_IN_PLACE_QUERY
    ]
    if long_runs:
        lens = seq_lens.tolist()
        for seq in long_runs:
            prefill_one_sequence(
                query, key_cache, value_cache, block_tables, seq, starts, lens[seq], scale, out
            )
    return out


def paged_decode_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence; same contract as `paged_decode_attention_ref`.

    A sequence of length 0 yields a zero row. Every sequence has one new token, so all of them
    run in the op's one call: nothing is left for the reference's gather.
    """
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    starts = _one_token_each(query.shape[0])
    return _attend_in_place(query, key_cache, value_cache, block_tables, starts, seq_lens, scale)


def _attend_in_place(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The op's one call over checked arguments: every sequence of at most
    `MAX_IN_PLACE_QUERY` new tokens; the other rows stay zero."""
    _load()
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    torch.ops.pagedserve_cpu.paged_attention(
        out,
        query.contiguous(),
        as_bytes(key_cache),
        as_bytes(value_cache),
        _int32(block_tables),
        _int32(query_start_loc),
        _int32(seq_lens),
        float(scale),
        MAX_IN_PLACE_QUERY,
        format_code(key_cache),
    )
    return out


@functools.lru_cache(maxsize=1024)
def _one_token_each(num_seqs: int) -> torch.Tensor:
    """``query_start_loc`` of ``num_seqs`` sequences of one new token each: ``0 .. num_seqs``.
    Read-only (the op takes it as const), so one tensor per batch size serves every layer."""
    return torch.arange(num_seqs + 1, dtype=torch.int32)
