"""SIGTERM drains a worker process, then lets it exit the way Ray's own handler would.

What happens on SIGTERM (Kubernetes removing the pod, `pagedserve drain-node`, `kill PID`):

    SIGTERM ─► main thread: `DrainOnSigterm.handle` ─► (returns at once)
                  └─ the actor's event loop: `drain()` (refuse new with `Draining`, finish what
                     fits in the grace period, hand the rest back for the router to replay)
                        └─ SIGTERM to itself ─► main thread: Ray's handler (the process exits;
                           Ray restarts the actor where it has room, as after any exit)

A second SIGTERM while the drain runs ends the process at once, undrained (as Ray would).

Ray's exit waits for the actor's running calls, and a stream whose reader lags (a router's
channel its router does not read, or a `generate` stream) is held at its `yield` by Ray's
backpressure: the drain cannot end it, so the exit would wait for that reader.
`exit_deadline_s` after handing the signal to Ray the process ends regardless (`os._exit`); the
router then reads what the stream had produced, sees the worker lost, and replays the rest on a
peer, as for any lost worker.

Why a setup hook: Ray runs every method of an async actor, its `__init__` too, on an
event-loop thread, and Python lets only the main thread set a signal handler. Ray's main thread
sets its own SIGTERM handler (exit now) through `ray._private.utils.set_sigterm_handler` just
before it takes tasks, after the process's setup hook ran. So `install`, run as the worker
process's setup hook (`SETUP_HOOK`, set by `start_worker_group`), puts our handler in place and
makes that later call record Ray's handler as our fallback instead of replacing ours.

The handler must not block the main thread: it dispatches the actor's calls, so a blocked one
would stall the router's stats polls and the worker would be dropped as unanswering.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from pagedserve.workers.ray_internals import route_sigterm_handlers

logger = logging.getLogger(__name__)

SETUP_HOOK = "pagedserve.workers.process.drain_signal.install"
# After the drain, how long Ray's own exit may take before the process ends regardless.
EXIT_DEADLINE_S = 5.0
Handler = Callable[[int, Any], Any]


class DrainOnSigterm:
    """Owns what this process does on SIGTERM: the drain to run (armed by the worker once its
    event loop runs) and the handler to end with (Ray's, once `install` ran).

    Args:
        resignal: sends the process the SIGTERM that ends it after the drain (tests inject
            one that records instead).
        hard_exit: ends the process at once (`os._exit(1)`; tests inject a recorder).
        exit_deadline_s: how long after the resignal `hard_exit` runs if the process is
            still there.
    """

    def __init__(
        self,
        resignal: Callable[[], None] | None = None,
        hard_exit: Callable[[], None] | None = None,
        exit_deadline_s: float = EXIT_DEADLINE_S,
    ) -> None:
        self.fallback: Handler | int = signal.SIG_DFL
        self.resignal = resignal or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.hard_exit = hard_exit or (lambda: os._exit(1))
        self.exit_deadline_s = exit_deadline_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: Callable[[], Awaitable[Any]] | None = None
        self._task: asyncio.Task | None = None
        self.draining = False

    def arm(self, loop: asyncio.AbstractEventLoop, drain: Callable[[], Awaitable[Any]]) -> None:
        """Drain with `drain()` on `loop` at the next SIGTERM (before: exit at once)."""
        self._loop, self._drain = loop, drain

    def handle(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler (main thread): start the drain, or end the process now when
        there is nothing armed or a drain already ran or runs."""
        if self._drain is None or self._loop is None or self.draining or self._loop.is_closed():
            self._end(signum, frame)
            return
        self.draining = True
        logger.warning("SIGTERM: draining this worker, then exiting")
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        assert self._drain is not None
        try:
            await self._drain()
        except Exception:  # exit all the same: the router replays what was left
            logger.exception("drain on SIGTERM failed; exiting")
        finally:
            watchdog = threading.Timer(self.exit_deadline_s, self._exit_now)
            watchdog.daemon = True
            watchdog.start()
            self.resignal()

    def _exit_now(self) -> None:
        logger.warning(
            "still running %.0f s after the drain (a stream's reader lags); exiting now",
            self.exit_deadline_s,
        )
        logging.shutdown()
        self.hard_exit()

    def _end(self, signum: int, frame: Any) -> None:
        fallback = self.fallback
        if callable(fallback):
            fallback(signum, frame)
            return
        signal.signal(signum, fallback)  # no Ray handler: the default action, at once
        os.kill(os.getpid(), signum)


# One per process, as the signal disposition is.
HANDLER = DrainOnSigterm()


def install() -> None:
    """Ray worker-process setup hook (main thread, before Ray sets its SIGTERM handler): put
    `HANDLER` in place, and keep any handler set later through Ray's helper as its fallback."""
    HANDLER.fallback = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL
    signal.signal(signal.SIGTERM, HANDLER.handle)

    def keep_ours_first(ray_handler: Handler) -> None:
        HANDLER.fallback = ray_handler
        signal.signal(signal.SIGTERM, HANDLER.handle)

    route_sigterm_handlers(keep_ours_first)
