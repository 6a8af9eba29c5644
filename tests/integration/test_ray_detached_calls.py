"""A call an actor starts in a `detached_context` is not cancelled with the request it serves.

Ray cancels, with a cancelled actor call, every call submitted from its asyncio context: this is
how a client's cancel of one streamed request ended the router's channel to a worker, opened by
that request and shared by every other request on that worker (they were all aborted and
replayed). Here, on a real Ray, one call of each kind is started under a request that is then
cancelled: the attached one is cancelled with it, the detached one goes on.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from pagedserve.workers.ray_internals import detached_context


@ray.remote(num_cpus=0)
class Streamer:
    """Streams of one item per `release`, each ending only when cancelled."""

    def __init__(self) -> None:
        self.cancelled: dict[str, asyncio.Event] = {}
        self.releases: dict[str, asyncio.Queue] = {}

    async def stream(self, name: str):
        cancelled = self.cancelled.setdefault(name, asyncio.Event())
        releases = self.releases.setdefault(name, asyncio.Queue())
        try:
            while True:
                yield await releases.get()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def release(self, name: str, item: str) -> None:
        await self.releases.setdefault(name, asyncio.Queue()).put(item)

    async def wait_cancelled(self, name: str) -> None:
        await self.cancelled.setdefault(name, asyncio.Event()).wait()


@ray.remote(num_cpus=0)
class Requester:
    """Serves one request that opens both streams, then waits until it is cancelled."""

    def __init__(self, streamer) -> None:
        self.streamer = streamer
        self.streams: dict[str, ray.ObjectRefGenerator] = {}
        self.opened = asyncio.Event()

    async def serve(self) -> None:
        stream = self.streamer.stream.options(num_returns="streaming").remote
        self.streams["attached"] = stream("attached")
        self.streams["detached"] = detached_context().run(stream, "detached")
        for name in self.streams:
            await self.streamer.release.remote(name, "first")
            assert await (await anext(self.streams[name])) == "first"
        self.opened.set()
        await asyncio.Event().wait()  # until cancelled

    async def wait_opened(self) -> None:
        await self.opened.wait()

    async def read(self, name: str) -> str:
        return await (await anext(self.streams[name]))


@pytest.fixture
def actors(ray_cluster):
    streamer = Streamer.remote()
    requester = Requester.remote(streamer)
    yield streamer, requester
    for actor in (requester, streamer):
        ray.kill(actor)


def test_a_detached_call_outlives_the_cancelled_request_that_started_it(actors):
    streamer, requester = actors
    request = requester.serve.remote()
    ray.get(requester.wait_opened.remote(), timeout=60)
    ray.cancel(request)
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(request, timeout=60)
    ray.get(streamer.wait_cancelled.remote("attached"), timeout=60)  # the cancel reached it

    ray.get(streamer.release.remote("detached", "second"), timeout=60)
    assert ray.get(requester.read.remote("detached"), timeout=60) == "second"
