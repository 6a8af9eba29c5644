"""`pagedserve bench pull`: when does fetching a prefix from a peer beat recomputing it?

Two tiny-llama workers, A and B, driven directly (no router, no index). For each prefix length
L (in blocks of B tokens) and each repeat, with a fresh random prefix P of L·B tokens and a
suffix Q of `--suffix-len` tokens:

    prefill   A serves P+Q with max_tokens=1; TTFT (call → first token) on a worker that holds
              nothing of it: the cost of recomputing the prefix
    pull      B.pull_prefix(A, hashes(P), timeout): B fetches P's KV from A (A packs it, Ray
              moves it, B imports it); the call's wall time
    hit       B serves P+Q with max_tokens=1; TTFT now that B caches P (asserted)

Pull wins at L when median(pull) + median(hit) < median(prefill). The crossover is the smallest
measured L from which pull wins at every longer measured L; that is the recommended
`pull_min_blocks` (the router pulls when the holder has at least that many blocks more than the
chosen worker). Workers are idle while measured: under load, prefill gets slower and so does
the pull, so rerun on the target hardware.

    $ pagedserve bench pull --json pull.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.bench.bench_io import ensure_ray
from pagedserve.bench.routing import HelpFormatter
from pagedserve.cluster.config import RoutingConfig
from pagedserve.workers.protocol.requests import WorkerRequest

DEFAULT_LENGTHS = (1, 2, 4, 8, 16, 32, 64)
_WARMUP_PROMPT_LEN = 40
_PULL_TIMEOUT_S = 60.0  # generous: a timed-out pull returns 0 and the point fails loudly


@dataclass(frozen=True)
class PullBenchConfig:
    lengths_blocks: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 5
    suffix_len: int = 16
    block_size: int = 16
    seed: int = 0
    worker_num_cpus: float = 1.0

    def __post_init__(self) -> None:
        if not self.lengths_blocks or min(self.lengths_blocks) < 1:
            raise ValueError(f"lengths must be >= 1 block, got {self.lengths_blocks}")
        if self.repeats < 1 or self.suffix_len < 1:
            raise ValueError("repeats and suffix_len must be >= 1")


@dataclass(frozen=True)
class Sample:
    """One repeat at one length; times in seconds."""

    prefix_blocks: int
    prefill_s: float
    pull_s: float
    hit_s: float
    blocks_pulled: int
    cached_tokens_on_hit: int


@dataclass(frozen=True)
class Point:
    """Medians over the repeats at one prefix length."""

    prefix_blocks: int
    prefix_tokens: int
    prefill_s: float
    pull_s: float
    hit_s: float
    kv_bytes: int  # what one pull moves
    samples: tuple[Sample, ...] = ()

    @property
    def pull_total_s(self) -> float:
        return self.pull_s + self.hit_s

    @property
    def pull_wins(self) -> bool:
        return self.pull_total_s < self.prefill_s


# --- measuring ------------------------------------------------------------------------------


def start_workers(config: PullBenchConfig) -> tuple[Any, Any]:
    """Two workers that publish no events (no index): A holds prefixes, B pulls them."""
    import ray

    from pagedserve.workers.engine.config import EngineConfig
    from pagedserve.workers.worker.actor import Worker

    engine = EngineConfig(model="tiny-llama", block_size=config.block_size)
    remote_worker = ray.remote(Worker).options(num_cpus=config.worker_num_cpus, max_concurrency=64)
    return (
        remote_worker.remote("pull-bench-a", engine, index_name=None),
        remote_worker.remote("pull-bench-b", engine, index_name=None),
    )


async def ttft(handle: Any, request_id: str, token_ids: list[int]) -> tuple[float, int]:
    """(call → first token, in seconds; cached tokens) of a max_tokens=1 request."""
    from pagedserve.workers.protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    first, cached = None, 0
    async for ref in handle.generate.remote(WorkerRequest.fresh(request_id, token_ids, params)):
        delta = await ref
        if delta.token_ids and first is None:
            first = time.perf_counter() - started
        if delta.finish_reason is not None:
            if delta.error:
                raise RuntimeError(f"{request_id} failed: {delta.error}")
            cached = delta.usage.cached_tokens
    assert first is not None, f"{request_id} produced no token"
    return first, cached


async def measure_once(
    a: Any, b: Any, model: str, config: PullBenchConfig, blocks: int, rng: random.Random
) -> Sample:
    from pagedserve.workers.kv.block_hash import hash_full_blocks

    prefix = [rng.randrange(256) for _ in range(blocks * config.block_size)]
    prompt = prefix + [rng.randrange(256) for _ in range(config.suffix_len)]
    tag = f"{blocks}-{rng.getrandbits(32):08x}"
    prefill_s, cached = await ttft(a, f"prefill-{tag}", prompt)
    assert cached == 0, f"A already held a fresh prefix ({cached} cached tokens)"
    hashes = hash_full_blocks(prefix, config.block_size, (model,))
    started = time.perf_counter()
    pulled = await b.pull_prefix.remote(a, hashes, _PULL_TIMEOUT_S)
    pull_s = time.perf_counter() - started
    hit_s, cached = await ttft(b, f"hit-{tag}", prompt)
    if pulled != blocks or cached != len(prefix):
        raise RuntimeError(
            f"{blocks}-block pull moved {pulled} blocks and the request then found "
            f"{cached} cached tokens (expected {blocks} and {len(prefix)})"
        )
    return Sample(blocks, prefill_s, pull_s, hit_s, pulled, cached)


async def kv_bytes_of(a: Any, model: str, config: PullBenchConfig, blocks: int) -> int:
    """Bytes one pull of `blocks` moves: export a prefix A holds and weigh the packed KV."""
    from pagedserve.workers.kv.block_hash import hash_full_blocks

    rng = random.Random(f"weigh {blocks}")
    prompt = [rng.randrange(256) for _ in range(blocks * config.block_size + 1)]
    await ttft(a, f"weigh-{blocks}", prompt)
    keys, packed = await a.export_prefix.remote(
        hash_full_blocks(prompt, config.block_size, (model,))
    )
    assert len(keys) == blocks
    return packed.numel() * packed.element_size()


async def run_pull_bench_async(config: PullBenchConfig, a: Any, b: Any) -> list[Point]:
    info, _ = await asyncio.gather(a.ready.remote(), b.ready.remote())
    model = info.model
    warm_up = list(range(_WARMUP_PROMPT_LEN))
    await asyncio.gather(ttft(a, "warm-up-a", warm_up), ttft(b, "warm-up-b", warm_up))
    await measure_once(a, b, model, config, 2, random.Random("warm-up"))  # first transfer
    rng = random.Random(config.seed)
    points = []
    for blocks in config.lengths_blocks:
        samples = [
            await measure_once(a, b, model, config, blocks, rng) for _ in range(config.repeats)
        ]
        kv_bytes = await kv_bytes_of(a, model, config, blocks)
        points.append(_median_point(blocks, config.block_size, samples, kv_bytes))
    await asyncio.gather(_assert_idle(a), _assert_idle(b))
    return points


async def _assert_idle(handle: Any, deadline_s: float = 10.0) -> None:
    """Every request is done: no stream open, no block held (cached blocks are free)."""
    end = time.monotonic() + deadline_s
    while True:
        stats = await handle.stats.remote()
        if not stats.num_streams and not stats.kv.used_blocks:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{stats.worker_id} still holds blocks: {stats.kv}")
        await asyncio.sleep(0.1)


def _median_point(blocks: int, block_size: int, samples: list[Sample], kv_bytes: int) -> Point:
    return Point(
        blocks,
        blocks * block_size,
        statistics.median(s.prefill_s for s in samples),
        statistics.median(s.pull_s for s in samples),
        statistics.median(s.hit_s for s in samples),
        kv_bytes,
        tuple(samples),
    )


def run_pull_bench(config: PullBenchConfig) -> list[Point]:
    """Start two workers, measure every length, stop them."""
    import ray

    a, b = start_workers(config)
    try:
        return asyncio.run(run_pull_bench_async(config, a, b))
    finally:
        for handle in (a, b):
            ray.kill(handle, no_restart=True)


# --- report ---------------------------------------------------------------------------------


def crossover(points: list[Point]) -> int | None:
    """The smallest length (blocks) from which pull wins at every longer length; None if pull
    loses at the longest measured length."""
    ordered = sorted(points, key=lambda p: p.prefix_blocks)
    found = None
    for point in reversed(ordered):
        if not point.pull_wins:
            break
        found = point.prefix_blocks
    return found


def format_report(config: PullBenchConfig, points: list[Point]) -> str:
    lines = [
        f"pull bench: 2 idle CPU workers of tiny-llama, B={config.block_size}, "
        f"suffix {config.suffix_len} tokens, medians of {config.repeats} repeats",
        "prefill = TTFT on a worker without the prefix; pull = B.pull_prefix(A, hashes); "
        "hit = TTFT on B after the pull",
        "",
        f"{'blocks':>6}{'tokens':>8}{'prefill ms':>12}{'pull ms':>10}{'hit ms':>9}"
        f"{'pull+hit ms':>13}{'saved ms':>10}{'KV KiB':>9}{'MB/s':>8}  pull wins",
    ]
    for p in points:
        rate = p.kv_bytes / p.pull_s / 1e6 if p.pull_s else 0.0
        lines.append(
            f"{p.prefix_blocks:>6}{p.prefix_tokens:>8}{1000 * p.prefill_s:>12.1f}"
            f"{1000 * p.pull_s:>10.1f}{1000 * p.hit_s:>9.1f}{1000 * p.pull_total_s:>13.1f}"
            f"{1000 * (p.prefill_s - p.pull_total_s):>10.1f}{p.kv_bytes / 1024:>9.0f}"
            f"{rate:>8.0f}  {'yes' if p.pull_wins else 'no'}"
        )
    lines.append("")
    found = crossover(points)
    if found is None:
        lines.append("crossover: pull never beats recompute up to the longest length measured")
    else:
        smallest = min(p.prefix_blocks for p in points)
        at_least = " (or fewer: it wins at the shortest measured)" if found == smallest else ""
        lines.append(
            f"crossover: pull+hit beats prefill from {found} blocks "
            f"({found * config.block_size} tokens){at_least} on"
        )
        default = RoutingConfig.pull_min_blocks
        lines.append(f"recommended pull_min_blocks = {found} (RoutingConfig default: {default})")
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = PullBenchConfig()
    parser = subparsers.add_parser(
        "pull",
        help="prefix pull from a peer vs recomputing the prefill, by prefix length",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add(
        "--lengths",
        type=int,
        nargs="+",
        default=list(defaults.lengths_blocks),
        help="prefix lengths in blocks",
    )
    add("--repeats", type=int, default=defaults.repeats, help="repeats per length (medians)")
    add("--suffix-len", type=int, default=defaults.suffix_len, help="tokens after the prefix")
    add("--block-size", type=int, default=defaults.block_size, help="tokens per KV block")
    add("--seed", type=int, default=defaults.seed, help="seeds the prefixes")
    add("--worker-num-cpus", type=float, default=defaults.worker_num_cpus, help="per worker")
    add("--ray-address", default=None, help="join this Ray cluster instead of a local one")
    add("--ray-num-cpus", type=int, default=3, help="CPUs of the local Ray")
    add("--json", metavar="FILE", default=None, help="write config, points and crossover")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = PullBenchConfig(
        lengths_blocks=tuple(sorted(set(args.lengths))),
        repeats=args.repeats,
        suffix_len=args.suffix_len,
        block_size=args.block_size,
        seed=args.seed,
        worker_num_cpus=args.worker_num_cpus,
    )
    ensure_ray(args.ray_address, args.ray_num_cpus)
    points = run_pull_bench(config)
    print(format_report(config, points))
    if args.json:
        result = {
            "config": asdict(config),
            "points": [
                {**asdict(p), "pull_total_s": p.pull_total_s, "pull_wins": p.pull_wins}
                for p in points
            ],
            "crossover_blocks": crossover(points),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
