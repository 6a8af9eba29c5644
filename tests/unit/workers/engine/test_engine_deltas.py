"""The engine reports deltas: each step only what is new per branch (tokens, final text), the
end of a branch once (finish, usage, metrics), and `LLM.generate` adds them up unchanged."""

from __future__ import annotations

from support.engine import Stepper, finish_clean

from pagedserve import LLM, SamplingParams

# Far longer than any hold-back: a delta that repeated earlier output would show.
LONG = SamplingParams(max_tokens=300, temperature=1.0, seed=11, n=2, ignore_eos=True)
# The detokenizer holds at most ~17 byte tokens back (a run of invalid UTF-8), so one delta's
# text is bounded by that, whatever the output's length.
MAX_DELTA_CHARS = 32


def make_llm(tiny_llama) -> LLM:
    loaded, _ = tiny_llama
    return LLM(loaded_model=loaded, block_size=8, num_kv_blocks=128, attention_backend="torch")


def test_each_step_reports_only_its_own_tokens_and_text(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = list(range(40, 60))
    llm.engine.add_request("r", prompt, LONG)
    stepper = Stepper(llm.engine)
    steps, prompts_seen = 0, set()
    while llm.engine.has_unfinished_requests():
        (delta,) = stepper.step()
        steps += 1
        prompts_seen.add(id(delta.prompt_token_ids))  # shared, never copied per step
        for completion in delta.completions:
            assert len(completion.token_ids) <= 1  # one decode step: one token per branch
            assert len(completion.text) <= MAX_DELTA_CHARS
    assert steps >= LONG.max_tokens and len(prompts_seen) == 1
    (expected,) = llm.generate([prompt], LONG)
    assert stepper.outputs["r"].outputs == expected.outputs  # tokens, text, finish: the same
    assert [len(o.token_ids) for o in expected.outputs] == [300, 300]
    assert expected.outputs[0].token_ids != expected.outputs[1].token_ids
    finish_clean(llm)


def test_a_branch_ends_once_with_its_usage_and_metrics(tiny_llama):
    llm = make_llm(tiny_llama)
    params = SamplingParams(max_tokens=6, temperature=0.0, n=3, ignore_eos=True)
    llm.engine.add_request("r", list(range(30)), params)
    ends, middles = [], []
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            for completion in delta.completions:
                (ends if completion.finished else middles).append(completion)
    assert sorted(c.index for c in ends) == [0, 1, 2]
    assert all(c.usage is None and c.metrics is None for c in middles)
    assert {(c.usage.prompt_tokens, c.usage.completion_tokens) for c in ends} == {(30, 6)}
    assert all(c.finish_reason == "length" and c.metrics.ttft > 0 for c in ends)
    assert llm.engine.abort("r") is None  # gone once finished: no second end
    finish_clean(llm)


def test_abort_reports_only_branches_that_had_not_ended(tiny_llama):
    llm = make_llm(tiny_llama)
    llm.engine.add_request("r", list(range(20)), SamplingParams(max_tokens=50, ignore_eos=True))
    stepper = Stepper(llm.engine)
    stepper.step()
    stepper.step()
    aborted = llm.engine.abort("r")
    (end,) = aborted.completions
    assert end.token_ids == [] and end.finish_reason == "abort"
    assert end.usage.completion_tokens == 2
    stepper.add([aborted])
    assert len(stepper.outputs["r"].outputs[0].token_ids) == 2
    finish_clean(llm)
