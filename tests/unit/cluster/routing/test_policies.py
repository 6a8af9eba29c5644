"""The routing policy registry (`make_policy`, the default) and what every policy does alike;
the prefix-blind baselines `least_loaded` and `round_robin` (`cluster/routing/baselines.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedserve.cluster.routing.policies import DEFAULT_POLICY, RoutingPolicy, make_policy
from pagedserve.cluster.routing.policy import WorkerLoad


def idle(worker_id: str, total: int = 100, **changes) -> WorkerLoad:
    load = WorkerLoad(worker_id, 0, 0, used_blocks=0, total_blocks=total, free_blocks=total)
    return replace(load, **changes)


# ----------------------------------------------------------------- registry
def test_registry_and_default():
    assert {"kv_aware", "least_loaded", "round_robin"} <= set(RoutingPolicy.registry)
    assert DEFAULT_POLICY == "kv_aware"
    assert make_policy("kv_aware").name == "kv_aware"


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest'.*least_loaded"):
        make_policy("fastest")


def test_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="bad options"):
        make_policy("round_robin", prefill_weight=2.0)
    with pytest.raises(ValueError, match="imbalance_factor"):
        make_policy("kv_aware", imbalance_factor=0.5)
    with pytest.raises(ValueError, match="block_size"):
        make_policy("kv_aware", block_size=0)


@pytest.mark.parametrize("name", ["kv_aware", "least_loaded", "round_robin"])
def test_every_policy_refuses_no_workers_and_duplicates(name):
    policy = make_policy(name)
    with pytest.raises(ValueError, match="no alive workers"):
        policy.choose(4, {}, [])
    with pytest.raises(ValueError, match="twice"):
        policy.choose(4, {}, [idle("a"), idle("a")])


# ----------------------------------------------------------------- least_loaded
def test_least_loaded_counts_reports_and_unreported_router_requests():
    policy = make_policy("least_loaded")
    loads = [
        idle("a", num_running=2),
        idle("b", inflight=1, unreported=1, num_waiting=1),
        idle("c", num_running=1),
        # Its one request is the one the worker reports running: counted once, not twice.
        idle("d", inflight=1, unreported=0, num_running=1, total=16),
    ]
    decision = policy.choose(5, {"a": 5}, loads)
    assert decision.worker_id == "c"
    assert [c.cost for c in decision.candidates] == [2, 2, 1, 1]
    assert decision.matched_blocks == 0
    assert policy.choose(5, {}, [idle("b"), idle("a")]).worker_id == "a"


# ----------------------------------------------------------------- round_robin
def test_round_robin_cycles_in_id_order():
    policy = make_policy("round_robin")
    loads = [idle("c"), idle("a"), idle("b")]
    assert [policy.choose(1, {}, loads).worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_survives_workers_joining_and_leaving():
    policy = make_policy("round_robin")
    assert policy.choose(1, {}, [idle("a"), idle("c")]).worker_id == "a"
    # b joined: it is next after a, nobody is skipped.
    assert policy.choose(1, {}, [idle("a"), idle("b"), idle("c")]).worker_id == "b"
    # b died: c follows.
    decision = policy.choose(1, {}, [idle("a"), idle("c")])
    assert decision.worker_id == "c"
    assert [c.cost for c in decision.candidates] == [1.0, 0.0]
    assert policy.choose(1, {}, [idle("a"), idle("c")]).worker_id == "a"
