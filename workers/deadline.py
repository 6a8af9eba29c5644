"""`within`: await something for at most a given time, and stay cancellable while doing so.

Use it instead of `asyncio.wait_for`. On Python 3.11, `wait_for` swallows a cancellation that
arrives in the same loop iteration as its inner awaitable's result: it returns the result,
and the task goes on as if never cancelled (CPython gh-86296, fixed in 3.12 by building
`wait_for` on `asyncio.timeout`). A background loop built on it (a feed long-poll, a stats
poll) can then outlive the cancel meant to stop it: on a loaded machine a test's
`asyncio.run` hung at teardown waiting for its tasks, likely such a loop.
`asyncio.timeout` carries the cancellation through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`await awaitable`, raising `TimeoutError` after `timeout` seconds (None: no limit)."""
    async with asyncio.timeout(timeout):
        return await awaitable
