"""`RouterCore.inflight`: what a router holds open, as the leak checks read it (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.types import RouterInflight
from pagedserve.workers.protocol.errors import RequestRejected


def test_an_idle_router_holds_nothing_and_a_counted_request_shows():
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={"w0": None, "w1": None},
    )
    assert core.inflight() == RouterInflight(request_ids=(), num_requests=0, workers={})
    assert core.inflight().idle
    core.workers["w1"].begin(12)  # what `_stream` counts while a request streams there
    assert core.inflight().workers == {"w1": (1, 12)} and not core.inflight().idle
    core.workers["w1"].end(12)
    assert core.inflight().idle


def test_any_open_part_makes_the_table_not_idle():
    assert not RouterInflight(request_ids=("t:r1",), num_requests=0, workers={}).idle
    assert not RouterInflight(request_ids=(), num_requests=1, workers={}).idle
    assert not RouterInflight(request_ids=(), num_requests=0, workers={"w0": (0, 5)}).idle


class _Abortable:
    """A worker handle whose `abort` answers from the ids it runs (tenant-scoped)."""

    def __init__(self, running: set[str], asked: list[str]) -> None:
        async def abort(request_id: str) -> bool:
            asked.append(request_id)
            return request_id in running

        self.abort = type("Method", (), {"remote": staticmethod(abort)})()


def test_abort_of_an_id_another_replica_streams_asks_every_alive_worker_tenant_scoped():
    asked: list[str] = []
    workers = {"w0": _Abortable(set(), asked), "w1": _Abortable({"acme:r1"}, asked)}
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers=workers,
    )
    for worker in core.workers.values():
        worker.alive = True

    assert asyncio.run(core.abort("r1", tenant="acme"))
    assert sorted(asked) == ["acme:r1", "acme:r1"]
    asked.clear()
    assert not asyncio.run(core.abort("r1", tenant="other"))  # another tenant's id: nothing
    assert asked == ["other:r1", "other:r1"]
    core.workers["w1"].alive = False
    asked.clear()
    assert not asyncio.run(core.abort("r1", tenant="acme"))  # a dead worker is not asked
    assert asked == ["acme:r1"]


class _RefusingWorker:
    """A worker handle whose submit is refused (as a worker refuses a request id it already
    streams for another replica); its channel sends nothing; `abort` records what it is
    asked."""

    def __init__(self, asked: list[str]) -> None:
        async def submit(request) -> None:
            raise RequestRejected("request_id 'r1' is already in flight")

        async def channel(owner_id: str, lane=None):
            await asyncio.Event().wait()  # nothing to send
            yield

        async def abort(request_id: str) -> bool:
            asked.append(request_id)
            return True

        self.submit = type("Method", (), {"remote": staticmethod(submit)})()
        self.channel = type("Method", (), {"remote": staticmethod(channel)})()
        self.abort = type("Method", (), {"remote": staticmethod(abort)})()


def test_a_request_refused_before_it_started_is_not_aborted_by_id():
    """The id may be another replica's request on that worker: aborting it would end that one."""
    asked: list[str] = []
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={"w0": _RefusingWorker(asked)},
    )
    worker = core.workers["w0"]
    worker.alive = True
    request = SimpleNamespace(request_id="acme:r1", num_branches=1)

    async def stream() -> None:
        async for _ in core._stream(worker, request, demand=8):
            pass

    with pytest.raises(RequestRejected, match="already in flight"):
        asyncio.run(stream())
    assert asked == []
    assert (worker.inflight, worker.inflight_tokens) == (0, 0)  # the id is `generate`'s to free
