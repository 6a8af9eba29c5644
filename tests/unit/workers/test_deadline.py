"""`within` keeps a cancellation that lands as its awaitable completes (3.11's `wait_for`
swallows it, so a loop on it outlives the cancel), and times out like `wait_for`."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pagedserve.workers.deadline import within


async def poll_loop(wait, rounds: list[int]) -> str:
    """A background loop like the router's: await something ready next iteration, repeat."""
    loop = asyncio.get_running_loop()
    while True:
        inner = loop.create_future()
        loop.call_soon(lambda f=inner: f.done() or f.set_result(None))
        await wait(inner, 10.0)
        rounds.append(1)
        if len(rounds) >= 5:
            return "outlived the cancel"


async def cancel_as_the_inner_completes(wait) -> str:
    rounds: list[int] = []
    task = asyncio.create_task(poll_loop(wait, rounds))
    await asyncio.sleep(0)  # the loop now awaits; its inner completes in the next iteration
    task.cancel()  # ... the same iteration in which the cancellation reaches the task
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_loop_on_within_is_cancelled_in_the_race():
    assert asyncio.run(cancel_as_the_inner_completes(within)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for keeps the cancel")
def test_the_race_is_real_with_wait_for_on_3_11():
    """The same loop on `asyncio.wait_for` outlives the cancel: the race above is the one
    that hung a test's `asyncio.run` teardown."""
    assert asyncio.run(cancel_as_the_inner_completes(asyncio.wait_for)) == "outlived the cancel"


def test_within_times_out_and_returns_results():
    async def main():
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        assert await within(asyncio.sleep(0, result=8), None) == 8
        with pytest.raises(TimeoutError):
            await within(asyncio.Event().wait(), 0)

    asyncio.run(main())


def test_no_module_awaits_with_wait_for():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    sources = [
        p for d in ("cluster", "workers", "bench", "pagedserve") for p in (repo / d).rglob("*.py")
    ]
    users = [str(p.relative_to(repo)) for p in sources if "asyncio.wait_for(" in p.read_text()]
    assert not users, f"use pagedserve.workers.deadline.within instead of asyncio.wait_for: {users}"
