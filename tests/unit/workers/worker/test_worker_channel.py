"""WorkerCore's channels, without Ray: requests admitted by `submit` stream back through their
owner's `channel`, one `StepBatch` per engine step carrying every request of that owner; a
channel that closes aborts its owner's requests (a newer one of the same owner does not);
a drain's cut-off and a failed step reach the reader as end messages; the router's pauses
apply in the order it sent them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from support.engine import finish_clean
from support.wait import until

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.errors import Draining, HandedOff, RequestRejected
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.stats import DrainResult, PoolCheck
from pagedserve.workers.protocol.stream import RequestFailed, StepBatch, StreamDelta
from pagedserve.workers.worker.core import WorkerCore

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def make_core(tiny_llama) -> tuple[LLM, WorkerCore]:
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    return llm, WorkerCore(llm.engine, "w0", lease_timeout_s=1000.0)


def request(request_id: str, prompt: list[int], params: SamplingParams, owner: str = "router"):
    return WorkerRequest.fresh(request_id, prompt, params, owner_id=owner)


async def read_until_done(
    channel: AsyncIterator[StepBatch], request_ids: set[str], batches: list[StepBatch]
) -> None:
    """Read batches (kept in `batches`) until each of `request_ids` sent its last message,
    in a batch read here or already in `batches` (a reader that lags gets a short answer's
    every message in one batch: its end may be in the first batch a test read)."""
    open_ids = set(request_ids) - _ended(batches)
    while open_ids:
        batch = await anext(channel)
        batches.append(batch)
        open_ids -= _ended([batch])


def _ended(batches: list[StepBatch]) -> set[str]:
    return {
        message.request_id
        for batch in batches
        for message in batch.messages
        if not isinstance(message, StreamDelta) or message.finish_reason is not None
    }


def tokens_of(batches: list[StepBatch], request_id: str) -> list[int]:
    return [
        t
        for b in batches
        for m in b.messages
        if m.request_id == request_id and isinstance(m, StreamDelta)
        for t in m.token_ids
    ]


def test_one_batch_per_step_carries_every_request_of_the_owner(tiny_llama):
    llm, core = make_core(tiny_llama)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": [(5 * i + j) % 200 + 1 for j in range(10 + i)] for i in range(3)}

    async def main():
        channel = core.channel("router")
        for request_id, prompt in prompts.items():  # admitted before the first step runs
            await core.submit(request(request_id, prompt, params))
        batches: list[StepBatch] = []
        await read_until_done(channel, set(prompts), batches)
        steps = llm.engine.stats().num_steps
        await channel.aclose()
        await core.close()
        return batches, steps

    batches, steps = asyncio.run(main())
    assert len(batches) == steps == params.max_tokens  # one message per step, not per request
    for batch in batches:
        assert batch.worker_id == "w0"
        assert sorted(m.request_id for m in batch.messages) == sorted(prompts)
    offline = llm.generate(list(prompts.values()), params)
    for request_id, expected in zip(prompts, offline, strict=True):
        assert tokens_of(batches, request_id) == expected.outputs[0].token_ids
    assert core.stats().num_streams == 0 and core.stats().lease_owners == 0
    finish_clean(llm)


def test_a_closed_channel_aborts_its_owner_s_requests_and_no_other(tiny_llama):
    """The router that owns "a1" and "a2" is gone (Ray closes its channel call); "b1",
    another router's, decodes on to its end."""
    llm, core = make_core(tiny_llama)
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main():
        gone, alive = core.channel("a"), core.channel("b")
        await core.submit(request("a1", list(range(1, 20)), LONG, owner="a"))
        await core.submit(request("a2", list(range(30, 50)), LONG, owner="a"))
        await core.submit(request("b1", list(range(60, 80)), short, owner="b"))
        first = await anext(gone)
        assert {m.request_id for m in first.messages} == {"a1", "a2"}
        await gone.aclose()
        # Unread, "b1" runs to its end too: its whole answer waits as one batch.
        await until(lambda: not llm.engine._groups, "a1, a2 aborted and b1 at its end")
        batches: list[StepBatch] = []
        await read_until_done(alive, {"b1"}, batches)
        await alive.aclose()
        stats = core.stats()
        pool = await core.check_pool()
        await core.close()
        return batches, stats, pool

    batches, stats, pool = asyncio.run(main())
    assert {m.request_id for b in batches for m in b.messages} == {"b1"}
    assert len(tokens_of(batches, "b1")) == short.max_tokens
    assert stats.num_streams == 0 and pool == PoolCheck(ok=True, idle=True)
    finish_clean(llm)


