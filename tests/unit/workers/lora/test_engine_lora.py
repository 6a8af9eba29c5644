"""LoRA through a real engine (tiny-llama): each adapter's greedy output equals HF + PEFT's
merged model, alone and in one batch with adapters of other ranks and the base; the base's
output in that batch equals its output alone; KV computed under one adapter is no hit for
another; a handed-off request keeps its adapter."""

from __future__ import annotations

import time

import pytest
from support.engine import Stepper, finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.errors import UnknownLora
from pagedserve.workers.protocol.handoff import HandoffReason
from pagedserve.workers.transfer.handoff import pack_handoff

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + 7 * i + k for k in range(11 + i)] for i in range(4)]


def make_llm(tiny_llama, adapters, **config) -> LLM:
    loaded, _ = tiny_llama
    modules = [f"{a.name}={a.path}" for a in adapters.values()]
    config = {"block_size": 4, "num_kv_blocks": 96, "attention_backend": "torch"} | config
    return LLM(loaded_model=loaded, lora_modules=modules, **config)


def run(llm: LLM, requests: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    for request_id, prompt, lora in requests:
        llm.engine.add_request(request_id, prompt, PARAMS, lora=lora)
    outputs = Stepper(llm.engine).run_to_end()
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


def test_a_mixed_batch_of_ranks_and_the_base_equals_merged_peft(tiny_llama, adapters):
    """Three adapters of ranks 4, 8 and 2 (attention only, MLP only, all seven) and the base,
    two prompts each, all in one step: each equals its merged model, the base equals HF."""
    _, base_reference = tiny_llama
    llm = make_llm(tiny_llama, adapters)
    names = [*adapters, None]
    requests = [
        (f"{name}-{j}", PROMPTS[(i + j) % len(PROMPTS)], name)
        for i, name in enumerate(names)
        for j in range(2)
    ]
    got = run(llm, requests)
    for request_id, prompt, name in requests:
        reference = base_reference if name is None else adapters[name].reference
        expected = reference.greedy(prompt, PARAMS.max_tokens)
        assert got[request_id] == expected, request_id
    base = base_reference.greedy(PROMPTS[0], PARAMS.max_tokens)
    for adapter in adapters.values():  # each changes the output (else this proves nothing)
        assert adapter.reference.greedy(PROMPTS[0], PARAMS.max_tokens) != base
    assert llm.engine.loras.num_slot_loads == 3
    finish_clean(llm)


def test_the_base_alone_equals_the_base_beside_adapters(tiny_llama, adapters):
    llm = make_llm(tiny_llama, adapters)
    alone = run(llm, [("base", PROMPTS[0], None)])
    mixed = run(
        llm, [("base2", PROMPTS[0], None), ("a", PROMPTS[0], "attn4"), ("m", PROMPTS[1], "mlp8")]
    )
    assert mixed["base2"] == alone["base"]
    assert mixed["a"] != alone["base"]
    finish_clean(llm)


def test_more_adapters_than_slots_wait_for_one(tiny_llama, adapters):
    """max_loras=1: three adapters run one at a time (never two in a step), outputs exact."""
    llm = make_llm(tiny_llama, adapters, max_loras=1)
    seen: list[set[str]] = []
    original = llm.engine._lora_batch

    def spy(scheduled):
        seen.append({r.lora_key for r in scheduled if r.lora_key})
        return original(scheduled)

    llm.engine._lora_batch = spy
    requests = [(name, PROMPTS[0], name) for name in adapters] + [("b", PROMPTS[1], None)]
    got = run(llm, requests)
    assert max(len(keys) for keys in seen) == 1
    for name, adapter in adapters.items():
        assert got[name] == adapter.reference.greedy(PROMPTS[0], PARAMS.max_tokens)
    finish_clean(llm)


def test_kv_cached_under_one_adapter_is_no_hit_for_another(tiny_llama, adapters):
    """A 12-token prompt (3 blocks of 4) cached under attn4: attn4 again hits 8 tokens (its
    last block is recomputed for the logits), mlp8 and the base hit none; then mlp8 again
    hits its own 8."""
    llm = make_llm(tiny_llama, adapters)
    prompt = PROMPTS[1]  # 12 tokens
    cached = {}
    for request_id, lora in [
        ("a1", "attn4"),
        ("a2", "attn4"),
        ("m1", "mlp8"),
        ("b1", None),
        ("m2", "mlp8"),
    ]:
        llm.engine.add_request(request_id, prompt, ONE_TOKEN, lora=lora)
        outputs = Stepper(llm.engine).run_to_end()
        cached[request_id] = outputs[request_id].num_cached_tokens
    assert cached == {"a1": 0, "a2": 8, "m1": 0, "b1": 0, "m2": 8}
    finish_clean(llm)


def test_a_handed_off_request_keeps_its_adapter_and_output(tiny_llama, adapters):
    source, target = make_llm(tiny_llama, adapters), make_llm(tiny_llama, adapters)
    expected = adapters["mlp8"].reference.greedy(PROMPTS[2], PARAMS.max_tokens)
    source.engine.add_request("r", PROMPTS[2], PARAMS, lora="mlp8")
    first = Stepper(source.engine)
    first.step()  # prompt computed, one token out
    group = source.engine._groups["r"]
    handoff = pack_handoff(
        group, group.branches[0], None, 4, HandoffReason.PREEMPTED, time.monotonic()
    )
    source.engine.abort("r")
    target.engine.adopt(handoff)
    assert target.engine.scheduler.waiting[0].lora_key == source.engine.loras.key_of("mlp8")
    outputs = Stepper(target.engine).run_to_end()
    assert (
        group.branches[0].all_token_ids[len(PROMPTS[2]) :][:1] + outputs["r"].outputs[0].token_ids
        == expected
    )
    finish_clean(target)
    finish_clean(source)


def test_unknown_adapters_are_refused_by_name(tiny_llama, adapters):
    llm = make_llm(tiny_llama, adapters)
    with pytest.raises(UnknownLora, match="'nope'"):
        llm.engine.add_request("x", PROMPTS[0], PARAMS, lora="nope")
    finish_clean(llm)


def test_unload_lets_running_requests_finish_and_refuses_new_ones(tiny_llama, adapters):
    llm = make_llm(tiny_llama, adapters)
    llm.engine.add_request("r", PROMPTS[0], PARAMS, lora="attn4")
    stepper = Stepper(llm.engine)
    stepper.step()
    llm.engine.unload_lora("attn4")
    with pytest.raises(UnknownLora, match="'attn4'"):
        llm.engine.add_request("late", PROMPTS[0], PARAMS, lora="attn4")
    outputs = stepper.run_to_end()
    expected = adapters["attn4"].reference.greedy(PROMPTS[0], PARAMS.max_tokens)
    assert outputs["r"].outputs[0].token_ids == expected
    assert not llm.engine.loras.has_unloaded  # its weights dropped once it finished
    assert "attn4" not in llm.engine.lora_adapters()
    llm.engine.load_lora("attn4", adapters["attn4"].path)  # and it can come back
    finish_clean(llm)


def test_the_offline_api_takes_an_adapter_per_prompt(tiny_llama, adapters):
    llm = make_llm(tiny_llama, adapters)
    outputs = llm.generate([PROMPTS[0]] * 3, PARAMS, lora=["mlp8", None, "nope"])
    assert outputs[0].outputs[0].token_ids == adapters["mlp8"].reference.greedy(
        PROMPTS[0], PARAMS.max_tokens
    )
    assert outputs[1].outputs[0].token_ids == tiny_llama[1].greedy(PROMPTS[0], PARAMS.max_tokens)
    assert "'nope' is not loaded" in outputs[2].error
    finish_clean(llm)
