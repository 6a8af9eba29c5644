"""Swap preemption end to end: a swapped-out sequence comes back with exactly its KV, so greedy
outputs equal HF's own, with prefix caching, a swap area too small, and n > 1 branches."""

import pytest
from support.engine import Stepper, finish_clean, record_plans

from pagedserve import LLM, SamplingParams


def make_llm(tiny_llama, **config):
    loaded, _ = tiny_llama
    options = {
        "block_size": 8,
        "attention_backend": "torch",
        "preemption_mode": "swap",
        "watermark": 0.0,
    }
    return LLM(loaded_model=loaded, **{**options, **config})


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def record_victims(engine) -> list[tuple[str, bool, tuple[tuple[int, int], ...], str]]:
    """Each victim: its id, whether it was scheduled earlier in its step, its planned copies,
    and where it went ("swapped", or "waiting": recomputed)."""
    seen = []
    preempt = engine.scheduler._preempt

    def recording(victim, step):
        scheduled, copies = victim in step.scheduled, step.copies.get(victim, ())
        preempt(victim, step)
        seen.append((victim.request_id, scheduled, copies, victim.status.value))

    engine.scheduler._preempt = recording
    return seen


def run_to_end(stepper: Stepper) -> dict[str, list[list[int]]]:
    """Every branch's token ids per request, over the whole run of `stepper`."""
    outputs = stepper.run_to_end()
    return {rid: [c.token_ids for c in output.outputs] for rid, output in outputs.items()}


@pytest.mark.parametrize("caching", [True, False])
def test_a_sequence_swapped_in_when_nothing_else_runs_gets_its_kv_back(tiny_llama, caching):
    # 10 blocks of 8: "q" is swapped out while "p" runs, and swapped back in the step after
    # "p" finishes, a step with no forward. Its swap-in copy was once skipped in such a step.
    _, reference = tiny_llama
    llm = make_llm(tiny_llama, num_kv_blocks=10, enable_prefix_caching=caching)
    engine = llm.engine
    prompts = {"p": list(range(20)), "q": list(range(30, 50))}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(40))
    stepper, swapped_in_alone = Stepper(engine), False
    while engine.has_unfinished_requests():
        swapped = {r.request_id for r in engine.scheduler.swapped}
        stepper.step()
        running = {r.request_id for r in engine.scheduler.running}
        swapped_in_alone |= bool(running) and running <= swapped
    finished = {rid: out.outputs[0].token_ids for rid, out in stepper.outputs.items()}
    # Swapped out and in once, never recomputed (a recompute would give the same tokens).
    assert engine.scheduler.counters.swapped_out == engine.scheduler.counters.swapped_in == 1
    assert engine.scheduler.counters.recomputed == 0 and swapped_in_alone
    assert finished == {rid: reference.greedy(prompt, 40) for rid, prompt in prompts.items()}
    finish_clean(llm)


def test_swap_with_shared_prefixes_and_prefix_caching_matches_hf(tiny_llama):
    # Four prompts share 3 full blocks: swapped-out sequences leave those blocks cached and
    # shared, later ones hit them, swap-ins re-register their own copies.
    _, reference = tiny_llama
    prefix = list(range(100, 124))
    prompts = [prefix + [200 + i, 210 + i, 220 + i] for i in range(4)]
    llm = make_llm(tiny_llama, num_kv_blocks=14)
    outputs = llm.generate(prompts, greedy(32))
    counters = llm.engine.scheduler.counters
    assert counters.swapped_out > 0 and counters.swapped_in == counters.swapped_out
    assert counters.recomputed == 0
    assert sum(o.num_cached_tokens for o in outputs) >= 3 * len(prefix)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference.greedy(prompt, 32)
    finish_clean(llm)


