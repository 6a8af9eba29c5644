"""Speculative decoding in the engine: outputs never change, and the pools stay exact.

Greedy outputs with speculation equal those without it and HF's own greedy decode, for both
proposers, k = 1, 3, 5 and block sizes 8 and 16, with prefix sharing, forced preemption,
chunked prefill and stops inside an accepted run. The leak check (tests/support/leaks.py)
also covers the draft model's own pool.
"""

from __future__ import annotations

import pytest
from support.engine import finish_clean
from support.spec import repetitive_prompts, save_truncated_tiny_llama

from pagedserve import LLM, SamplingParams
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.spec.config import SpeculativeConfig

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def truncated_draft(tmp_path_factory):
    """A 2-layer cut of tiny-llama: agrees with the target part of the time."""
    return save_truncated_tiny_llama(tmp_path_factory.mktemp("draft-2-layers"))


def spec_for(method: str, k: int, draft_model: str = "tiny-llama") -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_tokens": k}
    return {"method": "draft", "num_tokens": k, "draft_model": draft_model}


def run(loaded, prompts, params=GREEDY, **config):
    llm = LLM(loaded_model=loaded, model="tiny-llama", **config)
    outputs = llm.generate(prompts, params)
    finish_clean(llm)
    return llm, [o.outputs[0].token_ids for o in outputs]


def assert_same_as_reference(tokens, prompts, reference, max_tokens=MAX_TOKENS):
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == reference.greedy(prompt, max_tokens), prompt


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-2-layers"])
def test_greedy_output_identical_with_speculation(
    tiny_llama, truncated_draft, method, k, block_size
):
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=block_size + k)
    draft = {"draft-self": "tiny-llama", "draft-2-layers": truncated_draft}.get(method)
    spec = spec_for("ngram" if draft is None else "draft", k, draft)
    config = dict(block_size=block_size, num_kv_blocks=64)
    _, plain = run(loaded, prompts, **config)
    llm, speculated = run(loaded, prompts, speculative=spec, **config)
    assert speculated == plain
    assert_same_as_reference(speculated, prompts, reference)
    stats = llm.spec_stats()
    assert stats.num_draft_tokens > 0 and stats.num_verified > 0
    if method == "draft-self":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif method == "draft-2-layers":  # a cut of the target: some, not all, are accepted
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    else:  # prompt lookup hits only where the random model repeats itself
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_verified


def test_prefix_sharing_never_caches_a_rejected_draft(tiny_llama, truncated_draft):
    """Prompts share a 32-token prefix and a 2-layer draft has many drafts rejected; every
    block left cached in the pool holds a chain of tokens some request really has (prompt +
    output), never a rejected draft."""
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 6, seed=11, prefix=32)
    llm = LLM(
        loaded_model=loaded,
        model="tiny-llama",
        block_size=8,
        num_kv_blocks=96,
        speculative=spec_for("draft", 3, truncated_draft),
    )
    outputs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert_same_as_reference(tokens, prompts, reference)
    assert all(o.num_cached_tokens >= 32 for o in outputs[1:])
    real_chains = set()
    for prompt, output in zip(prompts, tokens, strict=True):
        sequence = prompt + output
        parent = None
        for start in range(0, len(sequence) - 7, 8):
            parent = block_hash(parent, tuple(sequence[start : start + 8]), ("tiny-llama",))
            real_chains.add(parent)
    cached = set(llm.engine.kv.pool.cached)
    assert cached and cached <= real_chains
    stats = llm.engine.spec_stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # partial acceptance
    finish_clean(llm)


def test_ngram_accepts_part_of_its_drafts_and_output_is_unchanged(tiny_llama):
    """Prompts (seed 17) where the model repeats itself: prompt lookup proposes from the
    request's own tokens and some drafts, not all, are accepted."""
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=17)
    llm, tokens = run(
        loaded, prompts, block_size=8, num_kv_blocks=64, speculative=spec_for("ngram", 3)
    )
    assert_same_as_reference(tokens, prompts, reference)
    stats = llm.engine.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_forced_preemption_mid_speculation_keeps_outputs(tiny_llama, method, mode):
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 6, seed=5)
    llm = LLM(
        loaded_model=loaded,
        model="tiny-llama",
        block_size=8,
        num_kv_blocks=14,  # too few for six sequences at once: preemptions are certain
        watermark=0.0,
        preemption_mode=mode,
        num_swap_blocks=64,
        speculative=spec_for(method, 3),
    )
    outputs = llm.generate(prompts, GREEDY)
    assert_same_as_reference([o.outputs[0].token_ids for o in outputs], prompts, reference)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.spec_stats().num_verified > 0
    finish_clean(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_and_a_budget_that_cuts_drafts(tiny_llama, method):
    """A 7-token step budget: prompts come in chunks beside verify chunks, and drafts that
    would pass the budget are cut (a decode's own token always fits)."""
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=9)
    llm, tokens = run(
        loaded,
        prompts,
        block_size=8,
        num_kv_blocks=64,
        max_num_batched_tokens=7,
        max_model_len=256,
        speculative=spec_for(method, 5),
    )
    assert_same_as_reference(tokens, prompts, reference)
    assert llm.engine.spec_stats().num_verified > 0


