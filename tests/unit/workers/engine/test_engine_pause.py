"""Pausing a request in the engine: it is not scheduled, keeps its blocks, stays preemptible
(first in line when blocks run short), and once resumed it generates what it would have."""

import pytest
from support.engine import Stepper, finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.request import RequestStatus

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_llm(tiny_llama, **config):
    loaded, _ = tiny_llama
    options = {"block_size": 8, "num_kv_blocks": 32, "attention_backend": "torch"}
    return LLM(loaded_model=loaded, watermark=0.0, **{**options, **config})


def tokens_of(engine, request_id: str) -> list[int]:
    return list(engine._groups[request_id].branches[0].output_token_ids)


def run_to_end(stepper: Stepper) -> dict[str, list[int]]:
    """Every finished request's tokens, from the first step `stepper` took."""
    return {rid: out.outputs[0].token_ids for rid, out in stepper.run_to_end().items()}


def test_a_paused_request_is_not_scheduled_keeps_its_blocks_and_resumes(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    stepper = Stepper(engine)
    prompts = {"p": list(range(20)), "q": list(range(30, 50))}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, LONG)
    stepper.step()
    stepper.step()
    assert engine.pause("p") and not engine.pause("nobody")
    blocks = engine.kv.get_block_ids("p#0")
    frozen = tokens_of(engine, "p")
    for _ in range(5):
        touched = {o.request_id for o in stepper.step()}
        assert touched == {"q"}
    assert tokens_of(engine, "p") == frozen and engine.kv.get_block_ids("p#0") == blocks
    assert engine.stats().num_paused == 1 and engine.has_runnable_requests()
    assert engine.resume("p")
    finished = run_to_end(stepper)
    expected = llm.generate(list(prompts.values()), LONG)
    assert finished == {
        "p": expected[0].outputs[0].token_ids,
        "q": expected[1].outputs[0].token_ids,
    }
    assert engine.stats().num_paused == 0
    finish_clean(llm)


def test_with_every_request_paused_the_engine_has_nothing_to_run(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.engine
    stepper = Stepper(engine)
    engine.add_request("p", list(range(20)), LONG)
    stepper.step()
    engine.pause("p")
    assert engine.has_unfinished_requests() and not engine.has_runnable_requests()
    steps = engine.num_steps
    assert stepper.step() == [] and engine.num_steps == steps
    aborted = engine.abort("p")  # a paused request can still be aborted (lease, cancel)
    assert aborted.completions[0].finish_reason == "abort" and engine.stats().num_paused == 0
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_paused_request_is_the_first_victim_and_its_output_is_unchanged(tiny_llama, mode):
    # 10 blocks of 8 tokens: two requests of 20 prompt + 40 output tokens cannot both fit.
    llm = make_llm(tiny_llama, num_kv_blocks=10, preemption_mode=mode)
    engine = llm.engine
    stepper = Stepper(engine)
    # "p" arrived first, so without the pause it would be the last one preempted.
    engine.add_request("p", list(range(20)), LONG)
    engine.add_request("q", list(range(30, 50)), LONG)
    stepper.step()
    engine.pause("p")
    paused = engine._groups["p"].branches[0]
    while paused.timings.num_preemptions == 0 and engine.has_runnable_requests():
        stepper.step()
    assert paused.timings.num_preemptions == 1 and paused.paused
    expected_status = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.WAITING
    assert paused.status is expected_status
    counters = engine.scheduler.counters
    if mode == "swap":  # swapped, not silently recomputed
        assert (counters.swapped_out, counters.recomputed) == (1, 0)
    else:
        assert (counters.swapped_out, counters.recomputed) == (0, 1)
    assert engine._groups["q"].branches[0].timings.num_preemptions == 0
    engine.resume("p")
    finished = run_to_end(stepper)
    assert len(finished["p"]) == len(finished["q"]) == 40
    expected = make_llm(tiny_llama, num_kv_blocks=64).generate(
        [list(range(20)), list(range(30, 50))], LONG
    )
    assert finished["p"] == expected[0].outputs[0].token_ids
    assert finished["q"] == expected[1].outputs[0].token_ids
    finish_clean(llm)


def test_a_waiting_request_takes_the_blocks_of_a_paused_one(tiny_llama):
    llm = make_llm(tiny_llama, num_kv_blocks=12)
    engine = llm.engine
    stepper = Stepper(engine)
    engine.add_request("p", list(range(40)), LONG)
    for _ in range(3):
        stepper.step()
    engine.pause("p")  # holds 6 of the 12 blocks; "w" needs 8
    engine.add_request("w", list(range(100, 160)), SamplingParams(max_tokens=4, temperature=0.0))
    finished = {}
    while "w" not in finished:
        finished.update({o.request_id: o for o in stepper.step() if o.finished})
    assert engine._groups["p"].branches[0].timings.num_preemptions == 1
    assert not engine.kv.has_request("p#0")
    engine.resume("p")
    finished = run_to_end(stepper)
    (expected,) = llm.generate([list(range(40))], LONG)
    assert finished["p"] == expected.outputs[0].token_ids
    finish_clean(llm)


def test_paused_requests_do_not_count_against_max_num_seqs(tiny_llama):
    llm = make_llm(tiny_llama, max_num_seqs=1)
    engine = llm.engine
    stepper = Stepper(engine)
    engine.add_request("p", list(range(10)), LONG)
    stepper.step()
    engine.pause("p")
    engine.add_request("n", list(range(40, 50)), SamplingParams(max_tokens=3, temperature=0.0))
    outputs = stepper.step()
    assert [o.request_id for o in outputs] == ["n"]
    engine.resume("p")
    run_to_end(stepper)
    finish_clean(llm)
