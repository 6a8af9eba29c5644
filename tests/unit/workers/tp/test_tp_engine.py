"""A tensor-parallel engine (k = 2 rank processes over gloo) gives k = 1's tokens: greedy equal
to HF's own model under prefix hits, preemption (swap, recompute), n > 1 and ngram speculation;
its KV leaves in the full-head layout a k = 1 pool takes; bad sizes are refused by name."""

import gc
import random
import weakref

import pytest
import torch
from support.engine import finish_clean
from support.real_model import prompt_ids

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine import engine as engine_module
from pagedserve.workers.engine.checks import EngineConfigError
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.protocol.errors import LoraLoadError
from pagedserve.workers.tp.group import TPGroupFailed
from pagedserve.workers.tp.shard_bytes import model_shards, shard_weight_bytes

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, n=2, seed=7, ignore_eos=True)
BEAM = SamplingParams(max_tokens=10, n=3, use_beam_search=True, temperature=0.0, ignore_eos=True)


def prompts_with_shared_prefix(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(24)]
    mixed = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(count)]
    return mixed + [prefix + tail for tail in mixed]


def run_both(loaded, prompts, params, **config):
    """Outputs of k = 1 and k = 2 engines over one config, and the k = 2 LLM (still open)."""
    single = LLM(loaded_model=loaded, **config)
    expected = single.generate(prompts, params)
    finish_clean(single)
    group = LLM(loaded_model=loaded, tensor_parallel_size=2, **config)
    return expected, group.generate(prompts, params), group


def token_ids(outputs):
    return [[branch.token_ids for branch in output.outputs] for output in outputs]


def test_k2_equals_k1_and_hf_with_prefix_hits_swap_n2_and_beams(tiny_llama):
    """Swap preemption here (each rank swaps its own KV heads); recompute in the real-model
    test below."""
    loaded, reference = tiny_llama
    prompts = prompts_with_shared_prefix(loaded.vocab_size, 6, seed=5)
    config = dict(
        block_size=8,
        num_kv_blocks=24,
        preemption_mode="swap",
        num_swap_blocks=64,
        watermark=0.0,
        max_num_batched_tokens=32,
    )
    expected, got, llm = run_both(loaded, prompts, GREEDY, **config)
    try:
        assert token_ids(got) == token_ids(expected)
        # k = 1 equals HF on every prompt (test_engine_equivalence.py); here two suffice.
        for prompt, output in zip(prompts[:2], got[:2], strict=True):
            assert output.outputs[0].token_ids == reference.greedy(prompt, 20)
        assert sum(o.metrics.num_preemptions for o in got) > 0
        cached = [o.num_cached_tokens for o in got]
        assert cached == [o.num_cached_tokens for o in expected] and sum(cached) >= 24
        single = LLM(loaded_model=loaded, **config)
        for params in (SAMPLED, BEAM):  # n = 2 sampled; beams fork by copy-on-write
            assert token_ids(llm.generate(prompts[:3], params)) == token_ids(
                single.generate(prompts[:3], params)
            )
        finish_clean(llm)
    finally:
        llm.engine.close()


def test_k2_loading_its_own_model_keeps_only_its_shard_and_equals_k1_with_ngrams(
    tiny_llama, monkeypatch
):
    """An engine that loads its own model slices the shards on the host, then releases the
    whole model's weights: none of its parameters survives, rank 0's live weights are its
    shard's bytes (no slice is a view of a full tensor), and greedy tokens with ngram
    speculation (no model needed) equal k = 1's."""
    loaded, _ = tiny_llama
    loads = record_loads(monkeypatch)
    config = dict(speculative={"method": "ngram", "num_tokens": 3}, linear_backend="torch")
    group = LLM("tiny-llama", tensor_parallel_size=2, **config)
    try:
        assert_rank_0_holds_only_its_shard(group.engine, loads)
        rng = random.Random(3)
        # Repeating prompts give the ngram proposer drafts to verify.
        prompts = [[rng.randrange(256) for _ in range(6)] * 4 for _ in range(4)]
        single = LLM(loaded_model=loaded, **config)
        expected = single.generate(prompts, GREEDY)
        finish_clean(single)
        assert token_ids(group.generate(prompts, GREEDY)) == token_ids(expected)
        assert group.engine.spec_counters.num_steps > 0
        finish_clean(group)
    finally:
        group.engine.close()