def test_stops_inside_an_accepted_run_truncate_exactly(tiny_llama):
    """Stop ids, EOS, stop strings and max_tokens that fall inside a run of accepted drafts
    end the output exactly where the engine without speculation ends it."""
    loaded, _ = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=21)
    _, free_run = run(loaded, prompts, block_size=8, num_kv_blocks=64)
    tokenizer = loaded.tokenizer
    eos = min(loaded.eos_token_ids)
    variants = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[free_run[0][6]]),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[free_run[1][3]]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stop=[tokenizer.decode(free_run[2][5:7])],
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[eos]),
    ]
    for params in variants:
        plain = ended(loaded, prompts, params)
        for method in ["ngram", "draft"]:
            speculated = ended(loaded, prompts, params, speculative=spec_for(method, 5))
            assert speculated == plain, (method, params)


def ended(loaded, prompts, params, **config):
    """Each output's tokens, text and finish reason."""
    llm = LLM(loaded_model=loaded, model="tiny-llama", block_size=8, num_kv_blocks=64, **config)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    finish_clean(llm)
    return [(c.token_ids, c.text, c.finish_reason) for c in outputs]


def test_seeded_sampling_with_speculation_repeats_and_ignores_the_batch(tiny_llama):
    loaded, _ = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=3)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=100 + i)
        for i in range(len(prompts))
    ]
    config = dict(block_size=8, num_kv_blocks=64, speculative=spec_for("ngram", 3))
    llm = LLM(loaded_model=loaded, model="tiny-llama", **config)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    pairs = zip(prompts, params, strict=True)
    alone = [llm.generate([p], [s])[0].outputs[0].token_ids for p, s in pairs]
    assert together == alone
    again = LLM(loaded_model=loaded, model="tiny-llama", **config)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params)] == together
    assert llm.engine.spec_stats().num_verified > 0
    finish_clean(llm)
    finish_clean(again)


def test_n_branches_and_logprobs_turn_speculation_off_per_request(tiny_llama):
    loaded, _ = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 2, seed=4)
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, speculative=spec_for("ngram", 3))
    plain = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64)
    for params in [
        SamplingParams(max_tokens=8, temperature=0.0, n=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
    ]:
        got = llm.generate(prompts, params)
        want = plain.generate(prompts, params)
        for a, b in zip(got, want, strict=True):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.engine.spec_stats().num_verified == 0
    finish_clean(llm)
    finish_clean(plain)


def test_triton_backend_verifies_through_the_paged_prefill_kernel(tiny_llama):
    loaded, reference = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 2, seed=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm, tokens = run(
        loaded,
        prompts,
        params,
        block_size=8,
        num_kv_blocks=32,
        attention_backend="triton",
        speculative=spec_for("ngram", 3),
    )
    assert_same_as_reference(tokens, prompts, reference, max_tokens=8)
    assert llm.engine.spec_stats().num_verified > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "speculative.method must be one of"),
        ({"method": "ngram", "num_tokens": 0}, r"speculative.num_tokens must be in \[1, 16\]"),
        ({"method": "draft"}, "speculative.draft_model is required"),
        ({"method": "ngram", "draft_model": "x"}, "draft_model is only for method 'draft'"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min and ngram_max"),
        ({"method": "ngram", "k": 3}, r"speculative has unknown keys \['k'\]"),
        ("ngram", "speculative must be a mapping"),
    ],
)
def test_bad_speculative_config_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.of(value)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, qwen2_dir):
    loaded, _ = tiny_llama
    with pytest.raises(ValueError, match="vocabulary of 128 tokens; the target's has"):
        LLM(loaded_model=loaded, speculative={"method": "draft", "draft_model": qwen2_dir})
