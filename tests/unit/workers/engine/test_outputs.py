"""One delta shape, one accumulator (`workers/engine/outputs.py`): the engine's `StreamDelta`s
go out as they are, and `CompletionCollector` adds them up the same way for the offline `LLM`
and the front ends."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.workers.engine.outputs import (
    CompletionCollector,
    CompletionOutput,
    OutputBuilder,
    RequestDelta,
)
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMetrics,
    StreamDelta,
    TokenLogprob,
    Usage,
)
from pagedserve.workers.worker.stream import stream_deltas


def end(index: int, tokens: list[int], text: str, **extra) -> StreamDelta:
    usage = Usage(4, len(tokens), 2)
    return StreamDelta(
        "r", index, tokens, text, FinishReason.STOP, usage=usage, worker_id="w0", **extra
    )


def test_a_delta_is_frozen_and_its_finish_reason_an_enum():
    delta = end(0, [1], "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        delta.index = 1  # type: ignore[misc]
    assert delta.finished and delta.finish_reason is FinishReason.STOP
    assert str(delta.finish_reason) == "stop"  # what the wire spells


def test_the_worker_sends_the_engine_deltas_themselves():
    running = StreamDelta("r", 0, [1], "a", worker_id="w0")
    last = end(1, [2], "b")
    delta = RequestDelta("r", "p", [9], [running, last], finished=True)
    assert all(a is b for a, b in zip(stream_deltas(delta), [running, last], strict=True))
    failed = stream_deltas(delta, error="boom")
    assert failed[0] is running and failed[1].error == "boom" and last.error is None


def test_the_collector_adds_up_text_tokens_logprobs_and_usage():
    lp = [TokenLogprob(1, -0.5, 1), TokenLogprob(2, -1.5, 2)]
    collector = CompletionCollector()
    collector.add(StreamDelta("r", 0, [1], "a", logprobs=lp[:1], prompt_logprobs=[None]))
    collector.add(StreamDelta("r", 1, [7], "x"))
    collector.add(end(0, [2], "b", logprobs=lp[1:], metrics=RequestMetrics(ttft=0.1)))
    first, second = collector.completions
    assert (first.text, first.token_ids, first.logprobs) == ("ab", [1, 2], lp)
    assert first.finish_reason is FinishReason.STOP and first.prompt_logprobs == [None]
    assert second.finish_reason is None and second.logprobs is None
    assert collector.usage() == Usage(4, 1, 2) and collector.metrics == RequestMetrics(ttft=0.1)
    assert collector.worker_id == "w0" and collector.request_id == "r"


def test_keep_best_ranks_by_the_summed_logprobs_and_renumbers():
    collector = CompletionCollector()
    collector.add(end(0, [1], "a", logprobs=[TokenLogprob(1, -2.0, 2)]))
    collector.add(end(1, [2], "b", logprobs=[TokenLogprob(2, -0.5, 1)]))
    collector.keep_best(1)
    (best,) = collector.completions
    assert (best.index, best.text, best.logprob_sum) == (0, "b", -0.5)
    assert collector.usage().completion_tokens == 2  # every branch was generated


def test_outputs_compare_by_their_answer_not_usage_or_timings():
    one = CompletionOutput(0, "a", [1], FinishReason.STOP, usage=Usage(1, 1, 0))
    other = dataclasses.replace(one, usage=Usage(1, 1, 1), metrics=RequestMetrics(ttft=1.0))
    assert one == other
    assert one != dataclasses.replace(one, text="b")


def test_the_offline_builder_is_the_collector_plus_the_request():
    builder = OutputBuilder("r")
    builder.add(RequestDelta("r", "p", [9], [StreamDelta("r", 0, [1], "a")], finished=False))
    builder.add(RequestDelta("r", "p", [9], [end(0, [2], "b")], finished=True))
    output = builder.build()
    (completion,) = output.outputs
    assert (completion.text, completion.token_ids) == ("ab", [1, 2])
    assert output.finished and output.num_cached_tokens == 2 and output.prompt == "p"
