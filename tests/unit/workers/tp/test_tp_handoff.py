"""A P/D hand-off across group sizes: a k = 2 prefill engine hands a request with its KV (the
full-head layout) to a k = 1 decode engine, which adopts the KV (imports it, prefills nothing);
the output is the request's alone. (k = 1 blocks into a k = 2 pool: test_tp_engine.py.)"""

from __future__ import annotations

from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.protocol.role import WorkerRole

PROMPT = list(range(40, 60))  # 20 tokens: 2 full blocks of 8 and a partial one
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine(loaded, role: WorkerRole, size: int) -> Engine:
    config = EngineConfig(block_size=8, num_kv_blocks=32, tensor_parallel_size=size)
    return Engine(config, loaded=loaded, role=role)


def tokens_of(deltas) -> list[int]:
    return [t for delta in deltas for c in delta.completions for t in c.token_ids]


def test_a_handoff_from_a_group_to_a_single_engine_imports_its_kv(tiny_llama):
    loaded, _ = tiny_llama
    alone = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=32)
    expected = alone.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    finish_clean(alone)
    prefiller = engine(loaded, WorkerRole.PREFILL, 2)
    decoder = engine(loaded, WorkerRole.DECODE, 1)
    try:
        prefiller.add_request("r", PROMPT, PARAMS)
        streamed, handoffs = [], {}
        while prefiller.has_unfinished_requests():
            deltas = prefiller.step()
            streamed += tokens_of(deltas)
            for delta in deltas:
                handoffs.update(delta.handoffs)
        (handoff,) = handoffs.values()
        assert handoff.packed_kv is not None and handoff.packed_kv.shape[4] == 2  # all heads
        decoder.adopt(handoff)
        while decoder.has_unfinished_requests():
            streamed += tokens_of(decoder.step())
        assert streamed == expected
        assert (decoder.num_adopted_with_kv, decoder.num_adopted_recomputed) == (1, 0)
        assert_no_leaks(prefiller.kv)
        assert_no_leaks(decoder.kv)
    finally:
        prefiller.close()
        decoder.close()
