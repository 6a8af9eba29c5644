"""Part (a) of `pagedserve bench beam`: KV blocks a beam search holds, shared against a copy
per beam, counted from the engine's allocator.

Each request runs alone on the offline engine (prefix caching off, so a block in use is a
block held). After every step two counts are read from `KVCacheManager.usage()`:

    shared   the pool's blocks in use (`used_blocks`): what the beams hold, sharing the
             prompt's blocks and their common prefix by reference
    copies   the block-table entries of the live beams (`block_table_entries`): what they
             would hold if each beam had its own copy of every block it reads

The saving is 1 - shared / copies, over the sum of the per-step counts of every request (the
time-averaged memory a request holds), as the paper's Figure 15 averages its traces. A beam
that the search drops frees its blocks in the step that drops it, so both counts cover only
the live beams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCounts:
    """One width's counts over the workload: block-steps held, and each request's peak."""

    width: int
    shared_block_steps: int
    copied_block_steps: int
    steps: int
    peak_shared: list[int]  # per request, its most blocks in use at once
    peak_copied: list[int]

    @property
    def saving(self) -> float:
        """1 - shared / copies, of the time-averaged blocks held."""
        if not self.copied_block_steps:
            return 0.0
        return 1.0 - self.shared_block_steps / self.copied_block_steps

    @property
    def mean_shared(self) -> float:
        return self.shared_block_steps / self.steps if self.steps else 0.0

    @property
    def mean_copied(self) -> float:
        return self.copied_block_steps / self.steps if self.steps else 0.0


def count_blocks(llm, prompts: Sequence[list[int]], width: int, max_tokens: int) -> BlockCounts:
    """Run each prompt's beam search alone on `llm`'s engine and count its blocks each step.

    Args:
        llm: an offline `LLM` with prefix caching off and an empty pool.
        prompts: token ids.
        width: the beam width (`n` with `use_beam_search`).
        max_tokens: tokens per beam (`ignore_eos`, so every request runs to it).
    """
    from pagedserve.workers.kv.checks import assert_no_leaks
    from pagedserve.workers.protocol.sampling import SamplingParams

    engine = llm.engine
    params = SamplingParams(
        n=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    shared = copied = steps = 0
    peak_shared: list[int] = []
    peak_copied: list[int] = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"beam-{width}-{index}", prompt, params)
        high_shared = high_copied = 0
        while engine.has_unfinished_requests():
            engine.step()
            usage = engine.usage()
            if not usage.used_blocks:  # the step that ended the search freed everything
                continue
            shared += usage.used_blocks
            copied += usage.block_table_entries
            steps += 1
            high_shared = max(high_shared, usage.used_blocks)
            high_copied = max(high_copied, usage.block_table_entries)
        peak_shared.append(high_shared)
        peak_copied.append(high_copied)
        assert_no_leaks(engine.kv)
    return BlockCounts(width, shared, copied, steps, peak_shared, peak_copied)


def format_blocks(counts: Sequence[BlockCounts], workload: str) -> str:
    lines = [
        f"(a) KV blocks held per request, beam search, {workload}",
        f"{'width':>5}{'shared (mean)':>15}{'copy/beam (mean)':>18}{'saving':>9}"
        f"{'peak shared':>13}{'peak copies':>13}",
    ]
    for c in counts:
        lines.append(
            f"{c.width:>5}{c.mean_shared:>15.1f}{c.mean_copied:>18.1f}{c.saving:>9.1%}"
            f"{max(c.peak_shared):>13}{max(c.peak_copied):>13}"
        )
    lines.append("paper (vLLM on Alpaca, widths 2-6): 37.6% to 55.2% saved")
    return "\n".join(lines)
