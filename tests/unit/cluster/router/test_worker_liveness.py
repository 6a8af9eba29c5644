"""`WorkerLiveness` without Ray: a lost worker leaves the index before any caller of `drop`
goes on, even when the poll loop and a stream see the loss at the same time; a hanging
after-poll hook (a push into a stalled peer) never holds up the polls."""

from __future__ import annotations

import asyncio
import dataclasses

from pagedserve.cluster.config import FailureConfig
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_liveness import WorkerLiveness
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.stats import KVUsage, WorkerInfo, WorkerStats


class SlowIndex:
    """An index whose `remove_worker` takes until `release` is set (a busy actor)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.removed: list[str] = []
        self.remove_worker = self  # called as index.remove_worker.remote(worker_id)

    def remote(self, worker_id: str):
        async def remove() -> int:
            await self.release.wait()
            self.removed.append(worker_id)
            return 1

        return remove()


def test_a_second_drop_waits_for_the_first_one_s_index_removal():
    async def main():
        index = SlowIndex()
        worker = WorkerState("w0", handle=None, alive=True)
        counters = RouterCounters()
        liveness = WorkerLiveness(FailureConfig(), index, {"w0": worker}, "router", counters)
        by_poll = asyncio.create_task(liveness.drop(worker))
        await asyncio.sleep(0)  # the poll loop's drop is under way, waiting on the index
        by_stream = asyncio.create_task(liveness.drop(worker))
        await asyncio.sleep(0.05)
        # Neither may go on (a stream's caller reads the index next) before the removal.
        assert not by_poll.done() and not by_stream.done() and not worker.alive
        index.release.set()
        await asyncio.gather(by_poll, by_stream)
        assert index.removed == ["w0"] and counters.workers_lost == 1
        await liveness.drop(worker)  # a dead worker dropped again: nothing more
        assert index.removed == ["w0"] and counters.workers_lost == 1

    asyncio.run(main())


class Remote:
    """`handle.<method>.remote(...)` over a plain coroutine function."""

    def __init__(self, fn) -> None:
        self.remote = fn


def stalled_stats(seconds_without_progress: float) -> WorkerStats:
    kv = KVUsage(**{f.name: 0 for f in dataclasses.fields(KVUsage)})
    return WorkerStats("w1", "e", kv, seconds_without_progress=seconds_without_progress)


def test_a_hanging_after_poll_hook_does_not_hold_up_the_polls():
    """A push into a stalled peer hangs; the polls that judge that peer go on meanwhile."""

    async def main():
        info = WorkerInfo("w1", "e", "m", 8, 256, 64, 10)
        stalled = WorkerState("w1", handle=None, alive=True, info=info)
        progress = iter([0.0, 100.0])

        async def stats(router_id):
            return stalled_stats(next(progress))

        stalled.handle = type("Handle", (), {"stats": Remote(stats)})()
        hook_started, never = asyncio.Event(), asyncio.Event()
        calls = []

        async def hanging_push(worker):
            calls.append(worker.worker_id)
            hook_started.set()
            await never.wait()

        config = FailureConfig(stall_timeout_s=5.0)
        liveness = WorkerLiveness(
            config, None, {"w1": stalled}, "router", RouterCounters(), on_polled=hanging_push
        )
        await within(liveness.poll(stalled), 5)
        await within(hook_started.wait(), 5)
        # The hook hangs; the next poll still returns, and judges the stall.
        await within(liveness.poll(stalled), 5)
        assert stalled.stalled and liveness.counters.workers_stalled == 1
        assert calls == ["w1"], "a second hook started while the first one still ran"
        liveness.close()

    asyncio.run(main())


def test_a_worker_reporting_draining_leaves_routing_until_a_new_incarnation():
    """Draining for any reason (SIGTERM, another replica's drain): every replica routes
    nothing new there from its next poll; the worker's restart brings it back."""

    async def main():
        info = WorkerInfo("w1", "e", "m", 8, 256, 64, 10)
        worker = WorkerState("w1", handle=None, alive=True, info=info)
        kv = KVUsage(**{f.name: 0 for f in dataclasses.fields(KVUsage)})
        reports = iter([WorkerStats("w1", "e", kv), WorkerStats("w1", "e", kv, draining=True)])

        async def stats(router_id):
            return next(reports)

        async def ready():
            return dataclasses.replace(info, epoch="e2")

        worker.handle = type("Handle", (), {"stats": Remote(stats), "ready": Remote(ready)})()
        liveness = WorkerLiveness(FailureConfig(), None, {"w1": worker}, "r", RouterCounters())
        await liveness.poll(worker)
        assert worker.routable
        await liveness.poll(worker)
        assert not worker.routable and worker.draining
        await liveness.revive(worker)  # a new incarnation answered ready()
        assert worker.routable

    asyncio.run(main())


class Renewals:
    """A handle's `renew_lease.remote(router_id)`, counted; `stats` answers or hangs."""

    def __init__(self, answers: bool) -> None:
        self.count = 0
        self.renewed = asyncio.Event()
        self.polled = asyncio.Event()
        self.renew_lease = Remote(self._renew)
        kv = KVUsage(**{f.name: 0 for f in dataclasses.fields(KVUsage)})
        self.answer = WorkerStats("w", "e", kv)
        self.stats = Remote(self._stats if answers else self._hang)

    def _renew(self, router_id: str) -> None:
        self.count += 1
        self.renewed.set()

    async def _stats(self, router_id: str) -> WorkerStats:
        self.polled.set()
        return self.answer

    async def _hang(self, router_id: str) -> WorkerStats:
        self.polled.set()
        await asyncio.Event().wait()
        raise AssertionError("never answers")


def liveness_over(*handles: Renewals) -> tuple[WorkerLiveness, list[WorkerState]]:
    info = WorkerInfo("w", "e", "m", 8, 256, 64, 10)
    workers = [WorkerState(f"w{i}", handle=h, alive=True, info=info) for i, h in enumerate(handles)]
    config = FailureConfig(stats_interval_s=1.0, lease_timeout_s=10.0)
    by_id = {w.worker_id: w for w in workers}
    return WorkerLiveness(config, None, by_id, "r", RouterCounters()), workers


def test_a_worker_polled_within_the_last_interval_and_a_half_gets_no_separate_renewal():
    async def main():
        handle = Renewals(answers=True)
        liveness, (worker,) = liveness_over(handle)
        liveness.renew_due(0.0)  # never polled: renewed
        assert handle.count == 1
        await liveness.poll(worker)  # the poll itself renews where it arrives
        polled = liveness._polled_at[worker.worker_id]
        liveness.renew_due(polled + 1.4)
        assert handle.count == 1
        liveness.renew_due(polled + 1.5)  # the polls fell behind: renewed on its own
        assert handle.count == 2
        liveness.forget(worker.worker_id)  # a worker that left and came back: renewed again
        liveness.renew_due(polled + 0.1)
        assert handle.count == 3

    asyncio.run(main())


def test_a_poll_round_held_up_by_one_worker_leaves_no_lease_unrenewed():
    """One worker never answers its poll, so the poll loop's round never ends: the lease loop
    renews every worker's lease meanwhile, the answering one's included."""

    async def main():
        hanging, answering = Renewals(answers=False), Renewals(answers=True)
        liveness, _ = liveness_over(hanging, answering)
        liveness.config = FailureConfig(
            stats_interval_s=0.1, lease_timeout_s=1.0, rpc_timeout_s=3600.0
        )
        polls = asyncio.create_task(liveness._poll_loop())
        for handle in (hanging, answering):  # the round is under way: both polls sent
            await within(handle.polled.wait(), 30)
        renewals = asyncio.create_task(liveness._renew_loop())
        for handle in (hanging, answering):  # within 1.5 intervals of the polls, then each one
            handle.renewed.clear()
            await within(handle.renewed.wait(), 30)
        polls.cancel()
        renewals.cancel()

    asyncio.run(main())
