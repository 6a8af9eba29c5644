"""The constructed workload of `pagedserve bench offline`: prompts, output targets, pool size.

Nothing here is measured from real traffic. Prompt lengths and per-request output targets
(``max_tokens_i``) are drawn from a chosen distribution with the run's seed, and the report
labels both CONSTRUCTED. Prompts and output targets use separate random streams, so a seed gives
the same prompts whatever the output distribution.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from pagedserve.workers.kv.manager import AllocationMode
from pagedserve.workers.kv.memory import blocks_needed

# The engine keeps this fraction of the pool free at admission (EngineConfig.watermark); the
# default pool size adds it back so the whole batch can be admitted at once.
_WATERMARK = 0.01

LengthDraw = Callable[[random.Random, int, int], int]


def _uniform_length(rng: random.Random, low: int, high: int) -> int:
    return rng.randint(low, high)


def _lognormal_length(rng: random.Random, low: int, high: int) -> int:
    """Long-tailed: median at the geometric mean of the bounds, clipped to them."""
    median = math.sqrt(low * high)
    return min(high, max(low, round(rng.lognormvariate(math.log(median), 0.6))))


def _fixed_length(rng: random.Random, low: int, high: int) -> int:
    """Every request gets ``high`` (the old behaviour: ``--max-tokens`` for all)."""
    return high


LENGTH_DISTRIBUTIONS: dict[str, LengthDraw] = {
    "uniform": _uniform_length,
    "lognormal": _lognormal_length,
}
OUTPUT_LEN_DISTRIBUTIONS: dict[str, LengthDraw] = {"fixed": _fixed_length, **LENGTH_DISTRIBUTIONS}


def make_prompts(
    num_prompts: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    excluded_ids: frozenset[int],
    *,
    distribution: str = "uniform",
    seed: int = 0,
) -> list[list[int]]:
    """Constructed prompts: random token ids (no special ids) with lengths from ``distribution``.

    Args:
        num_prompts: how many prompts.
        min_len: shortest prompt.
        max_len: longest prompt.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        excluded_ids: ids never drawn (pad, bos, eos: a prompt full of them means little).
        distribution: a key of ``LENGTH_DISTRIBUTIONS``.
        seed: the same seed gives the same prompts.

    Returns:
        One list of token ids per prompt.
    """
    draw_length = LENGTH_DISTRIBUTIONS[distribution]
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    rng = random.Random(seed)
    lengths = [draw_length(rng, min_len, max_len) for _ in range(num_prompts)]
    return [[rng.choice(allowed) for _ in range(length)] for length in lengths]


def make_output_lens(
    num_requests: int, min_tokens: int, max_tokens: int, *, distribution: str, seed: int = 0
) -> list[int]:
    """Each request's own output target ``max_tokens_i``, unknown to the server in advance.

    Args:
        num_requests: how many targets.
        min_tokens: shortest target (ignored by ``fixed``).
        max_tokens: longest target; every target with ``fixed``.
        distribution: a key of ``OUTPUT_LEN_DISTRIBUTIONS``.
        seed: the same seed gives the same targets.

    Returns:
        One target per request, each in ``[min_tokens, max_tokens]``.
    """
    draw_length = OUTPUT_LEN_DISTRIBUTIONS[distribution]
    # A stream of its own (string seeds hash deterministically), so prompts don't shift with it.
    rng = random.Random(f"output-lens/{seed}")
    return [draw_length(rng, min_tokens, max_tokens) for _ in range(num_requests)]


def default_num_kv_blocks(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    block_size: int,
    kv_allocation: AllocationMode | str,
    max_len: int,
) -> int:
    """Blocks that hold every sequence at full length at once, plus the admission watermark.

    ``paged`` needs ceil((prompt_i + max_tokens_i) / B) blocks per sequence; ``reserve-max``
    reserves ceil(max_len / B) for each, whatever its length.
    """
    if AllocationMode(kv_allocation) is AllocationMode.RESERVE_MAX:
        needed = len(prompt_lens) * blocks_needed(max_len, block_size)
    else:
        pairs = zip(prompt_lens, output_lens, strict=True)
        needed = sum(blocks_needed(n + m, block_size) for n, m in pairs)
    return math.ceil(needed / (1.0 - _WATERMARK)) + 1
