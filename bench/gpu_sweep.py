"""Memory movers' bandwidth and the launch-configuration sweep (part of `bench.kernels`).

Movers: `write_kv` (one step's new K/V scattered into the pool) and `copy_blocks` /
`gather_blocks` across every layer of a 32-layer model in one launch, as GB/s of bytes read
plus written and as a share of the measured copy bandwidth.

Sweep: every candidate of `kernels.launch.DECODE_CANDIDATES` / `PREFILL_CANDIDATES` at a few
anchor points. A candidate's score is the geometric mean over the points of its latency over
the default's; the lowest wins (a `sweep_winner` row). The defaults in
`pagedserve/kernels/launch.py` are to be set from these rows; the benchmark never changes them.
"""

from __future__ import annotations

import math
import pathlib

import torch

from pagedserve.bench.gpu_rows import RowLog, free_cache, out_of_time, time_ms, timer_name
from pagedserve.bench.kernel_inputs import make_paged
from pagedserve.kernels import copy_blocks, gather_blocks, paged_decode_attention, write_kv
from pagedserve.kernels.launch import DECODE_CANDIDATES, PREFILL_CANDIDATES
from pagedserve.kernels.prefill import paged_prefill_attention

TABLE_COLUMNS = {
    "movers": ["kernel", "mib_moved", "latency_us", "gbps", "share_of_copy_bw"],
    "sweep": ["kernel", "point", "config", "latency_us", "vs_default"],
    "sweep_winner": ["kernel", "config", "geomean_vs_default", "points"],
}
DECODE_POINTS = [(1, 32768), (64, 4096), (256, 2048)]
PREFILL_POINTS = [(1, 8192), (16, 1024)]
NUM_LAYERS = 32


def bench_movers(args, s, log: RowLog, copy_gbps: float) -> None:
    """write_kv, copy_blocks and gather_blocks bandwidth (bytes read + written)."""
    if out_of_time(args):
        return
    dry = s.device.type != "cuda"
    tokens, pool_blocks, pairs = (64, 32, 8) if dry else (16384, 2048, 512)
    layers = 2 if dry else NUM_LAYERS
    shape = (pool_blocks, s.block, s.kv_heads, s.head_dim)
    keys = [torch.randn(shape, device=s.device, dtype=s.dtype) for _ in range(layers)]
    values = [torch.randn(shape, device=s.device, dtype=s.dtype) for _ in range(layers)]
    elt = keys[0].element_size()
    row_bytes = s.kv_heads * s.head_dim * elt
    block_bytes = s.block * row_bytes

    new_k = torch.randn(tokens, s.kv_heads, s.head_dim, device=s.device, dtype=s.dtype)
    new_v = torch.randn_like(new_k)
    slots = torch.randperm(pool_blocks * s.block, device=s.device)[:tokens]
    _mover(log, s, "write_kv", lambda: write_kv(new_k, new_v, keys[0], values[0], slots),
           2 * 2 * tokens * row_bytes, copy_gbps)  # fmt: skip

    perm = torch.randperm(pool_blocks)
    mapping = torch.stack([perm[:pairs], perm[pairs : 2 * pairs]], dim=1).to(s.device)
    moved = 2 * layers * pairs * block_bytes * 2
    _mover(log, s, f"copy_blocks x{layers} layers", lambda: copy_blocks(keys, values, mapping),
           moved, copy_gbps)  # fmt: skip
    ids = perm[:pairs].to(s.device)
    _mover(log, s, f"gather_blocks x{layers} layers", lambda: gather_blocks(keys, values, ids),
           moved, copy_gbps)  # fmt: skip


