"""Coalesced deltas (`DeltaBuffer.get_coalesced`, what `WorkerCore` streams read): a run of
one branch's waiting deltas comes out as one message that loses or repeats nothing, so a
stream whose reader lags sends fewer messages than the engine took steps."""

from __future__ import annotations

import asyncio

from support.engine import finish_clean
from support.wait import until

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMoved,
    StreamDelta,
    TokenLogprob,
    Usage,
)
from pagedserve.workers.worker.core import WorkerCore
from pagedserve.workers.worker.stream import RUN_AHEAD_MESSAGES, DeltaBuffer, merge_deltas

DEADLINE_S = 60.0


def delta(tokens, text, index=0, **extra) -> StreamDelta:
    return StreamDelta("r", index, list(tokens), text, worker_id="w0", **extra)


def test_merging_keeps_order_and_takes_the_end_of_the_later():
    lp = [TokenLogprob(1, -0.5, 1), TokenLogprob(2, -0.1, 1)]
    first = delta([1], "a", logprobs=lp[:1], prompt_logprobs=[None])
    usage = Usage(3, 2, 0)
    then = delta([2], "b", logprobs=lp[1:], finish_reason=FinishReason.LENGTH, usage=usage)
    merged = merge_deltas(first, then)
    assert merged.token_ids == [1, 2] and merged.text == "ab"
    assert merged.logprobs == lp and merged.prompt_logprobs == [None]
    assert merged.finish_reason == "length" and merged.usage == usage
    assert first.token_ids == [1]  # the inputs are left as they were
    plain = merge_deltas(delta([1], "a"), delta([], ""))
    assert plain.logprobs is None and plain.token_ids == [1] and plain.finish_reason is None


def test_the_buffer_hands_out_one_message_per_run_of_one_branch():
    async def main():
        buffer = DeltaBuffer(64)  # merges up to 8 deltas a message
        for i in range(3):
            buffer.put(delta([i], str(i)))
        buffer.put(delta([10], "x", index=1))  # another branch ends the run
        buffer.put(delta([3], "3"))
        buffer.put(delta([4], "4", finish_reason=FinishReason.LENGTH))
        buffer.put(delta([5], "5"))  # after a finished delta: a message of its own
        moved = RequestMoved("r", 0, "w1", None)
        buffer.put(moved)
        buffer.put(None)
        return [await buffer.get_coalesced() for _ in range(6)], len(buffer)

    got, left = asyncio.run(main())
    assert [(m.index, m.token_ids, m.text) for m in got[:4]] == [
        (0, [0, 1, 2], "012"),
        (1, [10], "x"),
        (0, [3, 4], "34"),
        (0, [5], "5"),
    ]
    assert got[2].finish_reason == "length"
    assert isinstance(got[4], RequestMoved) and got[5] is None and left == 0


def test_a_message_merges_at_most_max_merged_deltas():
    """An unread stream must still fill its buffer and pause: each message in flight carries
    at most `capacity // RUN_AHEAD_MESSAGES` deltas, not the whole buffer."""

    async def main():
        buffer = DeltaBuffer(16)
        for i in range(5):
            buffer.put(delta([i], str(i)))
        return [(await buffer.get_coalesced()).token_ids for _ in range(3)]

    assert DeltaBuffer(16).max_merged == 16 // RUN_AHEAD_MESSAGES == 2
    assert asyncio.run(main()) == [[0, 1], [2, 3], [4]]


def test_a_lagging_reader_gets_the_steps_it_missed_in_one_message(tiny_llama):
    """The reader takes the first delta, then reads nothing until the engine has finished
    the request (12 steps): what waited comes out merged, the same tokens as the
    request run offline, and the stream sent 3 messages for 12 steps (at most `max_merged`, 8,
    steps a message)."""
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    core = WorkerCore(llm.engine, "w0", None)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 30))

    async def main():
        stream = core.generate("r", prompt, params)
        messages = [await anext(stream)]
        # Every step's delta is in the buffer (the engine finishing is not enough: its last
        # delta reaches the buffer after the step thread returns).
        await until(lambda: core.buffered_deltas("r") == 11, "the 11 other deltas to wait")
        messages += [m async for m in stream]
        await core.close()
        return messages

    messages = asyncio.run(main())
    (expected,) = llm.generate([prompt], params)
    assert [len(m.token_ids) for m in messages] == [1, 8, 3]  # 8: the buffer's max_merged
    assert [t for m in messages for t in m.token_ids] == expected.outputs[0].token_ids
    assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == 12
    finish_clean(llm)
