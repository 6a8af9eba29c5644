"""Decode-attention microbenchmark: Triton paged kernel vs torch reference vs contiguous.

    python -m pagedserve.bench.kernels [--quick] [--json out/kernels.json]

For each (batch, context) the same random KV is read three ways: the Triton paged decode
kernel (blocks in shuffled order), the torch reference (paged gather + SDPA in float32), and
SDPA on the same data laid out contiguously, `[batch, kv_heads, context, head_dim]`. Decode
is bound by reading the KV cache, so each row reports latency, achieved GB/s of KV read and
that rate as a share of the device copy bandwidth measured at start-up (bytes read plus
written per second by `Tensor.copy_`, i.e. what the memory system sustains). Needs CUDA;
elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import paged_decode_attention, paged_decode_attention_ref
from pagedserve.kernels.decode import choose_num_splits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    """One measurement."""

    batch: int
    context: int
    impl: str
    num_splits: int | None
    latency_us: float
    kv_gbps: float
    share_of_copy_bw: float
    max_abs_err: float | None


def _bench_ms(fn: Callable[[], object], rep_ms: int) -> float:
    """Median milliseconds per call (Triton's do_bench flushes L2 between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms))


def copy_bandwidth_gbps(device: torch.device, mib: int = 2048) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src), rep_ms=200)
    return 2 * (mib << 20) / (ms * 1e-3) / 1e9


@dataclass
class Batch:
    """A decode batch: paged pool plus the same KV laid out contiguously."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: torch.Tensor  # [batch, kv_heads, context, head_dim]
    values: torch.Tensor


def make_batch(args: argparse.Namespace, batch: int, context: int) -> Batch:
    """Random KV on the GPU, blocks handed out in shuffled order across the pool."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[tables].view(batch, blocks_per_seq * args.block_size, *shape[2:])
        return flat[:, :context].transpose(1, 2).contiguous()

    return Batch(
        query=torch.randn(batch, args.heads, args.head_dim, device=device, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        keys=contiguous(key_cache),
        values=contiguous(value_cache),
    )


def contiguous_decode(b: Batch, scale: float) -> torch.Tensor:
    """SDPA over contiguous KV. The query heads sharing a KV head become that head's query
    rows (`[batch, kv_heads, group, dim]`), so the fused flash kernel runs without a GQA
    expansion of K and V; with one token per sequence there is nothing to mask."""
    batch, heads, dim = b.query.shape
    kv_heads = b.keys.shape[1]
    q = b.query.view(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(q, b.keys, b.values, scale=scale)
    return out.reshape(batch, heads, dim)


def bench_config(args: argparse.Namespace, batch: int, context: int, copy_gbps: float) -> list[Row]:
    """Measure every implementation on one (batch, context)."""
    b = make_batch(args, batch, context)
    scale = args.head_dim**-0.5
    paged = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, scale)
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * b.query.element_size()
    expected = contiguous_decode(b, scale).float()
    splits = choose_num_splits(
        batch,
        args.kv_heads,
        b.block_tables.shape[1] * args.block_size,
        args.head_dim,
        b.query.device,
    )
    impls: list[tuple[str, int | None, Callable[[], torch.Tensor]]] = [
        ("triton", splits, lambda: paged_decode_attention(*paged)),
        ("contiguous_sdpa", None, lambda: contiguous_decode(b, scale)),
    ]
    if batch * context <= args.ref_max_tokens:
        impls.append(("torch_ref", None, lambda: paged_decode_attention_ref(*paged)))
    rows = []
    for name, num_splits, fn in impls:
        err = (fn().float() - expected).abs().max().item()
        ms = _bench_ms(fn, args.rep_ms)
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        rows.append(Row(batch, context, name, num_splits, ms * 1e3, gbps, gbps / copy_gbps, err))
    return rows


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=_parse_ints, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=_parse_ints, default=[512, 2048, 8192, 32768])
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1 << 22,
        help="skip configs with more KV tokens than this (memory)",
    )
    p.add_argument(
        "--ref-max-tokens",
        type=int,
        default=1 << 19,
        help="run the slow torch reference only up to this many KV tokens",
    )
    p.add_argument("--rep-ms", type=int, default=60, help="measuring time per point")
    p.add_argument("--quick", action="store_true", help="batches 1,32,256; contexts 512,8192")
    p.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    p.set_defaults(device="cuda")  # a hook for dry runs under the Triton interpreter
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts = [1, 32, 256], [512, 8192]
    return args


def _print_row(row: Row) -> None:
    splits = "-" if row.num_splits is None else str(row.num_splits)
    err = "-" if row.max_abs_err is None else f"{row.max_abs_err:.1e}"
    print(
        f"{row.batch:>5} {row.context:>7} {row.impl:<16} {splits:>6} {row.latency_us:>10.1f} "
        f"{row.kv_gbps:>8.0f} {100 * row.share_of_copy_bw:>6.1f}% {err:>8}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("pagedserve.bench.kernels: no CUDA device here; nothing to benchmark.")
        return 0
    device = torch.device("cuda")
    copy_gbps = copy_bandwidth_gbps(device)
    print(
        f"{torch.cuda.get_device_name(device)}  dtype={args.dtype} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} block={args.block_size}  "
        f"copy bandwidth {copy_gbps:.0f} GB/s (read+write)"
    )
    print(
        f"{'batch':>5} {'context':>7} {'impl':<16} {'splits':>6} {'latency_us':>10} "
        f"{'KV GB/s':>8} {'of copy':>7} {'max_err':>8}"
    )
    rows: list[Row] = []
    for batch in args.batches:
        for context in args.contexts:
            if batch * context > args.max_tokens:
                print(f"{batch:>5} {context:>7} skipped: more than --max-tokens KV tokens")
                continue
            for row in bench_config(args, batch, context, copy_gbps):
                _print_row(row)
                rows.append(row)
            torch.cuda.empty_cache()  # the next config's pool may be much larger
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "copy_gbps": copy_gbps,
            "args": {k: str(v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
