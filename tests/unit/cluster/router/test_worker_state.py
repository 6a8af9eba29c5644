"""When the router treats a worker's streams as unable to progress (`WorkerState.hung`), and
the load it adds to a worker's report (`WorkerState.unreported`)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.cluster.config import ClusterConfig, FailureConfig
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.protocol.stats import KVUsage, WorkerStats

STALL_S = 5.0


def worker(**state) -> WorkerState:
    return WorkerState("w0", handle=None, **state)


def test_an_alive_stepping_worker_is_never_hung():
    assert not worker(alive=True).hung(now=1e9, stall_timeout_s=STALL_S)


def test_a_stalled_worker_is_hung_and_out_of_routing():
    stalled = worker(alive=True, stalled=True)
    assert stalled.hung(now=0.0, stall_timeout_s=STALL_S) and not stalled.routable


def test_an_unanswering_worker_is_hung_only_after_the_stall_timeout():
    # A dropped worker whose actor died ends its streams itself; one whose loop is stuck
    # never would, so after `stall_timeout_s` its streams end as lost.
    lost = worker(alive=False, lost_at=100.0)
    assert not lost.hung(now=100.0 + STALL_S, stall_timeout_s=STALL_S)
    assert lost.hung(now=100.0 + STALL_S + 0.1, stall_timeout_s=STALL_S)


def test_stall_timeout_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        ClusterConfig(
            failure=FailureConfig(stall_timeout_s=0),
        )


def test_load_adds_only_this_router_s_requests_the_report_does_not_show():
    """Several router replicas: the worker's report covers everyone's requests there, this
    router's included, so only what it sent since (or not yet admitted) is added on top."""
    state = worker(alive=True)
    kv = KVUsage(**{f.name: 0 for f in dataclasses.fields(KVUsage)})
    state.begin(10, "r1")
    state.begin(10, "r2")
    assert (state.unreported, state.load().num_requests) == (2, 2)  # no report yet
    # The report: r1 is running there, and 3 more requests from other replicas.
    state.stats = WorkerStats("w0", "e", kv, num_running=3, num_waiting=1, owned_requests=("r1",))
    state.begin(10, "r3")  # sent after the report was taken
    state.begin(10_000)  # a pin with no request id: never in a report
    load = state.load()
    assert (load.inflight, load.unreported) == (4, 3)
    assert load.num_requests == 3 + 1 + 3  # reported, plus r2, r3 and the pin, r1 once
    state.end(10, "r1")
    state.end(10, "r2")
    state.end(10, "r3")
    state.end(10_000)
    assert (state.inflight, state.unreported, state.open_legs) == (0, 0, {})