def test_k2_draft_that_is_the_released_target_loads_again_on_rank_0(tiny_llama):
    """The target's weights are released once sharded, so a draft naming the target itself is
    loaded again, whole, on rank 0's device; greedy tokens equal k = 1's (whose draft reuses
    its target)."""
    loaded, _ = tiny_llama
    config = dict(
        model="tiny-llama",
        speculative={"method": "draft", "num_tokens": 3, "draft_model": "tiny-llama"},
        num_kv_blocks=32,
    )
    group = LLM(tensor_parallel_size=2, **config)
    try:
        draft = group.engine.proposer.runner.loaded
        assert group.engine.loaded.device.type == "meta"
        assert draft is not group.engine.loaded and draft.device == group.engine.device
        rng = random.Random(4)
        prompts = [[rng.randrange(256) for _ in range(5)] * 3 for _ in range(3)]
        single = LLM(loaded_model=loaded, **config)
        assert single.engine.proposer.runner.loaded is loaded
        expected = single.generate(prompts, GREEDY)
        finish_clean(single)
        assert token_ids(group.generate(prompts, GREEDY)) == token_ids(expected)
        assert group.engine.spec_counters.num_steps > 0
        finish_clean(group)
    finally:
        group.engine.close()


def record_loads(monkeypatch) -> dict:
    """What the engine's own `load_model` loaded: the device, weak references to the
    parameters, their bytes."""
    seen = {}
    load_model = engine_module.load_model

    def recording_load(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        params = list(loaded.model.parameters())
        seen.update(
            device=loaded.device,
            params=[weakref.ref(p) for p in params],
            bytes=sum(p.numel() * p.element_size() for p in params),
        )
        return loaded

    monkeypatch.setattr(engine_module, "load_model", recording_load)
    return seen


def assert_rank_0_holds_only_its_shard(engine, loads: dict) -> None:
    assert loads["device"].type == "cpu" and engine.device.type == "cpu"
    assert engine.loaded.device.type == "meta"
    assert {p.device.type for p in engine.loaded.model.parameters()} == {"meta"}
    gc.collect()
    assert [ref for ref in loads["params"] if ref() is not None] == []
    rank0 = model_shards(engine.loaded, 2)[0]
    shard = shard_weight_bytes(engine.loaded.model, rank0, engine.loaded.head_dim)
    held = rank_0_weight_bytes(engine.runner.state.decoder)
    assert shard <= held <= shard + (64 << 10)  # + the rotary table
    assert held < 0.6 * loads["bytes"]


def rank_0_weight_bytes(decoder) -> int:
    """Bytes of the storages behind rank 0's weights: a slice that were a view of a full
    tensor would count that tensor's whole storage."""
    tensors = [decoder.embed, decoder.final_norm, *decoder.rotary.buffers()]
    for projection in [decoder.lm_head, *(p for layer in decoder.layers for p in layer)]:
        if isinstance(projection, torch.Tensor):  # a norm's weight
            tensors.append(projection)
        else:
            assert not projection.packed
            tensors += [projection.weight, projection.bias]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t is not None
    }
    return sum(storage.nbytes() for storage in storages.values())


