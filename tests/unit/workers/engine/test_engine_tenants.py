"""The tenant through a real engine (tiny-llama): `add_request(tenant=...)` orders the engine's
queue fairly, service is charged to whoever sent it, and a request handed to a peer (moved or
replayed) keeps its tenant there."""

from __future__ import annotations

import time

import pytest
from support.engine import Stepper, finish_clean, record_plans

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.engine import Engine, EngineConfig
from pagedserve.workers.kv.checks import assert_no_leaks
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


# ------------------------------------------------------------------- a victim of the same step
SHARED = list(range(1, 25))  # three blocks of 8: "r" computes the last one in the step below


def same_step_hit(tiny_llama, mode: str, policy: str, priorities: dict[str, int]):
    """Tenant a's "r" computes the last block of SHARED in the step that admits a's "x" (a
    prefix hit on all three blocks, the last one written only by that step's forward) and
    then b's "z", which takes one of a's two slots (fair share; newcomer steps off, which
    would give "z" a step of its own). Returns the engine, that step's plan and every
    request's greedy output."""
    loaded, reference = tiny_llama
    config = EngineConfig(
        block_size=8, num_kv_blocks=32, attention_backend="torch", max_num_seqs=2,
        max_num_batched_tokens=16, preemption_mode=mode, scheduling_policy=policy,
        fair_share={"newcomer_steps": False},
    )  # fmt: skip
    engine = Engine(config, loaded=loaded)
    stepper = Stepper(engine)
    prompts = {"r": SHARED, "x": SHARED + [90, 91, 92], "z": list(range(100, 110))}
    engine.add_request("r", prompts["r"], GREEDY, tenant="a", priority=priorities["r"])
    stepper.step()  # the first 16 positions of "r"
    engine.add_request("x", prompts["x"], GREEDY, tenant="a", priority=priorities["x"])
    engine.add_request("z", prompts["z"], GREEDY, tenant="b", priority=priorities["z"])
    plans = record_plans(engine)
    stepper.step()
    outputs = stepper.run_to_end()
    expected = {rid: reference.greedy(p, GREEDY.max_tokens) for rid, p in prompts.items()}
    return engine, plans[0], {rid: o.outputs[0].token_ids for rid, o in outputs.items()}, expected


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_request_admitted_in_the_step_that_takes_its_place_is_recomputed_not_moved(tiny_llama):
    # "z" takes the place of a's latest, "x", in the step that admitted it. Moved, "x" carried
    # its hit's last block away before the forward wrote it, and the peer generated from
    # whatever that block held; it recomputes here instead (it had nothing but the hit).
    engine, step, outputs, expected = same_step_hit(
        tiny_llama, "move", "fcfs", {"r": 0, "x": 0, "z": 0}
    )
    assert [r.request_id for r in step.preempted] == ["x#0"] and step.moved == []
    assert engine.scheduler.counters.moved == 0
    assert outputs == expected
    assert_no_leaks(engine.kv)


@pytest.mark.parametrize("mode", ["recompute", "move", "swap"])
def test_a_request_whose_prefix_hit_loses_its_writer_yields_with_it(tiny_llama, mode):
    # Under `priority`, a's lowest-ranked is "r" itself (priority 1 against x's 0): "z" takes
    # its place after "x" hit the block "r" was to fill in this step. Unscheduled, "r" never
    # writes it, so "x" yields too, and computes its prompt once that is known.
    engine, step, outputs, expected = same_step_hit(
        tiny_llama, mode, "priority", {"r": 1, "x": 0, "z": 2}
    )
    assert {r.request_id for r in step.preempted} == {"r#0", "x#0"}
    assert [r.request_id for r in step.scheduled] == ["z#0"]
    assert {rid: outputs[rid] for rid in ("x", "z")} == {rid: expected[rid] for rid in ("x", "z")}
    if mode != "move":  # moved, "r" left for a peer with the KV of its 16 computed positions
        assert outputs["r"] == expected["r"]
    assert_no_leaks(engine.kv)
