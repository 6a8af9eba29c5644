"""When the router treats a worker's streams as unable to progress (`WorkerState.hung`)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.worker_state import WorkerState

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
        ClusterConfig(stall_timeout_s=0)
