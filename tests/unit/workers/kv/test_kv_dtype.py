"""`kv_cache_dtype`: an 8-bit pool holds 2x the positions of a 16-bit one (4x float32) in the
same budget, runs requests on every CPU backend, and every path moves its 8-bit blocks (swap,
P/D hand-off, prefix transfer, move, disk-tier files), fp8 and int8 alike; blocks of another KV
dtype (another 8-bit one included) are refused and recomputed, never converted."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.kv_quant import quantise_rows
from pagedserve.workers.config_flags import add_config_flags
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.engine.sizing import kv_layout
from pagedserve.workers.kv.block_hash import hash_full_blocks
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.kv.tier_file import (
    CorruptBlockFile,
    encode_block,
    read_block,
    read_header,
)
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stats import PoolCheck
from pagedserve.workers.protocol.stream import RequestMoved
from pagedserve.workers.worker.core import WorkerCore

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BASE = {"block_size": 8, "attention_backend": "torch"}
POOL_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
KV8 = ["fp8", "int8"]


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(loaded_model=tiny_llama[0], kv_cache_dtype="fp4")
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig)
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_the_same_budget_holds_2x_the_blocks_of_bf16_and_4x_float32():
    shape = {"block_size": 16, "num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    budget = 64 * 1024 * 1024
    counts = {
        dtype: KVCache.num_blocks_for_budget(budget, dtype=dtype, **shape)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, *POOL_DTYPES.values())
    }
    fp8 = counts[torch.float8_e4m3fn]
    assert fp8 == counts[torch.float8_e5m2] == counts[torch.int8]
    assert fp8 == 2 * counts[torch.bfloat16] == 2 * counts[torch.float16]
    assert fp8 == 4 * counts[torch.float32]
    assert fp8 == budget // (16 * 30 * 3 * 64 * 2)  # B x M_KV with 1 byte per value


@pytest.mark.parametrize("kv_dtype", KV8)
def test_an_8_bit_engine_sizes_its_pool_by_the_codes_and_counts_scales_apart(tiny_llama, kv_dtype):
    loaded, _ = tiny_llama
    budget = 4 * 1024 * 1024
    full = Engine(EngineConfig(kv_cache_bytes=budget, **BASE), loaded=loaded)
    kv8 = Engine(
        EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=kv_dtype, **BASE), loaded=loaded
    )
    assert loaded.dtype == torch.float32
    assert kv8.kv_cache.num_blocks == 4 * full.kv_cache.num_blocks
    cache = kv8.kv_cache
    assert cache.dtype == POOL_DTYPES[kv_dtype]
    assert cache.key_caches[0].shape[-1] == loaded.head_dim + 4
    assert cache.bytes_per_block * cache.num_blocks <= budget
    rows = 2 * loaded.num_layers * 8 * loaded.num_kv_heads
    assert cache.scale_bytes_per_block == 4 * rows
    assert cache.device_bytes == cache.num_blocks * (cache.bytes_per_block + 4 * rows)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2", "int8"])
def test_an_8_bit_engine_runs_requests_and_writes_8_bit_blocks(tiny_llama, backend, kv_dtype):
    from pagedserve.kernels import cpu_paged_available

    if backend == "cpu" and not cpu_paged_available():
        pytest.skip("the C++ CPU kernel does not build here")
    loaded, _ = tiny_llama
    llm = LLM(
        loaded_model=loaded, num_kv_blocks=64, kv_cache_dtype=kv_dtype,
        **{**BASE, "attention_backend": backend},
    )  # fmt: skip
    prompts = [list(range(3, 40)), list(range(100, 109)), list(range(3, 30))]
    outputs = llm.generate(prompts, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outputs)
    pool = llm.engine.kv_cache.key_caches[0]
    assert pool.dtype == POOL_DTYPES[kv_dtype]
    assert bool(pool.view(torch.uint8).any())
    finish_clean(llm)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_swap_preemption_moves_the_8_bit_blocks_back_unchanged(tiny_llama, kv_dtype):
    loaded, _ = tiny_llama
    prompts = [list(range(i * 11, i * 11 + 20)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(loaded_model=loaded, num_kv_blocks=64, kv_cache_dtype=kv_dtype, **BASE)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    finish_clean(roomy)
    small = LLM(
        loaded_model=loaded, num_kv_blocks=12, kv_cache_dtype=kv_dtype, preemption_mode="swap",
        watermark=0.0, **BASE,
    )  # fmt: skip
    cache, swapped = small.engine.kv_cache, []
    swap_out = cache.swap_out
    cache.swap_out = lambda pairs: (swapped.extend(pairs), swap_out(pairs))
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert swapped and cache._swap.dtype == POOL_DTYPES[kv_dtype]
    assert got == expected
    finish_clean(small)


def _engine(loaded, role, kv_dtype="fp8", **config):
    config = EngineConfig(num_kv_blocks=64, kv_cache_dtype=kv_dtype, **{**BASE, **config})
    return Engine(config, loaded=loaded, role=role)


def _prefill(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    handoffs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            handoffs.update(delta.handoffs)
    return handoffs[0]


def _decode(engine, handoff):
    engine.adopt(handoff)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for completion in delta.completions:
                tokens.extend(completion.token_ids)
    return tokens


@pytest.mark.parametrize("kv_dtype", KV8)
def test_a_pd_handoff_between_8_bit_engines_imports_the_8_bit_blocks(tiny_llama, kv_dtype):
    loaded, _ = tiny_llama
    prompt = list(range(40, 60))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = LLM(loaded_model=loaded, num_kv_blocks=64, kv_cache_dtype=kv_dtype, **BASE)
    expected = alone.generate([prompt], params)[0].outputs[0].token_ids
    finish_clean(alone)
    prefiller = _engine(loaded, WorkerRole.PREFILL, kv_dtype)
    handoff = _prefill(prefiller, "r", prompt, params)
    assert handoff.packed_kv.dtype == POOL_DTYPES[kv_dtype]
    assert handoff.packed_kv.shape[-1] == loaded.head_dim + 4  # codes and scale, as stored
    decoder = _engine(loaded, WorkerRole.DECODE, kv_dtype)
    tokens = _decode(decoder, handoff)
    assert decoder.num_adopted_with_kv == 1 and decoder.num_adopted_recomputed == 0
    assert expected[:1] + tokens == expected
    for engine in (prefiller, decoder):
        assert not engine.has_unfinished_requests()
        assert_no_leaks(engine.kv)


# (the sender's KV dtype, the receiver's, the receiver's pool dtype as an import names it)
MIXED = [("fp8", "auto", "float32"), ("int8", "fp8", "float8_e4m3fn"), ("fp8", "int8", "int8")]


@pytest.mark.parametrize(("sender", "receiver", "pool"), MIXED)
def test_a_handoff_to_an_engine_of_another_kv_dtype_recomputes(tiny_llama, sender, receiver, pool):
    loaded, _ = tiny_llama
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefiller = _engine(loaded, WorkerRole.PREFILL, sender)
    handoff = _prefill(prefiller, "r", list(range(40, 60)), params)
    decoder = _engine(loaded, WorkerRole.DECODE, kv_dtype=receiver)
    tokens = _decode(decoder, handoff)
    assert decoder.num_adopted_with_kv == 0 and decoder.num_adopted_recomputed == 1
    assert len(tokens) == 7
    with pytest.raises(ValueError, match=f"kv_cache_dtype {pool}"):
        decoder.kv_cache.import_blocks(handoff.packed_kv[:, :, :1], [0])
    for engine in (prefiller, decoder):
        assert_no_leaks(engine.kv)


def _core(loaded, worker_id, kv_dtype="fp8", **config):
    llm = LLM(loaded_model=loaded, num_kv_blocks=64, kv_cache_dtype=kv_dtype, **{**BASE, **config})
    return llm, WorkerCore(llm.engine, worker_id, None)


async def _collect(core, request_id, prompt):
    return [t async for d in core.generate(request_id, prompt, GREEDY) for t in d.token_ids]


@pytest.mark.parametrize(("kv_dtype", "other"), [("fp8", "auto"), ("int8", "fp8")])
def test_a_prefix_pull_between_8_bit_workers_imports_8_bit_blocks_and_others_refuse(
    tiny_llama, kv_dtype, other
):
    loaded, _ = tiny_llama
    llm_a, core_a = _core(loaded, "a", kv_dtype)
    llm_b, core_b = _core(loaded, "b", kv_dtype)
    llm_c, core_c = _core(loaded, "c", kv_dtype=other)
    prompt = list(range(50, 90))
    hashes = hash_full_blocks(prompt, 8, (loaded.name,))

    async def main():
        reference = await _collect(core_a, "r", prompt)
        keys, packed = await core_a.export_prefix(hashes)
        assert packed.dtype == POOL_DTYPES[kv_dtype] and len(keys) == 5
        assert await core_b.import_prefix(keys, packed) == 5
        assert await core_c.import_prefix(keys, packed) == 0  # another KV dtype: refused
        pulled = await _collect(core_b, "p", prompt)
        recomputed = await _collect(core_c, "c", prompt)
        for core in (core_a, core_b, core_c):
            await core.close()
        return reference, pulled, recomputed

    reference, pulled, recomputed = asyncio.run(main())
    assert pulled == reference and len(recomputed) == 10
    for llm in (llm_a, llm_b, llm_c):
        finish_clean(llm)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_a_move_between_8_bit_workers_carries_the_8_bit_blocks(tiny_llama, kv_dtype):
    loaded, _ = tiny_llama
    small = EngineConfig(
        num_kv_blocks=14, kv_cache_dtype=kv_dtype, preemption_mode="move", watermark=0.0,
        enable_prefix_caching=False, **BASE,
    )  # fmt: skip
    roomy = EngineConfig(num_kv_blocks=64, kv_cache_dtype=kv_dtype, **BASE)
    core_a = WorkerCore(Engine(small, loaded=loaded), "a")
    core_b = WorkerCore(Engine(roomy, loaded=loaded), "b")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(i * 7, i * 7 + 20)) for i in range(4)]

    async def follow(request_id, prompt):
        tokens, handoffs = [], []
        stream = core_a.generate(request_id, prompt, params)
        while True:
            async for delta in stream:
                if isinstance(delta, RequestMoved):
                    handoffs.append(delta.handoff)
                    stream = core_b.adopt(delta.handoff)
                    break
                tokens.extend(delta.token_ids)
            else:
                return tokens, handoffs

    async def main():
        results = await asyncio.gather(*(follow(f"r{i}", p) for i, p in enumerate(prompts)))
        await core_a.close()
        await core_b.close()
        return results, await core_a.check_pool(), await core_b.check_pool()

    results, check_a, check_b = asyncio.run(main())
    handoffs = [h for _, hs in results for h in hs]
    assert handoffs and all(h.packed_kv.dtype == POOL_DTYPES[kv_dtype] for h in handoffs)
    assert core_b.engine.num_adopted_with_kv == len(handoffs)
    assert all(len(tokens) == 24 for tokens, _ in results)
    assert check_a == check_b == PoolCheck(ok=True, idle=True)


@pytest.mark.parametrize("kv_dtype", KV8)
def test_disk_tier_files_hold_the_8_bit_rows_and_refuse_another_kv_dtype(
    tiny_llama, tmp_path, kv_dtype
):
    loaded, _ = tiny_llama
    config = EngineConfig(kv_cache_dtype=kv_dtype, **BASE)
    layout = kv_layout(config, loaded)
    pool_dtype = POOL_DTYPES[kv_dtype]
    assert layout.dtype == str(pool_dtype)[6:] and layout.head_dim == loaded.head_dim + 4
    engine = Engine(EngineConfig(num_kv_blocks=8, kv_cache_dtype=kv_dtype, **BASE), loaded=loaded)
    key = BlockKey(None, tuple(range(8)), ())
    kv = torch.randn(loaded.num_layers, 2, 8, loaded.num_kv_heads, loaded.head_dim)
    block = quantise_rows(kv, pool_dtype)
    digest = hash_full_blocks(list(range(8)), 8, ())[0]
    path = tmp_path / (digest.hex() + ".kvb")
    path.write_bytes(encode_block(digest, key, block, layout))
    header = read_header(path, layout)
    back = read_block(path, header, layout)
    assert torch.equal(back.view(torch.uint8), block.view(torch.uint8))
    engine.kv_cache.import_blocks(back.unsqueeze(2), [3])
    assert torch.equal(
        engine.kv_cache.export_blocks([3])[:, :, 0].view(torch.uint8), block.view(torch.uint8)
    )
    other = "int8" if kv_dtype == "fp8" else "fp8"
    for config in (EngineConfig(**BASE), EngineConfig(kv_cache_dtype=other, **BASE)):
        with pytest.raises(CorruptBlockFile, match="layout"):
            read_header(path, kv_layout(config, loaded))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_rollback_on_an_fp8_pool_keeps_the_output(tiny_llama, method):
    from support.spec import repetitive_prompts

    loaded, _ = tiny_llama
    prompts = repetitive_prompts(loaded.vocab_size, 4, seed=3)
    spec = {"method": method, "num_tokens": 3}
    if method == "draft":
        spec["draft_model"] = "tiny-llama"
    runs = []
    for speculative in (None, spec):
        llm = LLM(
            loaded_model=loaded, model="tiny-llama", num_kv_blocks=64, kv_cache_dtype="fp8",
            speculative=speculative, **BASE,
        )  # fmt: skip
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        finish_clean(llm)
    assert runs[1] == runs[0]


@pytest.mark.parametrize(("tier", "kv_dtype"), [("host", "fp8"), ("disk", "fp8"), ("disk", "int8")])
def test_an_evicted_8_bit_prefix_comes_back_from_a_tier_not_prefilled(
    tiny_llama, tier, kv_dtype, tmp_path
):
    loaded, _ = tiny_llama
    prompt_a = [(7 * i + 3) % 200 + 1 for i in range(36)]  # 4 full blocks of 8
    prompt_b = [(11 * i + 5) % 200 + 1 for i in range(60)]  # fills the pool: evicts A
    small = {"num_kv_blocks": 8, "watermark": 0.0, "kv_cache_dtype": kv_dtype, **BASE}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(llm, prompt):
        counters = llm.engine.scheduler.counters
        before = counters.prefill_tokens
        (output,) = llm.generate([prompt], params)
        return output.outputs[0].token_ids, counters.prefill_tokens - before

    plain = LLM(loaded_model=loaded, **small)
    expected = run(plain, prompt_a)[0]
    finish_clean(plain)
    block_bytes = plain.engine.kv_cache.packed_bytes_per_block
    tiers = {"kv_host_tier_bytes": 16 * block_bytes}
    if tier == "disk":
        tiers = {"kv_host_tier_bytes": block_bytes, "kv_disk_tier_dir": str(tmp_path)}
        tiers["kv_disk_tier_bytes"] = 64 * block_bytes
    llm = LLM(loaded_model=loaded, **small, **tiers)
    assert run(llm, prompt_a) == (expected, 36)
    run(llm, prompt_b)
    assert run(llm, prompt_a) == (expected, 36 - 32)  # 4 blocks loaded back, 8-bit
    assert llm.engine.tier_stats().of(tier).hit_blocks >= (4 if tier == "host" else 3)
    finish_clean(llm)
    llm.engine.close()


def test_the_preflight_budget_check_counts_8_bit_blocks():
    from pagedserve.workers.engine.checks import EngineConfigError, ModelShape, check_kv_budget

    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", context=512)
    fp8_block = 16 * 2 * 2 * 2 * 64  # B x M_KV at 1 byte
    for kv_dtype in KV8:
        check_kv_budget(EngineConfig(kv_cache_bytes=fp8_block, kv_cache_dtype=kv_dtype), shape)
    with pytest.raises(EngineConfigError, match="holds no KV block") as error:
        check_kv_budget(EngineConfig(kv_cache_bytes=fp8_block), shape)
    assert error.value.field == "kv_cache_bytes"


@pytest.mark.parametrize("kv_dtype", KV8)
def test_a_head_dim_8_bit_rows_cannot_hold_is_refused_naming_kv_cache_dtype(kv_dtype):
    from types import SimpleNamespace

    from pagedserve.workers.engine.checks import EngineConfigError
    from pagedserve.workers.engine.sizing import kv_pool_dtype

    odd = SimpleNamespace(name="odd-model", head_dim=30, dtype=torch.float32, device=None)
    assert kv_pool_dtype(EngineConfig(), odd) == torch.float32
    with pytest.raises(EngineConfigError, match="head_dim divisible by 4") as error:
        kv_pool_dtype(EngineConfig(kv_cache_dtype=kv_dtype), odd)
    assert error.value.field == "kv_cache_dtype"


def test_fp8_on_a_gpu_without_fp8_conversions_is_refused_for_triton(monkeypatch):
    from types import SimpleNamespace

    from pagedserve.workers.engine.checks import EngineConfigError
    from pagedserve.workers.engine.sizing import kv_pool_dtype

    gpu = SimpleNamespace(name="m", head_dim=64, dtype=torch.float16, device=torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(EngineConfigError, match="compute capability 8.9") as error:
        kv_pool_dtype(EngineConfig(kv_cache_dtype="fp8", device="cuda"), gpu)
    assert error.value.field == "kv_cache_dtype"
    torch_backend = EngineConfig(kv_cache_dtype="fp8", device="cuda", attention_backend="torch")
    assert kv_pool_dtype(torch_backend, gpu) == torch.float8_e4m3fn
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert kv_pool_dtype(EngineConfig(kv_cache_dtype="fp8_e5m2", device="cuda"), gpu) == (
        torch.float8_e5m2
    )


def test_int8_needs_no_fp8_conversions_so_an_older_gpu_runs_it_with_triton(monkeypatch):
    from types import SimpleNamespace

    from pagedserve.workers.engine.sizing import kv_pool_dtype

    gpu = SimpleNamespace(name="m", head_dim=64, dtype=torch.float16, device=torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert kv_pool_dtype(EngineConfig(kv_cache_dtype="int8", device="cuda"), gpu) == torch.int8
