"""Engine request lifecycle: abort, timeouts, refusals and stats; nothing leaks."""

import time

import pytest
from support.engine import Stepper, finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.errors import Overloaded, RequestRejected
from pagedserve.workers.scheduler.scheduler import SchedulerConfig

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(tiny_llama):
    loaded, _ = tiny_llama
    return LLM(
        loaded_model=loaded,
        block_size=8,
        num_kv_blocks=32,
        attention_backend="torch",
        watermark=0.0,
    )


def test_abort_frees_blocks_at_once_and_others_continue(llm):
    engine = llm.engine
    engine.add_request("a", list(range(20)), LONG)
    engine.add_request("b", list(range(30, 50)), LONG)
    stepper = Stepper(engine)
    stepper.step()
    used_before = engine.usage().used_blocks
    aborted = engine.abort("a")
    stepper.add([aborted])
    assert aborted.finished and aborted.completions[0].finish_reason == "abort"
    assert engine.usage().used_blocks < used_before
    assert not engine.kv.has_request("a#0")
    assert engine.abort("a") is None
    outputs = stepper.run_to_end()
    assert len(outputs["a"].outputs[0].token_ids) == 1  # what it made before the abort
    assert len(outputs["b"].outputs[0].token_ids) == 40
    finish_clean(llm)


def test_timeout_frees_blocks_in_the_next_step(llm):
    engine = llm.engine
    engine.add_request("slow", list(range(20)), LONG, timeout_s=0.05)
    engine.step()
    assert engine.kv.has_request("slow#0")
    time.sleep(0.06)
    (output,) = [o for o in engine.step() if o.request_id == "slow"]
    assert output.finished and output.completions[0].finish_reason == "timeout"
    finish_clean(llm)


def test_request_that_can_never_fit_is_refused_others_run(llm):
    too_big = SamplingParams(max_tokens=300, temperature=0.0)  # 32 blocks * 8 = 256 positions
    small = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out_big, out_small = llm.generate([list(range(10)), list(range(10))], [too_big, small])
    assert out_big.error and "can never fit in the KV pool" in out_big.error
    assert out_small.error is None and len(out_small.outputs[0].token_ids) == 4
    finish_clean(llm)


def test_context_limit_and_bad_prompts_are_named(llm):
    engine = llm.engine
    over = SamplingParams(max_tokens=engine.max_model_len)
    with pytest.raises(RequestRejected, match="exceeds the model's context"):
        engine.add_request("x", [1, 2, 3], over)
    with pytest.raises(RequestRejected, match="prompt_token_ids is empty"):
        engine.add_request("x", [], None)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("x", [1, 10**6], None)
    with pytest.raises(RequestRejected, match="prompt is empty"):
        engine.add_request("x", "", None)
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="already in flight"):
        engine.add_request("dup", [1, 2], None)
    engine.abort("dup")
    finish_clean(llm)


def test_stop_strings_and_eos_end_generation(llm):
    tokenizer = llm.get_tokenizer()
    (free_run,) = llm.generate(
        ["Paging"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    text = free_run.outputs[0].text
    assert len(text) >= 3
    stop = text[1:3]
    (stopped,) = llm.generate(
        ["Paging"], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True)
    )
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].text == text[:1]
    eos_first = SamplingParams(
        max_tokens=5, temperature=0.0, stop_token_ids=[free_run.outputs[0].token_ids[0]]
    )
    (early,) = llm.generate(["Paging"], eos_first)
    assert early.outputs[0].finish_reason == "stop" and len(early.outputs[0].token_ids) == 1
    assert tokenizer.decode(free_run.outputs[0].token_ids).startswith(text[:1])
    finish_clean(llm)


def test_reserve_max_allocation_and_usage(tiny_llama):
    loaded, _ = tiny_llama
    llm = LLM(
        loaded_model=loaded,
        block_size=8,
        num_kv_blocks=64,
        attention_backend="torch",
        kv_allocation="reserve-max",
        max_model_len=128,
        watermark=0.0,
    )
    engine = llm.engine
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    usage = engine.usage()
    assert usage.used_blocks == 16 and usage.useful_tokens == 10  # the sampled token has no KV yet
    while engine.has_unfinished_requests():
        engine.step()
    finish_clean(llm)


def test_metrics_are_reported(llm):
    (out,) = llm.generate(
        [list(range(12))], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    )
    m = out.metrics
    assert m.queue_time >= 0 and m.ttft > 0 and m.e2e >= m.ttft and m.tpot > 0
    assert len(m.inter_token_latencies) == 4 and m.num_preemptions == 0
    finish_clean(llm)


def test_a_full_waiting_queue_refuses_new_requests_at_once(tiny_llama):
    loaded, _ = tiny_llama
    llm = LLM(
        loaded_model=loaded,
        block_size=8,
        num_kv_blocks=32,
        attention_backend="torch",
        max_num_seqs=1,
        max_waiting=2,
    )
    engine = llm.engine
    engine.add_request("a", list(range(10)), LONG)
    engine.add_request("b", list(range(10, 20)), LONG)
    with pytest.raises(Overloaded, match=r"waiting queue is full \(2\)"):
        engine.add_request("c", list(range(20, 30)), LONG)
    assert not engine.kv.has_request("c#0")
    engine.step()  # "a" runs, "b" waits: room for one more
    engine.add_request("c", list(range(20, 30)), LONG)
    with pytest.raises(Overloaded):
        engine.add_request("d", list(range(30, 40)), LONG)
    while engine.has_unfinished_requests():
        engine.step()
    finish_clean(llm)


def test_max_waiting_must_be_positive():
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        SchedulerConfig(max_waiting=0)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(tiny_llama, timeout_s):
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=16, attention_backend="torch")
    with pytest.raises(RequestRejected, match="timeout_s"):
        llm.engine.add_request("t", [1, 2, 3], SamplingParams(max_tokens=2), timeout_s=timeout_s)
    finish_clean(llm)
