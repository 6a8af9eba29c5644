"""CPU decode attention over the paged pool: the candidates the `cpu` backend was chosen from.

    python -m pagedserve.bench.cpu_attention [--threads 2] [--compile] [--json FILE]

Arms, all on the same pools (random block order, ragged contexts from half the target up to it):

    torch     the reference: gather each group's whole context (`aten::index`), SDPA per group
    cpu       the C++ op (`pagedserve.kernels.cpu_paged`): blocks read in place, one per batch
    gather    one block-granular `index_select` of every sequence's blocks, one padded SDPA
    compile   `torch.compile` (inductor, dynamic shapes) of a gather + softmax written as
              reductions, block count padded to powers of two (`--compile`: ~30 s to build)

`--prefill` instead times one sequence's chunk of q_len new tokens over a cached prefix, the
op against the reference, for the crossover `MAX_IN_PLACE_QUERY` encodes.

Each cell is the best of `--reps` calls in milliseconds (best, not median: the machine is
shared, and other load only ever adds time); every arm's output is checked against the
reference first. The default shape is SmolLM2-135M's attention: 9 query heads over 3 KV heads,
head_dim 64, block size 16, float32.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_paged import cpu_paged_available, paged_decode_attention_cpu
from pagedserve.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from pagedserve.kernels.testing import make_paged_kv

BATCHES = (1, 8, 32, 64)
CONTEXTS = (16, 100, 300, 1000)


def _gather_sdpa(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Every sequence's blocks in one `index_select`, padded to the longest, one SDPA."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_blocks].long().clamp_min(0).flatten()
    length = num_blocks * block_size
    keys = key_cache.index_select(0, table).view(num_seqs, length, num_kv_heads, head_dim)
    values = value_cache.index_select(0, table).view(num_seqs, length, num_kv_heads, head_dim)
    mask = (torch.arange(length)[None, :] < seq_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2)


def _reductions(query, key_cache, value_cache, table, seq_lens, scale):
    """Decode attention as gather + broadcast reductions, for inductor to fuse (no matmul)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    keys = key_cache[table].flatten(1, 2)  # [S, L, kv_heads, D]
    values = value_cache[table].flatten(1, 2)
    q = query.view(num_seqs, 1, num_kv_heads, group, head_dim)
    scores = (q * keys[:, :, :, None, :]).sum(-1) * scale  # [S, L, kv_heads, group]
    positions = torch.arange(table.shape[1] * block_size)
    hidden = (positions[None, :] >= seq_lens[:, None])[:, :, None, None]
    weights = scores.masked_fill(hidden, float("-inf")).softmax(1)
    return (weights[..., None] * values[:, :, :, None, :]).sum(1).reshape(query.shape)


def _compiled_arm() -> Callable[..., torch.Tensor]:
    compiled = torch.compile(_reductions, dynamic=True)

    def run(query, key_cache, value_cache, block_tables, seq_lens, scale):
        block_size = key_cache.shape[1]
        needed = -(-int(seq_lens.max()) // block_size)
        bucket = 1 << (needed - 1).bit_length()  # powers of two bound the recompiles
        table = block_tables.long().clamp_min(0)
        if table.shape[1] < bucket:
            table = F.pad(table, (0, bucket - table.shape[1]))
        return compiled(
            query, key_cache, value_cache, table[:, :bucket].contiguous(), seq_lens.long(), scale
        )

    return run


def _best_ms(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    torch.set_num_threads(args.threads)
    arms: dict[str, Callable[..., torch.Tensor]] = {
        "torch": paged_decode_attention_ref,
        "cpu": paged_decode_attention_cpu,
        "gather": _gather_sdpa,
    }
    if args.compile:
        arms["compile"] = _compiled_arm()
    gen = torch.Generator().manual_seed(0)
    group = args.heads // args.kv_heads
    rows = []
    print(f"threads {args.threads}; best-of-{args.reps} ms; heads {args.heads}/{args.kv_heads}")
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{name:>10}" for name in arms))
    with torch.inference_mode():
        for batch in BATCHES:
            for ctx in CONTEXTS:
                lens = [max(1, ctx * (batch + i) // (2 * batch)) for i in range(batch)]
                kv = make_paged_kv(
                    lens, args.kv_heads, args.head_dim, args.block_size, generator=gen
                )
                query = torch.randn(batch, group * args.kv_heads, args.head_dim, generator=gen)
                call = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
                call += (args.head_dim**-0.5,)
                expected = paged_decode_attention_ref(*call)
                row: dict[str, object] = {"batch": batch, "max_context": ctx}
                for name, fn in arms.items():
                    started = time.perf_counter()
                    torch.testing.assert_close(fn(*call), expected, atol=1e-4, rtol=1e-4)
                    row[f"{name}_first_call_s"] = time.perf_counter() - started
                    row[f"{name}_ms"] = _best_ms(lambda fn=fn, call=call: fn(*call), args.reps)
                rows.append(row)
                cells = " ".join(f"{row[f'{name}_ms']:10.3f}" for name in arms)
                print(f"{batch:5d} {ctx:5d} {cells}", flush=True)
    return rows


def _op_only(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    """The C++ op on every sequence, however long its query run."""
    out = torch.zeros_like(query)
    torch.ops.pagedserve_cpu.paged_attention(
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, 1 << 30
    )
    return out


def run_prefill(args: argparse.Namespace) -> list[dict[str, object]]:
    assert cpu_paged_available(), "the C++ op did not build"
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"threads {args.threads}; best-of-{args.reps} ms; one sequence, 256 cached tokens")
    print(f"{'q_len':>5} {'torch':>10} {'cpu op':>10}")
    with torch.inference_mode():
        for q_len in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            kv = make_paged_kv([256 + q_len], args.kv_heads, args.head_dim, args.block_size)
            query = torch.randn(q_len, args.heads, args.head_dim, generator=gen)
            starts = torch.tensor([0, q_len], dtype=torch.int32)
            call = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens)
            call += (args.head_dim**-0.5,)
            expected = paged_prefill_attention_ref(*call)
            torch.testing.assert_close(_op_only(*call), expected, atol=1e-4, rtol=1e-4)
            row = {
                "q_len": q_len,
                "torch_ms": _best_ms(
                    lambda call=call: paged_prefill_attention_ref(*call), args.reps
                ),
                "cpu_op_ms": _best_ms(lambda call=call: _op_only(*call), args.reps),
            }
            rows.append(row)
            print(f"{q_len:5d} {row['torch_ms']:10.3f} {row['cpu_op_ms']:10.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="add the torch.compile arm")
    parser.add_argument("--prefill", action="store_true", help="time query runs, not decode")
    parser.add_argument("--json", metavar="FILE", default=None)
    args = parser.parse_args()
    rows = run_prefill(args) if args.prefill else run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