@pytest.mark.parametrize("num_swap_blocks", [0, 2, 5])
def test_a_swap_area_too_small_for_the_victim_falls_back_to_recompute(tiny_llama, num_swap_blocks):
    # Victims hold 3 to 6 blocks. With 0 or 2 swap blocks every swap-out is refused; with 5
    # some fit and some do not. A refused victim is recomputed: no token lost or changed.
    _, reference = tiny_llama
    prompts = [list(range(10 * i, 10 * i + 20)) for i in range(4)]
    llm = make_llm(tiny_llama, num_kv_blocks=16, num_swap_blocks=num_swap_blocks)
    outputs = llm.generate(prompts, greedy(28))
    counters = llm.engine.scheduler.counters
    assert counters.recomputed > 0 and counters.swapped_in == counters.swapped_out
    if num_swap_blocks < 3:
        assert counters.swapped_out == 0
    else:
        assert counters.swapped_out > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference.greedy(prompt, 28)
    assert llm.engine.kv.num_free_swap_blocks == num_swap_blocks
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("caching", [True, False])
def test_a_victim_scheduled_earlier_in_its_step_keeps_its_tokens(tiny_llama, mode, caching):
    # Decodes are scheduled before prefill chunks, so low-priority "b" gets its slot for the
    # step before high-priority "a"'s chunk finds the pool full and preempts it. Its slot
    # (and the block it fills, hashed at allocation) must be given back: once "b" was swapped
    # in again its next allocation overran its tokens.
    _, reference = tiny_llama
    llm = make_llm(
        tiny_llama,
        num_kv_blocks=10,
        preemption_mode=mode,
        enable_prefix_caching=caching,
        scheduling_policy="priority",
        max_num_batched_tokens=16,
    )
    engine = llm.engine
    victims = record_victims(engine)
    stepper = Stepper(engine)
    prompt_b, prompt_a = list(range(20)), list(range(100, 150))
    engine.add_request("b", prompt_b, greedy(40), priority=1)
    for _ in range(10):
        stepper.step()
    engine.add_request("a", prompt_a, greedy(8), priority=0)
    finished = run_to_end(stepper)
    went = "swapped" if mode == "swap" else "waiting"  # swapped: its KV kept, not recomputed
    assert ("b#0", True, (), went) in victims
    counters = engine.scheduler.counters
    if mode == "swap":
        assert counters.swapped_out >= 1 and counters.recomputed == 0
        assert counters.swapped_in == counters.swapped_out
    else:
        assert counters.recomputed >= 1 and counters.swapped_out == 0
    assert finished["b"] == [reference.greedy(prompt_b, 40)]
    assert finished["a"] == [reference.greedy(prompt_a, 8)]
    finish_clean(llm)


def test_n_branches_one_swapped_after_its_copy_on_write(tiny_llama):
    # "l" (n=3) forks after its prompt: all three branches share block 2, half full. In the
    # next step l#0 and l#1 copy it before writing, then high-priority "h"'s chunk preempts
    # l#2 and l#1, both already scheduled. l#1's planned copy never runs, so its swap-out must
    # read the shared source, not its still-empty private block.
    _, reference = tiny_llama
    llm = make_llm(
        tiny_llama,
        num_kv_blocks=7,
        scheduling_policy="priority",
        max_num_batched_tokens=16,
    )
    engine = llm.engine
    victims = record_victims(engine)
    stepper = Stepper(engine)
    prompt_l, prompt_h = list(range(1, 21)), list(range(100, 140))
    engine.add_request("l", prompt_l, greedy(12, n=3), priority=1)
    stepper.step()
    engine.add_request("h", prompt_h, greedy(4), priority=0)
    finished = run_to_end(stepper)
    # Both swapped, neither recomputed: l#1's swap-out is the one that must read the source.
    early = [(rid, bool(cow), went) for rid, scheduled, cow, went in victims if scheduled]
    assert early[:2] == [("l#2", False, "swapped"), ("l#1", True, "swapped")]
    counters = engine.scheduler.counters  # (a later victim may find the swap area full)
    assert counters.swapped_out >= 2 and counters.swapped_in == counters.swapped_out
    assert finished["l"] == [reference.greedy(prompt_l, 12)] * 3
    assert finished["h"] == [reference.greedy(prompt_h, 4)]
    finish_clean(llm)


def test_a_swap_slot_freed_by_a_swap_in_keeps_its_kv_for_it_when_a_swap_out_takes_it(tiny_llama):
    # One step swaps "s" back in (its swap slots free again) and then, admitting "w", swaps
    # out the paused "p" into those same slots. The swap-in must read them first: run the
    # other way round, "s" came back with "p"'s KV and generated from it.
    _, reference = tiny_llama
    llm = make_llm(tiny_llama, num_kv_blocks=12, num_swap_blocks=4, enable_prefix_caching=False)
    engine = llm.engine
    stepper = Stepper(engine)
    plans = record_plans(engine)
    prompts = {"p": list(range(16)), "s": list(range(40, 64)), "w": list(range(80, 130))}
    engine.add_request("p", prompts["p"], greedy(24))
    engine.add_request("s", prompts["s"], greedy(24))
    for _ in range(3):
        stepper.step()
    engine.pause("s")  # the first victim: swapped out (4 blocks, the whole swap area) for "w1"
    engine.add_request("w1", list(range(150, 198)), greedy(1))
    stepper.step()
    assert [r.request_id for r in engine.scheduler.swapped] == ["s#0"]
    engine.resume("s")
    engine.pause("p")  # the victim of the step that swaps "s" back in
    engine.add_request("w", prompts["w"], greedy(4))
    stepper.step()
    (plan,) = plans[-1:]
    reused = {slot for slot, _ in plan.swap_in} & {slot for _, slot in plan.swap_out}
    assert reused, "the scenario needs a swap slot swapped in and out in one step"
    engine.resume("p")
    finished = run_to_end(stepper)
    for request_id, prompt in prompts.items():
        assert finished[request_id] == [reference.greedy(prompt, len(finished[request_id][0]))]
    finish_clean(llm)
