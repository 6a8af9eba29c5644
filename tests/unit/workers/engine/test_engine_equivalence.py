"""Greedy outputs equal HF's own model with its own cache, under every paging feature."""

import random

import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# The CPU backends the HF-equivalence tests run under: the reference and the C++ kernel.
CPU_BACKENDS = pytest.mark.parametrize("backend", ["torch", "cpu"])


def make_prompts(vocab: int, count: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)
    ]


def assert_matches_reference(outputs, prompts, reference, max_tokens=16):
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.error is None
        assert output.outputs[0].token_ids == reference.greedy(prompt, max_tokens), prompt


@CPU_BACKENDS
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "qwen2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_matches_hf(request, model_fixture, block_size, chunked, backend):
    loaded, reference = request.getfixturevalue(model_fixture)
    prompts = make_prompts(loaded.vocab_size, 6, seed=block_size)
    llm = LLM(
        loaded_model=loaded,
        block_size=block_size,
        num_kv_blocks=64,
        attention_backend=backend,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=24 if chunked else loaded.max_model_len,
    )
    assert_matches_reference(llm.generate(prompts, GREEDY), prompts, reference)
    finish_clean(llm)


@CPU_BACKENDS
def test_shared_prefixes_hit_the_cache_and_match(tiny_llama, backend):
    loaded, reference = tiny_llama
    prompts = make_prompts(loaded.vocab_size, 18, seed=3, shared_prefix=48)
    llm = LLM(loaded_model=loaded, block_size=16, num_kv_blocks=256, attention_backend=backend)
    first = llm.generate(prompts[:1], GREEDY)
    outputs = first + llm.generate(prompts[1:], GREEDY)
    assert_matches_reference(outputs, prompts, reference)
    assert all(o.num_cached_tokens >= 48 for o in outputs[1:])
    assert llm.stats().prefix_hits_tokens >= 17 * 48
    finish_clean(llm)


@CPU_BACKENDS
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_outputs(tiny_llama, mode, backend):
    loaded, reference = tiny_llama
    prompts = make_prompts(loaded.vocab_size, 8, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(
        loaded_model=loaded,
        block_size=8,
        num_kv_blocks=20,
        attention_backend=backend,
        preemption_mode=mode,
        num_swap_blocks=64,
        enable_prefix_caching=False,
        watermark=0.0,
    )
    outputs = llm.generate(prompts, params)
    assert_matches_reference(outputs, prompts, reference, max_tokens=24)
    preemptions = sum(o.metrics.num_preemptions for o in outputs)
    counters = llm.engine.scheduler.counters
    assert preemptions > 0 and preemptions == counters.swapped_out + counters.recomputed
    if mode == "swap":  # 64 swap slots hold every victim: a recompute would be a silent fallback
        assert counters.recomputed == 0 and counters.swapped_in == counters.swapped_out
    else:
        assert counters.swapped_out == counters.swapped_in == 0
    finish_clean(llm)


def test_a_swap_in_lands_in_a_step_that_schedules_nothing(tiny_llama):
    """Regression: the only other request finishes, the victim is swapped back in, and that
    step schedules nothing; its swap-in copies used to be skipped with the forward, so the
    next step read blocks that were never filled."""
    loaded, reference = tiny_llama
    prompts = [
        list(b"Log-probabilities score every token of a text, prompt included."),
        list(b"Another prompt that competes for the same small pool of blocks."),
    ]
    llm = LLM(
        loaded_model=loaded,
        block_size=8,
        num_kv_blocks=20,
        attention_backend="torch",
        max_num_batched_tokens=16,
        preemption_mode="swap",
        watermark=0.0,
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert [o.metrics.num_preemptions for o in outputs] == [0, 1]
    assert_matches_reference(outputs, prompts, reference, max_tokens=40)
    finish_clean(llm)


def test_n_branches_greedy_all_equal_single(tiny_llama):
    loaded, reference = tiny_llama
    prompt = make_prompts(loaded.vocab_size, 1, seed=5)[0]
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    (output,) = llm.generate(
        [prompt], SamplingParams(n=4, max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    expected = reference.greedy(prompt, 16)
    assert [o.token_ids for o in output.outputs] == [expected] * 4
    assert llm.stats().prefix_queries_tokens == len(prompt)  # one prefill, not four
    finish_clean(llm)


def test_n_branches_sampled_equal_each_seed_alone(tiny_llama):
    loaded, _ = tiny_llama
    prompt = make_prompts(loaded.vocab_size, 1, seed=6)[0]
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    sampled = SamplingParams(
        n=4, max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True
    )
    (together,) = llm.generate([prompt], sampled)
    for j in range(4):
        (alone,) = llm.generate([prompt], sampled.for_branch(j))
        assert together.outputs[j].token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in together.outputs}) > 1
    finish_clean(llm)


def test_request_is_isolated_among_32_concurrent(tiny_llama):
    loaded, _ = tiny_llama
    prompts = make_prompts(loaded.vocab_size, 32, seed=9, shared_prefix=20)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=160, attention_backend="torch")
    crowd = llm.generate(prompts, params)
    alone = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=160, attention_backend="torch")
    for index in (0, 13, 31):
        (single,) = alone.generate([prompts[index]], params)
        assert single.outputs[0].token_ids == crowd[index].outputs[0].token_ids
    finish_clean(llm)
    finish_clean(alone)


