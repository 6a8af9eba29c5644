"""The tenant through a real engine (tiny-llama): `add_request(tenant=...)` orders the engine's
queue fairly, service is charged to whoever sent it, and a request handed to a peer (moved or
replayed) keeps its tenant there."""

from __future__ import annotations

import time

import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.handoff import HandoffReason, RequestHandoff
from pagedserve.workers.transfer.handoff import pack_handoff

PROMPT = list(range(1, 13))


def prompt(i: int) -> list[int]:
    """A prompt of its own (no prefix hit: every request computes all 12 positions)."""
    return [20 * i + k for k in range(1, 13)]


PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def make_llm(tiny_llama, fair: bool = True) -> LLM:
    loaded, _ = tiny_llama
    return LLM(
        loaded_model=loaded,
        block_size=4,
        num_kv_blocks=64,
        attention_backend="torch",
        max_num_seqs=1,
        fair_share={"enabled": fair},
    )


def first_token_order(llm: LLM) -> list[str]:
    """Step to the end; the request ids in the order their first token came out."""
    order: list[str] = []
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            if delta.request_id not in order and any(c.token_ids for c in delta.completions):
                order.append(delta.request_id)
    return order


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fcfs"])
def test_the_engine_alternates_tenants_when_fair(tiny_llama, fair):
    llm = make_llm(tiny_llama, fair)
    for i in range(4):
        llm.engine.add_request(f"a{i}", prompt(i), PARAMS, tenant="a")
    for i in range(2):
        llm.engine.add_request(f"b{i}", prompt(4 + i), PARAMS, tenant="b")
    order = first_token_order(llm)
    if fair:
        assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
    else:
        assert order == ["a0", "a1", "a2", "a3", "b0", "b1"]
    service = llm.engine.scheduler.tenants.tenants
    # Each request: 12 prompt positions and 2 output positions (its last token is sampled
    # from position 13 and never computed itself).
    assert (service["a"].prompt_tokens, service["a"].output_tokens) == (4 * 12, 4 * 2)
    assert (service["b"].prompt_tokens, service["b"].output_tokens) == (2 * 12, 2 * 2)
    finish_clean(llm)


def test_a_handed_off_request_keeps_its_tenant(tiny_llama):
    source, target = make_llm(tiny_llama), make_llm(tiny_llama)
    source.engine.add_request("r", PROMPT, PARAMS, tenant="t")
    source.engine.step()  # its prompt computed, one token out
    group = source.engine._groups["r"]
    branch = group.branches[0]
    assert branch.tenant == "t"
    handoff = pack_handoff(group, branch, None, 4, HandoffReason.PREEMPTED, time.monotonic())
    assert handoff.tenant == "t"
    source.engine.abort("r")
    target.engine.adopt(handoff)
    adopted = target.engine.scheduler.waiting[0]
    assert adopted.tenant == "t"
    first_token_order(target)
    assert target.engine.scheduler.tenants.tenants["t"].prompt_tokens == 12
    replay = RequestHandoff.replay(
        "q",
        PROMPT,
        [],
        0,
        PARAMS,
        priority=0,
        tenant="u",
        cache_extra_keys=handoff.cache_extra_keys,
        block_size=4,
        deadline_remaining_s=None,
    )
    target.engine.adopt(replay)
    assert target.engine.scheduler.waiting[0].tenant == "u"
    first_token_order(target)
    finish_clean(source)
    finish_clean(target)