def test_blocks_leave_full_head_and_a_dead_rank_fails_the_group(tiny_llama):
    """Exports join the ranks' KV heads into the k = 1 layout (a k = 1 pool's bytes to float
    rounding), imports split them back exactly; then rank 1 dies: the next call fails the
    group, which stops every rank."""
    loaded, _ = tiny_llama
    prompt = list(range(40, 72))
    group = LLM(loaded_model=loaded, tensor_parallel_size=2, block_size=8, num_kv_blocks=16)
    try:
        group.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        kv = group.engine.kv_cache
        assert kv.heads_per_rank == [1, 1] and kv.local.num_kv_heads == 1
        packed = kv.export_blocks([0, 1, 2])
        assert tuple(packed.shape)[4] == loaded.num_kv_heads
        single = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=16)
        single.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        mine = single.engine.kv_cache.export_blocks([0, 1, 2])
        torch.testing.assert_close(packed, mine, rtol=1e-4, atol=1e-5)
        kv.import_blocks(mine, [5, 6, 7])
        torch.testing.assert_close(kv.export_blocks([5, 6, 7]), mine, rtol=0, atol=0)
        finish_clean(group)
        with pytest.raises(LoraLoadError, match="tensor_parallel_size 1"):  # no adapter hooks
            group.engine.load_lora("a", "/no/such/adapter")
        runner = group.engine.runner
        (proc,) = runner.group._procs
        proc.kill()
        proc.wait()
        with pytest.raises(TPGroupFailed, match="rank 1"):
            runner.execute(*_one_token_batch())
        with pytest.raises(TPGroupFailed):  # failed for good: nothing half-serves
            kv.copy_blocks([(0, 1)])
    finally:
        group.engine.close()
    assert group.engine.runner.rank_pids == ()


def _one_token_batch():
    from pagedserve.workers.model.attention_metadata import AttentionMetadata

    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        block_tables=torch.zeros((1, 1), dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        max_query_len=1,
    )
    return torch.tensor([5]), torch.tensor([0]), metadata, torch.tensor([0])


@pytest.mark.parametrize(("size", "words"), [(3, "more than tiny-llama's 2 KV heads"), (0, ">= 1")])
def test_bad_sizes_are_refused_naming_the_flag(tiny_llama, size, words):
    loaded, _ = tiny_llama
    with pytest.raises(ValueError, match=words) as caught:
        LLM(loaded_model=loaded, tensor_parallel_size=size)
    assert "tensor_parallel_size" in str(caught.value)
    if isinstance(caught.value, EngineConfigError):
        assert caught.value.field == "tensor_parallel_size"


def test_lora_modules_with_a_group_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="lora_modules: LoRA adapters need tensor_parallel_size 1"):
        EngineConfig(model="tiny-llama", tensor_parallel_size=2, lora_modules=("a=/adapter",))


@pytest.mark.slow
def test_real_model_k2_equals_k1(smollm2):
    """SmolLM2-135M (3 KV heads: ranks of 2 and 1) with prefix hits, preemption, n = 2 and
    ngram speculation in one engine."""
    loaded, _ = smollm2
    prompts = prompt_ids(loaded)[:6]
    prompts += [prompts[0] + prompts[1][:12], prompts[0] + prompts[2][:5]]  # prefix hits
    config = dict(
        block_size=16,
        num_kv_blocks=28,
        watermark=0.0,
        max_num_batched_tokens=128,
        speculative={"method": "ngram", "num_tokens": 3},
    )
    expected, got, llm = run_both(loaded, prompts, GREEDY, **config)
    try:
        assert token_ids(got) == token_ids(expected)
        assert sum(o.metrics.num_preemptions for o in got) > 0
        assert sum(o.num_cached_tokens for o in got) > 0
        assert llm.engine.spec_counters.num_steps > 0
        sampled = llm.generate(prompts[:2], SAMPLED)
        assert token_ids(sampled) == token_ids(
            LLM(loaded_model=loaded, **config).generate(prompts[:2], SAMPLED)
        )
        finish_clean(llm)
    finally:
        llm.engine.close()


def test_more_ranks_than_cores_is_refused_naming_the_flag(tiny_llama, monkeypatch):
    loaded, _ = tiny_llama
    monkeypatch.setattr("pagedserve.workers.tp.executor.os.cpu_count", lambda: 1)
    with pytest.raises(EngineConfigError, match="needs a CPU core per rank; 1 here") as caught:
        LLM(loaded_model=loaded, tensor_parallel_size=2)
    assert caught.value.field == "tensor_parallel_size"
