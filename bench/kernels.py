"""Attention-kernel benchmark: Triton paged kernels vs SDPA / flash on the same data.

    python -m pagedserve.bench.kernels [--quick] [--out-dir DIR] [--budget-s S] [--dry-run]

Llama-8B attention shapes by default (32 query heads, 8 KV heads, head_dim 128, block 16,
bf16). The same random KV is read by the Triton paged kernels (blocks in shuffled order) and
by `F.scaled_dot_product_attention` on a contiguous copy, with the backend left to torch
(`sdpa`) and forced to flash attention (`sdpa_flash`). Sections, in the order they run (the
most important first, so a budget cut loses the least):

- decode: batch x context grid; time, TFLOP/s, KV GB/s and its share of the measured copy
  bandwidth (bytes read plus written by `Tensor.copy_`, ~4.3 TB/s on an H200);
- prefill: causal prompts, no cache;
- mixed: one 32k decode among prefill chunks and short decodes, with the decodes in the
  prefill launch or through the split-KV decode kernel (`split_decodes`);
- uneven: one decode batch of very uneven lengths, per split policy;
- cuda_graph: small decode configs, stream launch vs CUDA-graph replay;
- movers and sweep (`pagedserve.bench.gpu_sweep`): write_kv / block-copy bandwidth, then
  every launch-config candidate;
- jit: compiled variants per kernel at the end (the no-churn check, on a real cache).

Every row is appended to `DIR/bench_rows.jsonl` as it is measured; `DIR/kernels.json` and
`DIR/kernels.md` are written at the end. `--dry-run` runs tiny shapes on the CPU under the
Triton interpreter (TRITON_INTERPRET=1 must be set before start): a rehearsal of the code
path whose timings mean nothing. Without CUDA and without `--dry-run` it says so and exits 0.

The KV each section measures on and the torch references are in `bench/kernel_inputs.py`; the
movers and the sweep in `bench/gpu_sweep.py`; the row log and timers in `bench/gpu_rows.py`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.bench import gpu_sweep
from pagedserve.bench.gpu_rows import (
    RowLog,
    copy_bandwidth_gbps,
    device_refusal,
    free_cache,
    graph_time_ms,
    out_of_time,
    read_rows,
    render_markdown,
    time_ms,
    timer_name,
)
from pagedserve.bench.kernel_inputs import (
    Shapes,
    make_paged,
    sdpa_backend,
    sdpa_decode,
    varlen_batch,
)
from pagedserve.kernels import (
    DecodeLaunch,
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from pagedserve.kernels.decode import choose_num_splits
from pagedserve.kernels.testing import compiled_variants

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TABLE_COLUMNS = {
    "decode": ["batch", "context", "impl", "splits", "latency_us", "tflops", "kv_gbps",
               "share_of_copy_bw", "max_abs_err"],
    "prefill": ["batch", "prompt", "impl", "latency_us", "tflops", "max_abs_err"],
    "mixed": ["impl", "latency_us", "max_abs_err", "note"],
    "uneven": ["impl", "latency_us", "kv_gbps", "share_of_copy_bw", "max_abs_err"],
    "cuda_graph": ["batch", "context", "stream_us", "graph_us", "saved_us"],
    **gpu_sweep.TABLE_COLUMNS,
    "jit": ["kernel", "compiled_variants"],
}  # fmt: skip


def _measure(
    log: RowLog,
    s: Shapes,
    fn: Callable[[], torch.Tensor],
    expected: torch.Tensor | None,
    rep_ms: int,
    *,
    flops: float | None = None,
    nbytes: float | None = None,
    copy_gbps: float | None = None,
    **fields,
) -> dict:
    """Time `fn` and log one row with its rates; a failing implementation logs its error."""
    try:
        err = (fn().float() - expected).abs().max().item() if expected is not None else None
        ms = time_ms(fn, s.device, rep_ms)
    except Exception as exc:  # one backend failing must not stop the others
        return log.add(**fields, error=f"{type(exc).__name__}: {exc}"[:300])
    seconds = ms * 1e-3
    if flops:
        fields["tflops"] = flops / seconds / 1e12
    if nbytes:
        fields["kv_gbps"] = nbytes / seconds / 1e9
        fields["share_of_copy_bw"] = fields["kv_gbps"] / copy_gbps if copy_gbps else None
    return log.add(**fields, latency_us=ms * 1e3, max_abs_err=err, timer=timer_name(s.device))


def bench_decode(args, s: Shapes, log: RowLog, copy_gbps: float, gen) -> None:
    for batch in args.batches:
        for context in args.contexts:
            if batch * context <= args.max_tokens and not out_of_time(args):
                _decode_config(args, s, log, copy_gbps, gen, batch, context)
                free_cache(s.device)


def _decode_config(args, s: Shapes, log: RowLog, copy_gbps, gen, batch, context) -> None:
    d = make_paged(s, batch, context, gen)
    q = torch.randn(batch, s.heads, s.head_dim, device=s.device, dtype=s.dtype)
    paged = (q, d.key_cache, d.value_cache, d.block_tables, d.seq_lens, s.scale)
    expected = sdpa_decode(q, d, s.scale, flash=False).float()
    max_context = d.block_tables.shape[1] * s.block
    splits = choose_num_splits(batch, s.kv_heads, max_context, s.head_dim, s.device)
    flops = 4 * batch * s.heads * context * s.head_dim
    kv_bytes = 2 * batch * context * s.kv_heads * s.head_dim * q.element_size()
    impls = [
        ("triton", splits, lambda: paged_decode_attention(*paged)),
        ("sdpa", None, lambda: sdpa_decode(q, d, s.scale, flash=False)),
        ("sdpa_flash", None, lambda: sdpa_decode(q, d, s.scale, flash=True)),
    ]
    for name, nsplits, fn in impls:
        _measure(log, s, fn, expected, args.rep_ms, flops=flops, nbytes=kv_bytes,
                 copy_gbps=copy_gbps, batch=batch, context=context, impl=name,
                 splits=nsplits)  # fmt: skip


def bench_prefill(args, s: Shapes, log: RowLog, gen) -> None:
    for batch, prompt in args.prefills:
        if not out_of_time(args):
            _prefill_config(args, s, log, gen, batch, prompt)
            free_cache(s.device)


def _prefill_config(args, s: Shapes, log: RowLog, gen, batch: int, prompt: int) -> None:
    d = make_paged(s, batch, prompt, gen)
    tokens = batch * prompt
    q = torch.randn(tokens, s.heads, s.head_dim, device=s.device, dtype=s.dtype)
    starts = torch.arange(0, tokens + 1, prompt, device=s.device, dtype=torch.int32)
    paged = (q, d.key_cache, d.value_cache, d.block_tables, starts, d.seq_lens, s.scale)
    q4 = q.view(batch, prompt, s.heads, s.head_dim).transpose(1, 2)
    group = s.heads // s.kv_heads
    k_full = d.keys.repeat_interleave(group, dim=1)  # flash wants equal head counts
    v_full = d.values.repeat_interleave(group, dim=1)

    def sdpa(flash: bool) -> torch.Tensor:
        with sdpa_backend(flash):
            out = F.scaled_dot_product_attention(q4, k_full, v_full, is_causal=True, scale=s.scale)
        return out.transpose(1, 2).reshape(tokens, s.heads, s.head_dim)

    expected = sdpa(False).float()
    flops = 4 * batch * s.heads * s.head_dim * prompt * (prompt + 1) / 2
    for name, fn in (
        ("triton", lambda: paged_prefill_attention(*paged)),
        ("sdpa", lambda: sdpa(False)),
        ("sdpa_flash", lambda: sdpa(True)),
    ):
        _measure(log, s, fn, expected, args.rep_ms, flops=flops, batch=batch, prompt=prompt,
                 impl=name)  # fmt: skip


def bench_mixed(args, s: Shapes, log: RowLog, gen) -> None:
    """One long decode among prefill chunks and short decodes: one launch or two."""
    if out_of_time(args):
        return
    long_ctx, chunk, short_ctx, n_chunks, n_short = args.mixed
    ctx_lens = [long_ctx] + [2 * chunk] * n_chunks + [short_ctx] * n_short
    q_lens = [1] + [chunk] * n_chunks + [1] * n_short
    paged = varlen_batch(s, ctx_lens, q_lens, gen)
    expected = paged_prefill_attention_ref(*paged).float()
    note = f"1 decode @{long_ctx} + {n_chunks} chunks of {chunk} + {n_short} decodes @{short_ctx}"
    for name, fn in (
        ("triton", lambda: paged_prefill_attention(*paged)),
        ("triton_split_decodes", lambda: paged_prefill_attention(*paged, split_decodes=True)),
    ):
        _measure(log, s, fn, expected, args.rep_ms, impl=name, note=note)
    free_cache(s.device)


def bench_uneven(args, s: Shapes, log: RowLog, copy_gbps: float, gen) -> None:
    """A decode batch of very uneven lengths (fixed seed), per split policy."""
    if out_of_time(args):
        return
    batch, lo, hi = args.uneven
    lens = torch.exp(
        torch.empty(batch).uniform_(0, 1, generator=gen) * torch.log(torch.tensor(hi / lo))
    )
    ctx_lens = [max(lo, min(hi, int(lo * x))) for x in lens.tolist()]
    ctx_lens[0] = hi  # always one sequence at the longest context
    paged = varlen_batch(s, ctx_lens, [1] * batch, gen)
    q, kc, vc, tables, _, seq_lens, scale = paged
    decode_args = (q, kc, vc, tables, seq_lens, scale)
    expected = paged_prefill_attention_ref(*paged).float()
    kv_bytes = 2 * sum(ctx_lens) * s.kv_heads * s.head_dim * q.element_size()
    for min_tokens in (None, 256, 1024):
        launch = DecodeLaunch(min_split_tokens=min_tokens)
        _measure(log, s, lambda launch=launch: paged_decode_attention(*decode_args, launch=launch),
                 expected, args.rep_ms, nbytes=kv_bytes, copy_gbps=copy_gbps,
                 impl=f"triton min_split_tokens={min_tokens}")  # fmt: skip
    free_cache(s.device)


def bench_cuda_graph(args, s: Shapes, log: RowLog, gen) -> None:
    """Small decodes are launch-bound: stream launch vs CUDA-graph replay of the same call."""
    for batch, context in args.graph_configs:
        if not out_of_time(args):
            _graph_config(args, s, log, gen, batch, context)


def _graph_config(args, s: Shapes, log: RowLog, gen, batch: int, context: int) -> None:
    d = make_paged(s, batch, context, gen)
    q = torch.randn(batch, s.heads, s.head_dim, device=s.device, dtype=s.dtype)
    paged = (q, d.key_cache, d.value_cache, d.block_tables, d.seq_lens, s.scale)

    def fn() -> torch.Tensor:
        return paged_decode_attention(*paged)

    stream_ms = time_ms(fn, s.device, args.rep_ms)
    graph_ms = graph_time_ms(fn, s.device, args.rep_ms)
    graph_us = None if graph_ms is None else graph_ms * 1e3
    log.add(batch=batch, context=context, stream_us=stream_ms * 1e3, graph_us=graph_us,
            saved_us=None if graph_us is None else stream_ms * 1e3 - graph_us,
            timer=timer_name(s.device),
            note=None if graph_us is not None else "no CUDA: graph not timed")  # fmt: skip


def log_jit(log: RowLog) -> None:
    """Compiled variants per kernel after the whole run (None under the interpreter)."""
    from pagedserve.kernels import block_ops, decode, kv_write, prefill

    for kernel in (decode.decode_split_kernel, decode.decode_reduce_kernel, prefill.prefill_kernel,
                   kv_write.write_kv_kernel, block_ops.copy_blocks_kernel):  # fmt: skip
        log.add(kernel=kernel.fn.__name__, compiled_variants=compiled_variants(kernel))


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=_ints, default=[512, 2048, 8192, 32768])
    p.add_argument("--prefills", type=_pairs, help="BATCHxPROMPT list",
                   default=_pairs("1x512,1x2048,1x8192,1x32768,8x2048,32x512"))  # fmt: skip
    p.add_argument("--mixed", type=_ints, default=[32768, 1024, 2048, 4, 32],
                   help="long_ctx,chunk,short_ctx,n_chunks,n_short")  # fmt: skip
    p.add_argument("--uneven", type=_ints, default=[64, 64, 32768], help="batch,min_len,max_len")
    p.add_argument(
        "--graph-configs", type=_pairs, default=_pairs("1x512,8x512,32x512,1x2048,8x2048,32x2048")
    )
    p.add_argument(
        "--max-tokens", type=int, default=1 << 22, help="skip decodes with more KV tokens"
    )
    p.add_argument("--rep-ms", type=int, default=60, help="measuring time per point")
    p.add_argument("--quick", action="store_true", help="a smaller decode grid")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    p.add_argument("--budget-s", type=float, help="skip what is left after this many seconds")
    p.add_argument(
        "--out-dir", type=pathlib.Path, help="bench_rows.jsonl, kernels.json, kernels.md"
    )
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter")
    args = p.parse_args(argv)
    args.device = "cuda"
    if args.quick:
        args.batches, args.contexts = [1, 32, 256], [512, 8192]
    if args.dry_run:
        _shrink_for_dry_run(args)
    args.deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    return args


def _shrink_for_dry_run(args: argparse.Namespace) -> None:
    args.device, args.dtype = "cpu", "fp32"
    args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 32, 16
    args.batches, args.contexts = [1, 3], [40, 100]
    args.prefills, args.mixed, args.uneven = [(1, 40), (2, 24)], [200, 24, 40, 1, 2], [4, 16, 120]
    args.graph_configs, args.rep_ms = [(1, 40)], 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (refused := device_refusal(args.dry_run, "kernels")) is not None:
        return refused
    device = torch.device(args.device)
    s = Shapes(
        args.heads, args.kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype], device
    )
    rows_path = args.out_dir / "bench_rows.jsonl" if args.out_dir else None
    copy_gbps = copy_bandwidth_gbps(device, mib=2048 if device.type == "cuda" else 8)
    RowLog(rows_path, "device").add(
        name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal)",
        torch=torch.__version__, copy_gbps=copy_gbps, timer=timer_name(device))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    bench_decode(args, s, RowLog(rows_path, "decode"), copy_gbps, gen)
    bench_prefill(args, s, RowLog(rows_path, "prefill"), gen)
    bench_mixed(args, s, RowLog(rows_path, "mixed"), gen)
    bench_uneven(args, s, RowLog(rows_path, "uneven"), copy_gbps, gen)
    bench_cuda_graph(args, s, RowLog(rows_path, "cuda_graph"), gen)
    gpu_sweep.bench_movers(args, s, RowLog(rows_path, "movers"), copy_gbps)
    if not args.no_sweep:
        gpu_sweep.run_sweeps(args, s, rows_path, gen)
    log_jit(RowLog(rows_path, "jit"))
    if args.out_dir:
        write_reports(args.out_dir, rows_path)
    return 0


def write_reports(out_dir: pathlib.Path, rows_path: pathlib.Path) -> None:
    """kernels.json (every row) and kernels.md (one table per section) from the row log."""
    rows = [
        r
        for r in read_rows(rows_path)
        if r.get("section") in TABLE_COLUMNS or r.get("section") == "device"
    ]
    (out_dir / "kernels.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    (out_dir / "kernels.md").write_text(render_markdown(rows, TABLE_COLUMNS))


if __name__ == "__main__":
    sys.exit(main())
