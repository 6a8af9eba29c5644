"""Beam search with real weights (SmolLM2-135M-Instruct): every returned beam of width 4 equals
HF's `generate(num_beams=4, num_return_sequences=4)`, ids and scores, also when the groups are
preempted (recompute, and swap with their shared blocks) in the middle of the search."""

from __future__ import annotations

import pytest
from support.beam import assert_equals_hf
from support.engine import Stepper, finish_clean

from pagedserve.workers.offline.llm import LLM
from pagedserve.workers.protocol.sampling import SamplingParams

TEXTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 10


def engine(loaded, **config) -> LLM:
    options = {"block_size": 4, "num_kv_blocks": 96, "watermark": 0.0, **config}
    return LLM(loaded_model=loaded, enable_prefix_caching=False, **options)


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, False), (0.6, True), (1.5, "never")]
)
def test_real_model_beams_equal_hf(smollm2, length_penalty, early_stopping):
    loaded, reference = smollm2
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    llm = engine(loaded)
    params = SamplingParams(
        n=4,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        assert_equals_hf(
            reference,
            prompt,
            output,
            max_tokens=MAX_TOKENS,
            lp=length_penalty,
            early_stopping=early_stopping,
        )
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_real_model_beams_equal_hf_after_preemption(smollm2, mode):
    loaded, reference = smollm2
    prompts = [loaded.tokenizer.encode(text) for text in TEXTS]
    # Blocks of 4 tokens: the two groups need more than 14 blocks at their widest.
    llm = engine(loaded, num_kv_blocks=14, preemption_mode=mode, max_num_seqs=8)
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params)
    counters = llm.engine.scheduler.counters
    if mode == "swap":
        assert counters.swapped_out > 0 and counters.recomputed == 0
    else:
        assert counters.recomputed > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_equals_hf(reference, prompt, output, max_tokens=MAX_TOKENS)
    finish_clean(llm)


def test_real_model_group_moved_to_another_engine_equals_hf(smollm2):
    """The group leaves its engine mid-search and a peer engine continues it."""
    loaded, reference = smollm2
    prompt = loaded.tokenizer.encode(TEXTS[0])
    source, peer = engine(loaded), engine(loaded, block_size=8, num_kv_blocks=48)
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS)
    source.engine.add_request("moving", prompt, params)
    for _ in range(4):
        source.engine.step()
    handoff = source.engine.export_beam_group("moving")
    assert len(handoff.beams) == 4
    finish_clean(source)
    peer.engine.adopt_beam_group(handoff)
    outputs = Stepper(peer.engine).run_to_end()
    assert_equals_hf(reference, prompt, outputs["moving"], max_tokens=MAX_TOKENS)
    finish_clean(peer)
