"""Prefill/decode disaggregation inside the engine: a `prefill` engine hands a fresh request
off once its first token went out (the step after it was sampled, so TTFT never waits for the
transfer), with its KV, keeping the prompt's full blocks cached; a decode engine adopts it and
goes on. The output is the one of the request run alone on one engine."""

from __future__ import annotations

import dataclasses

import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.protocol.handoff import HandoffReason
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stream import FinishReason
from pagedserve.workers.transfer.handoff_ref import without_kv

BLOCK = 8
PROMPT = list(range(40, 60))  # 20 tokens: 2 full blocks and a partial one


def engine(tiny_llama, role: WorkerRole) -> Engine:
    loaded, _ = tiny_llama
    config = EngineConfig(block_size=BLOCK, num_kv_blocks=64, attention_backend="torch")
    return Engine(config, loaded=loaded, role=role)


def run_alone(tiny_llama, prompt, params) -> dict[int, list[int]]:
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=BLOCK, num_kv_blocks=64, attention_backend="torch")
    out = llm.generate([prompt], params)[0]
    finish_clean(llm)
    return {c.index: c.token_ids for c in out.outputs}


def prefill(prefiller: Engine, request_id: str, prompt, params):
    """Step the prefill engine until the request left it: (tokens per branch it streamed,
    the handoffs by branch, the step that carried the first token's delta)."""
    prefiller.add_request(request_id, prompt, params)
    tokens: dict[int, list[int]] = {}
    handoffs = {}
    first_token_step = None
    steps = 0
    while prefiller.has_unfinished_requests():
        steps += 1
        for delta in prefiller.step():
            handoffs.update(delta.handoffs)
            for c in delta.completions:
                if c.finish_reason == FinishReason.MOVED:
                    assert not c.token_ids, "a moved branch's last delta carries no token"
                    assert c.index in delta.handoffs
                    continue
                if c.token_ids and first_token_step is None:
                    first_token_step = steps
                    assert not delta.handoffs, "the first token went out with the handoff"
                tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens, handoffs, first_token_step


def decode(decoder: Engine, handoff, finals: list | None = None) -> list[int]:
    decoder.adopt(handoff)
    tokens: list[int] = []
    while decoder.has_unfinished_requests():
        for delta in decoder.step():
            for c in delta.completions:
                tokens.extend(c.token_ids)
                if c.finished and finals is not None:
                    finals.append(c)
    return tokens


def test_a_prefill_engine_hands_off_after_the_first_token_and_the_decode_side_goes_on(
    tiny_llama,
):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prefiller = engine(tiny_llama, WorkerRole.PREFILL)
    decoder = engine(tiny_llama, WorkerRole.DECODE)
    streamed, handoffs, first_step = prefill(prefiller, "r", PROMPT, params)
    assert first_step == 1 and list(handoffs) == [0]
    handoff = handoffs[0]
    assert handoff.reason is HandoffReason.PREFILLED
    assert handoff.output_token_ids == streamed[0] and len(streamed[0]) == 1
    assert handoff.num_computed_tokens == len(PROMPT)
    assert handoff.packed_kv.shape[2] == 3  # ceil(20 / 8) blocks of KV go with it
    # The prompt's full blocks stay cached on the prefill worker (a prefix hit pays there).
    assert prefiller.kv.usage().used_blocks == 0
    assert prefiller.kv.pool.num_cached_free_blocks == len(PROMPT) // BLOCK
    assert prefiller.scheduler.counters.prefill_handoffs == 1
    finals: list = []
    rest = decode(decoder, handoff, finals)
    assert streamed[0] + rest == run_alone(tiny_llama, PROMPT, params)[0]
    assert decoder.scheduler.counters.prefill_tokens == 0, "the KV was computed again"
    # The decode side's metrics count from the request's arrival at the prefill engine: the
    # TTFT is the one the client saw from there, and every later token has its latency.
    (final,) = finals
    timings = handoff.timings
    assert final.metrics.ttft == pytest.approx(timings.first_token_s, abs=1e-6)
    assert final.metrics.e2e > timings.elapsed_s >= final.metrics.ttft
    assert len(final.metrics.inter_token_latencies) == params.max_tokens - 1
    assert (decoder.num_adopted_with_kv, decoder.num_adopted_recomputed) == (1, 0)
    assert_no_leaks(prefiller.kv)
    assert_no_leaks(decoder.kv)