def _mover(log: RowLog, s, name: str, fn, nbytes: int, copy_gbps: float) -> None:
    try:
        ms = time_ms(fn, s.device)
    except Exception as exc:  # a failing mover must not stop the rest of the run
        log.add(kernel=name, error=f"{type(exc).__name__}: {exc}"[:300])
        return
    gbps = nbytes / (ms * 1e-3) / 1e9
    log.add(kernel=name, mib_moved=nbytes / 2**20, latency_us=ms * 1e3, gbps=gbps,
            share_of_copy_bw=gbps / copy_gbps if copy_gbps else None,
            timer=timer_name(s.device))  # fmt: skip


def run_sweeps(args, s, rows_path: pathlib.Path | None, gen: torch.Generator) -> None:
    dry = s.device.type != "cuda"
    log = RowLog(rows_path, "sweep")
    winners = RowLog(rows_path, "sweep_winner")
    decode_points = [(2, 100)] if dry else DECODE_POINTS
    prefill_points = [(1, 40)] if dry else PREFILL_POINTS
    decode_cands = DECODE_CANDIDATES[:2] if dry else DECODE_CANDIDATES
    prefill_cands = PREFILL_CANDIDATES[:2] if dry else PREFILL_CANDIDATES

    def decode_fn(batch: int, context: int):
        d = make_paged(s, batch, context, gen)
        q = torch.randn(batch, s.heads, s.head_dim, device=s.device, dtype=s.dtype)
        paged = (q, d.key_cache, d.value_cache, d.block_tables, d.seq_lens, s.scale)
        return lambda launch: paged_decode_attention(*paged, launch=launch)

    def prefill_fn(batch: int, prompt: int):
        d = make_paged(s, batch, prompt, gen)
        q = torch.randn(batch * prompt, s.heads, s.head_dim, device=s.device, dtype=s.dtype)
        starts = torch.arange(0, batch * prompt + 1, prompt, device=s.device, dtype=torch.int32)
        paged = (q, d.key_cache, d.value_cache, d.block_tables, starts, d.seq_lens, s.scale)
        return lambda launch: paged_prefill_attention(*paged, launch=launch)

    for kernel, points, cands, build in (
        ("decode", decode_points, decode_cands, decode_fn),
        ("prefill", prefill_points, prefill_cands, prefill_fn),
    ):
        ratios = _sweep_kernel(args, s, log, kernel, points, cands, build)
        _log_winner(winners, kernel, cands, ratios, len(points))


def _sweep_kernel(args, s, log, kernel, points, cands, build) -> dict[int, list[float]]:
    """Time every candidate at every point; return each candidate's latency ratios."""
    ratios: dict[int, list[float]] = {i: [] for i in range(len(cands))}
    for batch, length in points:
        if out_of_time(args):
            break
        run = build(batch, length)
        default_ms = None
        for i, cand in enumerate(cands):
            if out_of_time(args):
                break
            try:
                ms = time_ms(lambda run=run, cand=cand: run(cand), s.device, args.rep_ms)
            except Exception as exc:  # a candidate that fails to compile or run is skipped
                log.add(kernel=kernel, point=f"{batch}x{length}", config=repr(cand),
                        error=f"{type(exc).__name__}: {exc}"[:300])  # fmt: skip
                continue
            default_ms = default_ms if i else ms
            ratio = ms / default_ms if default_ms else None
            if ratio is not None:
                ratios[i].append(ratio)
            log.add(kernel=kernel, point=f"{batch}x{length}", config=repr(cand),
                    latency_us=ms * 1e3, vs_default=ratio, timer=timer_name(s.device))  # fmt: skip
        del run
        free_cache(s.device)
    return ratios


def _log_winner(log: RowLog, kernel: str, cands, ratios: dict[int, list[float]], points: int):
    complete = {i: r for i, r in ratios.items() if r and len(r) == len(ratios[0])}
    if not complete:
        return
    scores = {i: math.exp(sum(map(math.log, r)) / len(r)) for i, r in complete.items()}
    best = min(scores, key=scores.get)
    log.add(kernel=kernel, config=repr(cands[best]), geomean_vs_default=scores[best],
            points=len(complete[best]))  # fmt: skip
