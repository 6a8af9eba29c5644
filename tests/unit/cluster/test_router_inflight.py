"""`RouterCore.inflight`: what a router holds open, as the leak checks read it (no Ray)."""

from __future__ import annotations

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router import RouterCore
from pagedserve.cluster.router_types import RouterInflight


def test_an_idle_router_holds_nothing_and_a_counted_request_shows():
    core = RouterCore(ClusterConfig(num_workers=2), index=None, workers={"w0": None, "w1": None})
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
