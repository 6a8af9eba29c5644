"""An adapter's KV across engines: a P/D hand-off keeps the adapter and the output, and a
prefix pulled from a peer (export, import) is a hit for its adapter only, never the base's."""

from __future__ import annotations

from support.engine import Stepper, finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.kv.block_hash import cache_key, hash_full_blocks
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.transfer.prefix_transfer import PrefixTransfer

BLOCK = 4
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(60, 73))  # 13 tokens: 3 full blocks


def engine(tiny_llama, adapters, role: WorkerRole = WorkerRole.MIXED) -> Engine:
    loaded, _ = tiny_llama
    modules = tuple(f"{a.name}={a.path}" for a in adapters.values())
    config = EngineConfig(
        block_size=BLOCK, num_kv_blocks=64, attention_backend="torch", lora_modules=modules
    )
    return Engine(config, loaded=loaded, role=role)


def test_a_pd_hand_off_keeps_the_adapter_and_its_output(tiny_llama, adapters):
    prefiller = engine(tiny_llama, adapters, WorkerRole.PREFILL)
    decoder = engine(tiny_llama, adapters, WorkerRole.DECODE)
    prefiller.add_request("r", PROMPT, PARAMS, lora="all2")
    streamed, handoffs = [], {}
    while prefiller.has_unfinished_requests():
        for delta in prefiller.step():
            handoffs.update(delta.handoffs)
            streamed += [t for c in delta.completions for t in c.token_ids]
    decoder.adopt(handoffs[0])
    assert decoder._groups["r"].branches[0].lora_key == prefiller.loras.key_of("all2")
    rest = Stepper(decoder).run_to_end()["r"].outputs[0].token_ids
    assert streamed + rest == adapters["all2"].reference.greedy(PROMPT, PARAMS.max_tokens)
    assert (decoder.num_adopted_with_kv, decoder.scheduler.counters.prefill_tokens) == (1, 0)
    assert_no_leaks(prefiller.kv)
    assert_no_leaks(decoder.kv)


def test_a_pulled_prefix_is_a_hit_for_its_adapter_only(tiny_llama, adapters):
    source = engine(tiny_llama, adapters)
    source.add_request("s", PROMPT, PARAMS, lora="mlp8")
    Stepper(source).run_to_end()
    keys = cache_key(tiny_llama[0].name, None, source.loras.key_of("mlp8"))
    hashes = hash_full_blocks(PROMPT, BLOCK, keys)
    blocks = PrefixTransfer(source.kv).cached_prefix(hashes)
    assert len(blocks) == 3
    assert all(block.key.extra_keys[2].startswith("lora:mlp8@") for block in blocks)
    packed = source.kv_cache.export_blocks([b.block_id for b in blocks])
    loaded, _ = tiny_llama
    target = LLM(
        loaded_model=loaded,
        block_size=BLOCK,
        num_kv_blocks=64,
        attention_backend="torch",
        lora_modules=[f"{a.name}={a.path}" for a in adapters.values()],
    )
    transfer = PrefixTransfer(target.engine.kv)
    indices, reserved = transfer.reserve_for_import([b.key for b in blocks])
    target.engine.kv_cache.import_blocks(packed[:, :, indices], [b.block_id for b in reserved])
    transfer.commit_import(reserved, [blocks[i].key for i in indices])
    cached = {}
    for request_id, lora in [("base", None), ("attn", "attn4"), ("mlp", "mlp8")]:
        target.engine.add_request(request_id, PROMPT, PARAMS, lora=lora)
        out = Stepper(target.engine).run_to_end()[request_id]
        cached[request_id] = out.num_cached_tokens
        if lora == "mlp8":  # the imported KV gives the adapter's own output
            expected = adapters["mlp8"].reference.greedy(PROMPT, PARAMS.max_tokens)
            assert out.outputs[0].token_ids == expected
    assert cached == {"base": 0, "attn": 0, "mlp": 12}
    finish_clean(target)
    assert_no_leaks(source.kv)
