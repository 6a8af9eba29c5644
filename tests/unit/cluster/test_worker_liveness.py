"""`WorkerLiveness.drop` without Ray: a lost worker leaves the index before any caller of
`drop` goes on, even when the poll loop and a stream see the loss at the same time."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router_types import RouterCounters
from pagedserve.cluster.worker_liveness import WorkerLiveness
from pagedserve.cluster.worker_state import WorkerState


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
        liveness = WorkerLiveness(ClusterConfig(), index, {"w0": worker}, "router", counters)
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
