"""`pagedserve bench beam`: the block counts of (a) read from the allocator, and the output
comparison and summary of (b)."""

from __future__ import annotations

import pytest
from support.engine import finish_clean, load

from pagedserve.bench.beam import _widths, compare_beams, format_throughput, summarise_throughput
from pagedserve.bench.beam_blocks import count_blocks, format_blocks
from pagedserve.bench.compare_protocol import ArmRun
from pagedserve.workers.offline.llm import LLM

PROMPTS = [list(range(3, 40)), list(range(50, 70))]


@pytest.fixture(scope="module")
def tiny_llama():
    return load("tiny-llama")


@pytest.fixture
def llm(tiny_llama):
    return LLM(
        loaded_model=tiny_llama,
        block_size=8,
        num_kv_blocks=256,
        attention_backend="torch",
        enable_prefix_caching=False,
    )


def test_block_counts_come_from_the_allocator_and_sharing_saves_more_with_width(llm):
    counts = [count_blocks(llm, PROMPTS, width, max_tokens=12) for width in (2, 4)]
    for c in counts:
        assert c.steps > 0 and 0 < c.shared_block_steps < c.copied_block_steps
        # At its widest, a request's copies are `width` tables of its whole sequence (the
        # last token's slot is never written: the search ends when it is sampled).
        assert c.peak_copied == [c.width * -(-(len(p) + 12 - 1) // 8) for p in PROMPTS]
        assert all(s < copied for s, copied in zip(c.peak_shared, c.peak_copied, strict=True))
    assert 0 < counts[0].saving < counts[1].saving < 1
    text = format_blocks(counts, "tiny-llama")
    assert "37.6%" in text and f"{counts[1].saving:.1%}" in text
    finish_clean(llm)


def test_beams_are_compared_per_prompt_best_first():
    ours = [[1, 2], [1, 3], [4], [5]]  # two prompts of width 2, flattened
    theirs = [[1, 2], [1, 4], [5], [4]]
    agreement = compare_beams(ours, theirs, width=2)
    assert agreement == {
        "prompts": 2,
        "best_equal": 1,
        "all_equal_in_order": 0,
        "all_equal_as_sets": 1,
    }


def test_throughput_summary_pairs_the_alternated_runs():
    class FakeArm:
        def __init__(self, name, seconds):
            self.name = name
            self.runs = [ArmRun(s, [[1], [2]]) for s in seconds]

    spec = {"width": 2, "prompts": [[7]], "max_tokens": 5}
    result = summarise_throughput(spec, [FakeArm("ours", [1.0, 2.0]), FakeArm("vllm", [4.0, 4.0])])
    assert result["sides"]["ours"]["beam_tokens_per_s"] == [10.0, 5.0]
    assert result["ratios"] == [4.0, 2.0]
    assert result["agreement"]["best_equal"] == 1
    assert "median 3.00" in format_throughput(result)


def test_widths_below_two_are_refused():
    assert _widths("2,4,6") == [2, 4, 6]
    with pytest.raises(Exception, match="widths must be"):
        _widths("1,4")
