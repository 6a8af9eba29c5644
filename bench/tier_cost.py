"""`pagedserve bench tier-cost`: what a prefix hit in the host or disk tier costs, per block,
against prefilling the block: the figures behind `RoutingConfig.tier_host_block_cost` and
`tier_disk_block_cost`.

One engine in this process (no Ray), its pool just large enough for the prompt, with a host
tier or a disk tier. For each prefix length L (blocks of B tokens) and each repeat, with a fresh
random prefix P and fresh suffixes Q (`--suffix-len` tokens), each call `max_tokens=1`:

    cold     P+Q1 on an engine holding nothing of P: prefill of L blocks + Q
    device   P+Q2 right after: P is a device hit, only Q is prefilled
    tier     a filler prompt evicts P from the device into the tier (disk: its files written,
             then dropped from the page cache with `--cold-disk`); P+Q3: L blocks loaded, Q
             prefilled

    prefill per block = (cold − device) / L
    load per block    = the engine's own count of the load (`TierStats.load_time_s`: reading
                        the tier, writing into the device pool) / L
    tier block cost   = load per block / prefill per block

Each figure is the fastest of the repeats (the least disturbed by whatever else the machine
runs; on a shared 2-core machine the medians swing by 10x). The tier call's wall time is
reported too, `(tier − device) / L` per block: it also includes spilling the filler's blocks
out of the way, as it would in service. Costs depend on the model (a larger
model prefills slower per block and moves more KV per block), so measure the one you serve.

    $ pagedserve bench tier-cost --model tiny-llama --json tier_cost.json
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.bench.bench_io import write_json
from pagedserve.workers.model.registry import DEFAULT_MODEL

DEFAULT_LENGTHS = (4, 16, 32)
TIERS = ("host", "disk")


@dataclass(frozen=True)
class TierCostConfig:
    model: str = DEFAULT_MODEL
    lengths_blocks: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 5
    suffix_len: int = 16
    block_size: int = 16
    cold_disk: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths_blocks or min(self.lengths_blocks) < 1:
            raise ValueError(f"lengths must be >= 1 block, got {self.lengths_blocks}")
        if self.repeats < 1 or self.suffix_len < 1 or self.block_size < 1:
            raise ValueError("repeats, suffix_len and block_size must be >= 1")


@dataclass(frozen=True)
class Point:
    """The fastest of the repeats at one prefix length and tier, in seconds."""

    tier: str
    blocks: int
    cold_s: float
    device_s: float
    tier_s: float
    engine_load_s: float  # TierStats.load_time_s of the tier call
    prefill_per_block_s: float
    load_per_block_s: float  # engine_load_s / blocks
    wall_load_per_block_s: float  # (tier_s - device_s) / blocks
    block_cost: float  # load per block / prefill per block


def _timed(llm, prompt: list[int]) -> float:
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    (output,) = llm.generate([prompt], params)
    elapsed = time.perf_counter() - started
    if output.error:
        raise RuntimeError(f"tier-cost: a request failed: {output.error}")
    return elapsed


def _drop_page_cache(directory: str) -> None:
    """Write every block file to disk and drop it from the page cache, so the next read is a
    real one (Linux; a no-op where `posix_fadvise` is missing)."""
    for name in os.listdir(directory):
        if not name.endswith(".kvb"):
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _engine_options(config: TierCostConfig, blocks: int, tier: str, directory: str) -> dict:
    prompt_blocks = blocks + -(-(config.suffix_len + 1) // config.block_size)
    options: dict[str, Any] = {
        "block_size": config.block_size,
        "num_kv_blocks": prompt_blocks + 1,
        "watermark": 0.0,
        "seed": config.seed,
        "max_model_len": (prompt_blocks + 1) * config.block_size,
    }
    big = 1 << 34  # every spilled block fits: nothing is evicted from the tier itself
    if tier == "host":
        options["kv_host_tier_bytes"] = big
    else:
        options |= {"kv_disk_tier_dir": directory, "kv_disk_tier_bytes": big}
    return options


def measure_point(config: TierCostConfig, loaded, blocks: int, tier: str, rng) -> Point:
    """The medians of `config.repeats` cold / device / tier calls at one length and tier."""
    from pagedserve import LLM

    samples: list[tuple[float, float, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-tier-cost-") as directory:
        llm = LLM(
            config.model, loaded_model=loaded, **_engine_options(config, blocks, tier, directory)
        )
        engine = llm.engine
        vocab = engine.loaded.vocab_size
        tokens = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
        prefix_len, filler_len = (
            blocks * config.block_size,
            engine.kv.pool.num_blocks * config.block_size - 1,
        )
        _timed(llm, tokens(prefix_len + config.suffix_len))  # warm-up
        for _ in range(config.repeats):
            prefix = tokens(prefix_len)
            cold = _timed(llm, prefix + tokens(config.suffix_len))
            device = _timed(llm, prefix + tokens(config.suffix_len))
            _timed(llm, tokens(filler_len))  # evicts P into the tier
            engine.tiers.flush()
            if tier == "disk" and config.cold_disk:
                _drop_page_cache(directory)
            load_before = engine.tiers.stats().load_time_s
            hit = _timed(llm, prefix + tokens(config.suffix_len))
            samples.append((cold, device, hit, engine.tiers.stats().load_time_s - load_before))
        engine.close()
    cold, device, hit, engine_load = (min(column) for column in zip(*samples, strict=True))
    prefill_per_block = max(cold - device, 1e-9) / blocks
    load_per_block = engine_load / blocks
    return Point(
        tier=tier,
        blocks=blocks,
        cold_s=cold,
        device_s=device,
        tier_s=hit,
        engine_load_s=engine_load,
        prefill_per_block_s=prefill_per_block,
        load_per_block_s=load_per_block,
        wall_load_per_block_s=max(hit - device, 0.0) / blocks,
        block_cost=load_per_block / prefill_per_block,
    )


def measure(config: TierCostConfig) -> dict[str, Any]:
    from pagedserve.workers.model.loader import load_model

    loaded = load_model(config.model, seed=config.seed)
    rng = random.Random(config.seed)
    points = [
        measure_point(config, loaded, blocks, tier, rng)
        for blocks in config.lengths_blocks
        for tier in TIERS
    ]
    longest = max(config.lengths_blocks)
    recommended = {p.tier: round(p.block_cost, 3) for p in points if p.blocks == longest}
    return {
        "command": "tier-cost",
        "config": asdict(config),
        "points": [asdict(p) for p in points],
        "recommended": recommended,
    }


def format_markdown(data: dict[str, Any]) -> str:
    config = data["config"]
    lines = [
        f"tier-cost: {config['model']}, B={config['block_size']}, "
        f"suffix {config['suffix_len']} tokens, {config['repeats']} repeats, "
        f"disk {'out of' if config['cold_disk'] else 'in'} the page cache",
        "",
        "| tier | L blocks | cold ms | device hit ms | tier hit ms | engine load ms "
        "| prefill ms/block | load ms/block | wall load ms/block | block cost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in data["points"]:
        lines.append(
            f"| {p['tier']} | {p['blocks']} | {p['cold_s'] * 1e3:.1f} | {p['device_s'] * 1e3:.1f} "
            f"| {p['tier_s'] * 1e3:.1f} | {p['engine_load_s'] * 1e3:.2f} "
            f"| {p['prefill_per_block_s'] * 1e3:.2f} | {p['load_per_block_s'] * 1e3:.3f} "
            f"| {p['wall_load_per_block_s'] * 1e3:.3f} | {p['block_cost']:.3f} |"
        )
    lines += ["", f"block cost at the longest prefix: {data['recommended']}"]
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tier-cost",
        help="load cost per block of the host and disk KV tiers vs prefill cost per block",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL)
    add("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="prefix blocks, commas")
    add("--repeats", type=int, default=5)
    add("--suffix-len", type=int, default=16)
    add("--block-size", type=int, default=16)
    add("--cold-disk", action="store_true", help="drop block files from the page cache first")
    add("--seed", type=int, default=0)
    add("--json", metavar="FILE", default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = TierCostConfig(
            model=args.model,
            lengths_blocks=tuple(int(n) for n in args.lengths.split(",")),
            repeats=args.repeats,
            suffix_len=args.suffix_len,
            block_size=args.block_size,
            cold_disk=args.cold_disk,
            seed=args.seed,
        )
    except ValueError as error:
        print(f"pagedserve bench tier-cost: error: {error}")
        return 2
    data = measure(config)
    print(format_markdown(data))
    if args.json:
        write_json(args.json, data)
    return 0
