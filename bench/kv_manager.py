"""Microbenchmark: the block manager's work per running sequence per decode step.

Each decode step of the engine asks the manager for one more slot per running sequence and reads
its block table to build the slot mapping and block tables. This measures exactly that work at a
given number of running sequences, with prefix caching on (a block is hashed each time one fills).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from pagedserve.workers.kv.manager import KVCacheManager


@dataclass
class _Sequence:
    request_id: str
    all_token_ids: list[int]
    cache_extra_keys: tuple[str, ...] = ("tiny-llama",)


@dataclass(frozen=True)
class KVManagerBenchResult:
    num_seqs: int
    block_size: int
    prompt_len: int
    decode_steps: int
    us_per_seq_step: float
    us_per_step: float


def run_kv_manager_bench(
    num_seqs: int = 256,
    block_size: int = 16,
    prompt_len: int = 512,
    decode_steps: int = 256,
    seed: int = 0,
) -> KVManagerBenchResult:
    """Time `decode_steps` engine-like decode steps over `num_seqs` running sequences."""
    rng = random.Random(seed)
    blocks_per_seq = -(-(prompt_len + decode_steps) // block_size)
    manager = KVCacheManager(
        num_blocks=num_seqs * blocks_per_seq + 1,
        block_size=block_size,
        max_model_len=prompt_len + decode_steps,
        watermark=0.0,
    )
    seqs = [
        _Sequence(f"r{i}", [rng.randrange(32000) for _ in range(prompt_len)])
        for i in range(num_seqs)
    ]
    for seq in seqs:
        assert manager.allocate_slots(seq, prompt_len) is not None
    started = time.perf_counter()
    for _ in range(decode_steps):
        for seq in seqs:
            seq.all_token_ids.append(rng.randrange(32000))
            if manager.allocate_slots(seq, 1) is None:
                raise RuntimeError("pool sized too small for the benchmark")
            block_ids = manager.get_block_ids(seq.request_id)
            position = len(seq.all_token_ids) - 1
            _slot = block_ids[position // block_size] * block_size + position % block_size
    elapsed = time.perf_counter() - started
    for seq in seqs:
        manager.free(seq.request_id)
    per_step = elapsed / decode_steps
    return KVManagerBenchResult(
        num_seqs,
        block_size,
        prompt_len,
        decode_steps,
        us_per_seq_step=1e6 * per_step / num_seqs,
        us_per_step=1e6 * per_step,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-manager", help="microbenchmark of block-manager work per sequence per decode step"
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_kv_manager_bench(
        args.num_seqs, args.block_size, args.prompt_len, args.decode_steps
    )
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"KV manager: {result.us_per_seq_step:.2f} us per running sequence per decode step "
            f"({result.num_seqs} sequences, B={result.block_size}, prompt {result.prompt_len}, "
            f"{result.decode_steps} steps; {result.us_per_step / 1000:.2f} ms per step)"
        )
    return 0