def test_a_request_that_ends_with_its_first_token_finishes_on_the_prefill_engine(tiny_llama):
    prefiller = engine(tiny_llama, WorkerRole.PREFILL)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    streamed, handoffs, _ = prefill(prefiller, "one", PROMPT, params)
    assert not handoffs and streamed == run_alone(tiny_llama, PROMPT, params)
    assert prefiller.scheduler.counters.prefill_handoffs == 0
    assert_no_leaks(prefiller.kv)


def test_each_branch_of_n_is_handed_off_and_continues_as_run_alone(tiny_llama):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=3, ignore_eos=True)
    prefiller = engine(tiny_llama, WorkerRole.PREFILL)
    decoder = engine(tiny_llama, WorkerRole.DECODE)
    streamed, handoffs, _ = prefill(prefiller, "n3", PROMPT, params)
    assert sorted(handoffs) == [0, 1, 2]
    outputs = {j: streamed[j] + decode(decoder, handoffs[j]) for j in sorted(handoffs)}
    assert outputs == run_alone(tiny_llama, PROMPT, params)
    assert len({tuple(t) for t in outputs.values()}) > 1  # the branches really differ
    assert decoder.num_adopted_with_kv == 3 and decoder.scheduler.counters.prefill_tokens == 0
    assert_no_leaks(prefiller.kv)
    assert_no_leaks(decoder.kv)


def test_a_handoff_whose_kv_was_lost_is_recomputed_with_the_same_output(tiny_llama):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prefiller = engine(tiny_llama, WorkerRole.PREFILL)
    decoder = engine(tiny_llama, WorkerRole.DECODE)
    streamed, handoffs, _ = prefill(prefiller, "lost", PROMPT, params)
    rest = decode(decoder, without_kv(handoffs[0]))
    assert streamed[0] + rest == run_alone(tiny_llama, PROMPT, params)[0]
    assert (decoder.num_adopted_with_kv, decoder.num_adopted_recomputed) == (0, 1)
    assert decoder.scheduler.counters.prefill_tokens > 0
    assert_no_leaks(decoder.kv)


@pytest.mark.parametrize("role", [WorkerRole.MIXED, WorkerRole.DECODE, WorkerRole.PREFILL])
def test_an_adopted_request_is_never_handed_off_again(tiny_llama, role):
    """Only fresh requests leave a prefill engine: one adopted there (no decode worker was
    left) decodes to its end, so a request cannot bounce between workers."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefiller = engine(tiny_llama, WorkerRole.PREFILL)
    _, handoffs, _ = prefill(prefiller, "again", PROMPT, params)
    other = engine(tiny_llama, role)
    decode(other, handoffs[0])
    assert other.scheduler.counters.prefill_handoffs == 0
    assert_no_leaks(other.kv)


def test_the_source_holds_handed_off_kv_until_fetched_or_its_deadline():
    """`HeldKV`: a source keeps each KV object it handed off by ref (Ray alone freed some
    before a late target fetched them) until the target releases it, or `hold_s` passed."""
    import ray

    from pagedserve.workers.protocol.handoff import RequestHandoff
    from pagedserve.workers.transfer.handoff_ref import HeldKV

    now = [0.0]
    held = HeldKV(hold_s=10.0, clock=lambda: now[0])
    refs = [ray.ObjectRef(bytes([i]) * 28) for i in range(3)]
    handoffs = [RequestHandoff.replay(
        f"r{i}", [1, 2], [], 0, SamplingParams(), priority=0, cache_extra_keys=("m",),
        block_size=8, deadline_remaining_s=None,
    ) for i in range(3)]  # fmt: skip
    for handoff, ref in zip(handoffs[:2], refs, strict=False):
        held.hold(dataclasses.replace(handoff, packed_kv=ref))
    held.hold(handoffs[2])  # no KV by ref: nothing to hold
    assert len(held) == 2
    held.release(refs[0].hex())
    assert len(held) == 1
    now[0] = 10.0  # the other one was never fetched: let go at its deadline
    assert len(held) == 0