def test_a_newer_channel_of_the_same_owner_takes_over_without_aborting(tiny_llama):
    llm, core = make_core(tiny_llama)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 20))

    async def main():
        old = core.channel("router")
        await core.submit(request("r", prompt, params))
        batches = [await anext(old)]
        new = core.channel("router")  # the router reopened it (another event loop, say)
        await read_until_done(new, {"r"}, batches)
        with pytest.raises(StopAsyncIteration):
            await anext(old)  # superseded: it ends, and aborted nothing
        await new.aclose()
        await core.close()
        return batches

    batches = asyncio.run(main())
    (expected,) = llm.generate([prompt], params)
    assert tokens_of(batches, "r") == expected.outputs[0].token_ids
    finish_clean(llm)


def test_a_drain_cuts_a_channel_request_off_with_an_end_message(tiny_llama):
    """The request is held paused (as its router would, its reader behind): the drain's grace
    runs out and the channel carries `RequestFailed(HandedOff)` for it; a new one is refused."""
    llm, core = make_core(tiny_llama)

    async def main():
        channel = core.channel("router")
        await core.submit(request("held", list(range(5, 25)), LONG))
        batches = [await anext(channel)]
        core.set_paused("held", True, seq=1)
        await until(lambda: llm.engine.stats().num_paused == 1, "the request to pause")
        result = await core.drain(grace_s=0.1)
        with pytest.raises(Draining, match="is draining"):
            await core.submit(request("late", [1, 2, 3], LONG))
        await read_until_done(channel, {"held"}, batches)
        await channel.aclose()
        await core.close()
        return result, batches

    result, batches = asyncio.run(main())
    assert result == DrainResult(finished=0, handed_off=1)
    last = batches[-1].messages[-1]
    assert isinstance(last, RequestFailed) and isinstance(last.error, HandedOff)
    assert "drained before this request ended" in str(last.error)
    finish_clean(llm)


def test_a_failed_step_ends_every_request_in_one_batch(tiny_llama):
    llm, core = make_core(tiny_llama)
    step = llm.engine.step

    def fail_once():
        llm.engine.step = step  # the next steps (none: every request ends) run as usual
        raise RuntimeError("device lost")

    async def main():
        channel = core.channel("router")
        await core.submit(request("x", list(range(1, 15)), LONG))
        await core.submit(request("y", list(range(20, 35)), LONG))
        batches = [await anext(channel)]
        llm.engine.step = fail_once
        await read_until_done(channel, {"x", "y"}, batches)
        await channel.aclose()
        await core.close()
        return batches[-1]

    last = asyncio.run(main())
    assert sorted(m.request_id for m in last.messages) == ["x", "y"]
    for message in last.messages:
        assert message.finish_reason == "error"
        assert "engine step failed: device lost" in message.error
    finish_clean(llm)


def test_pauses_apply_in_the_order_the_router_sent_them(tiny_llama):
    llm, core = make_core(tiny_llama)

    async def main():
        channel = core.channel("router")
        await core.submit(request("r", list(range(1, 15)), LONG))
        await anext(channel)
        paused = lambda: llm.engine.stats().num_paused  # noqa: E731
        core.set_paused("r", True, seq=2)
        await until(lambda: paused() == 1, "the pause")
        core.set_paused("r", False, seq=1)  # sent before the pause, arrived after it
        await asyncio.sleep(0.05)
        late_resume_ignored = paused() == 1
        core.set_paused("r", False, seq=3)
        await until(lambda: paused() == 0, "the resume")
        core.set_paused("unknown", True, seq=1)  # an ended request: nothing happens
        assert await core.abort("r")
        await channel.aclose()
        await core.close()
        return late_resume_ignored

    assert asyncio.run(main())
    finish_clean(llm)


def test_submit_refuses_what_generate_would_refuse_first(tiny_llama):
    llm, core = make_core(tiny_llama)

    async def main():
        with pytest.raises(RequestRejected, match="owner_id"):
            await core.submit(WorkerRequest.fresh("free", [1, 2, 3], LONG))
        await core.submit(request("r", list(range(1, 15)), LONG))
        with pytest.raises(RequestRejected, match="already in flight"):
            await core.submit(request("r", list(range(1, 15)), LONG, owner="another"))
        too_long = SamplingParams(max_tokens=100_000)
        with pytest.raises(RequestRejected, match="context"):
            await core.submit(request("huge", [1, 2, 3], too_long))
        assert await core.abort("r")
        stats = core.stats()
        await core.close()
        return stats

    stats = asyncio.run(main())
    assert stats.num_streams == 0 and stats.lease_owners == 0
    finish_clean(llm)
