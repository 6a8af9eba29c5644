"""Fault injection for soaks and failure tests, kept out of the production worker.

A production `Worker` has no fault methods, and its `WorkerCore` holds `faults = None`: each
hook point costs one `is None` test. A cluster configured with `fault_injection: true`
(`ClusterConfig`; the soak harness, `tests/support/soak/`, and the test clusters set it) creates
`FaultInjectingWorker` actors instead: the same worker, with a `StepFaults` installed on its
core and the `chaos_*` methods a soak or a test calls through the actor handle:

- `chaos_stall(stalled, after_steps)`: hang every engine step until released; a worker alive
  and answering whose requests make no progress (stall detection, drains, held streams);
- `chaos_refuse_next(count)`: refuse the next streams with `Overloaded`, as a full queue would;
- `chaos_fail_next_kv_fetch(count)`: handoffs arrive without their KV, as when the source's
  object is lost (the adoption recomputes);
- `chaos_drop_next_event_batch()`: lose a KV event batch (the index must notice and resync).
"""

from __future__ import annotations

import threading

from pagedserve.workers.worker.actor import Worker


class StepFaults:
    """The faults a `WorkerCore` consults at its hook points (installed by the subclass)."""

    def __init__(self) -> None:
        self._unstalled = threading.Event()  # cleared by `stall`: the step thread blocks
        self._unstalled.set()
        self._stall_after_steps: int | None = None  # `stall(True, n)`: steps left before it
        self.refuse_next = 0  # new streams refused as Overloaded
        self.drop_next_batch = False
        self.fail_kv_fetches = 0

    # ------------------------------------------------------------ the core's hook points
    def before_step(self) -> None:
        """In the step thread, before each engine step: block while stalled."""
        self._unstalled.wait()

    def after_step(self) -> None:
        """In the step thread, after each engine step: count down a delayed stall."""
        if self._stall_after_steps is None:
            return
        self._stall_after_steps -= 1
        if self._stall_after_steps <= 0:
            self._stall_after_steps = None
            self._unstalled.clear()

    @property
    def stalled(self) -> bool:
        """Whether the next step will hold until `stall(False)`."""
        return not self._unstalled.is_set()

    def release(self) -> None:
        """The core is closing: a stalled step must not hold the close forever."""
        self._unstalled.set()

    def take_refusal(self) -> bool:
        """A new stream: True when it is to be refused (one of `refuse_next` used up)."""
        if not self.refuse_next:
            return False
        self.refuse_next -= 1
        return True

    def take_kv_fetch_failure(self) -> bool:
        """A handoff's KV fetch: True when it is to arrive without its KV."""
        if not self.fail_kv_fetches:
            return False
        self.fail_kv_fetches -= 1
        return True

    def take_batch_drop(self) -> bool:
        """A KV event batch about to be published: True when it is to be lost."""
        dropped, self.drop_next_batch = self.drop_next_batch, False
        return dropped

    # ------------------------------------------------------------ the controls
    def stall(self, stalled: bool, after_steps: int = 0) -> None:
        """Hang every engine step from the next one on (True) until released (False).

        `after_steps` > 0: take that many more steps first, then hang; so a test knows a
        stream cannot have run past them whatever the machine's speed."""
        if after_steps < 0:
            raise ValueError(f"after_steps must be >= 0, got {after_steps}")
        self._stall_after_steps = None
        if stalled and after_steps:
            self._stall_after_steps = after_steps
        elif stalled:
            self._unstalled.clear()
        else:
            self._unstalled.set()


class FaultInjectingWorker(Worker):
    """A `Worker` whose faults a soak or a test sets through its actor handle."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults = StepFaults()
        self.core.faults = self.faults

    async def chaos_stall(self, stalled: bool, after_steps: int = 0) -> None:
        self.faults.stall(stalled, after_steps)

    async def chaos_refuse_next(self, count: int) -> None:
        self.faults.refuse_next = count

    async def chaos_fail_next_kv_fetch(self, count: int) -> None:
        self.faults.fail_kv_fetches = count

    async def chaos_drop_next_event_batch(self) -> None:
        self.faults.drop_next_batch = True