def test_cache_salts_never_share_a_block(tiny_llama):
    loaded, _ = tiny_llama
    prompt = make_prompts(loaded.vocab_size, 1, seed=12, shared_prefix=40)[0]
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    engine = llm.engine
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    engine.step()
    blocks_a = set(engine.kv.get_block_ids("a#0"))
    blocks_b = set(engine.kv.get_block_ids("b#0"))
    assert blocks_a and blocks_a.isdisjoint(blocks_b)
    while engine.has_unfinished_requests():
        engine.step()
    (same_salt,) = llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    (other_salt,) = llm.generate([prompt], GREEDY, cache_salt="tenant-c")
    assert same_salt.num_cached_tokens > 0 and other_salt.num_cached_tokens == 0
    finish_clean(llm)


def test_local_checkpoint_directory_with_text_prompts(tmp_path):
    from pagedserve.workers.model.tiny_llama import save_tiny_llama

    save_tiny_llama(str(tmp_path / "tiny"), seed=0)
    from_dir = LLM(str(tmp_path / "tiny"), num_kv_blocks=64, attention_backend="torch")
    builtin = LLM("tiny-llama", num_kv_blocks=64, attention_backend="torch")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = from_dir.generate(["Paged attention"], params)[0].outputs[0]
    b = builtin.generate(["Paged attention"], params)[0].outputs[0]
    assert a.token_ids == b.token_ids and isinstance(a.text, str)
    finish_clean(from_dir)
    finish_clean(builtin)


def test_triton_backend_under_interpreter(tiny_llama):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 is not set (the test command sets it)")
    loaded, reference = tiny_llama
    prompts = make_prompts(loaded.vocab_size, 2, seed=21)
    llm = LLM(loaded_model=loaded, block_size=16, num_kv_blocks=16, attention_backend="triton")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert_matches_reference(llm.generate(prompts, params), prompts, reference, max_tokens=4)
    finish_clean(llm)


@pytest.fixture(scope="module")
def tiny_llama_bf16():
    from pagedserve.workers.model.loader import load_model

    return load_model("tiny-llama", dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_alone_or_batched(request, tiny_llama, dtype):
    """On the CPU's serving path (the C++ attention op, oneDNN-packed projections), a request's
    greedy tokens do not depend on what shares its steps: alone, or batched with 7 others of
    other lengths, with prefills and decodes mixed, the same tokens, in float32 and bfloat16."""
    from pagedserve.workers.model.cpu_linear import onednn_supported

    loaded = tiny_llama[0] if dtype == "float32" else request.getfixturevalue("tiny_llama_bf16")
    if not onednn_supported(loaded.device, loaded.dtype):
        pytest.skip(f"this torch's oneDNN does not pack {dtype}")
    prompts = make_prompts(loaded.vocab_size, 8, seed=21)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # No prefix caching: each run alone computes its own KV rather than the batch's.
    config = dict(block_size=8, num_kv_blocks=256, enable_prefix_caching=False)
    llm = LLM(
        loaded_model=loaded, dtype=dtype, attention_backend="cpu", linear_backend="onednn", **config
    )
    batched = llm.generate(prompts, params)
    for index, prompt in enumerate(prompts):
        (alone,) = llm.generate([prompt], params)
        assert alone.outputs[0].token_ids == batched[index].outputs[0].token_ids, index
    finish_clean(llm)
