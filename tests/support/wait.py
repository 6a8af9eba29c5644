"""Waiting for something a test can observe, never for a stretch of the clock: poll until it
holds, and fail (never pass) at a deadline that is only a failsafe against a hang."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

DEADLINE_S = 120.0
# For a killed worker's restart: Ray starts a new process, which imports torch and loads its
# model. Seconds on a quiet machine; on a loaded one the leak check after a kill waited out a
# 60 s failsafe while the victim was still "restarting" (an integration run beside a busy loop).
RESTART_DEADLINE_S = 300.0


async def until(
    condition: Callable[[], Any],
    what: str,
    deadline_s: float = DEADLINE_S,
    poll_s: float = 0.02,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `condition()` (awaited when it returns an awaitable) until it is truthy; return
    that value. Fails after `deadline_s` naming `what` was awaited and, with `explain`, what
    it says of the state the wait ended in."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= end:
            detail = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}{detail}")
        await asyncio.sleep(poll_s)
