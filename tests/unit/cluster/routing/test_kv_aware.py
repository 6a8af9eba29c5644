"""The `kv_aware` routing policy: its cost, the imbalance guard and router-side load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedserve.cluster.routing.kv_aware import KvAwarePolicy
from pagedserve.cluster.routing.policies import make_policy
from pagedserve.cluster.routing.policy import Candidate, WorkerLoad


def idle(worker_id: str, total: int = 100, **changes) -> WorkerLoad:
    load = WorkerLoad(worker_id, 0, 0, used_blocks=0, total_blocks=total, free_blocks=total)
    return replace(load, **changes)


def sent(load: WorkerLoad, tokens: int) -> WorkerLoad:
    """What the caller does after routing a request to `load.worker_id`."""
    return replace(
        load,
        inflight=load.inflight + 1,
        inflight_tokens=load.inflight_tokens + tokens,
        unreported=load.unreported + 1,  # no report has seen it yet
    )


def test_kv_aware_prefers_the_worker_holding_the_prefix():
    policy = make_policy("kv_aware", prefill_weight=1.0)
    decision = policy.choose(10, {"b": 8}, [idle("a"), idle("b"), idle("c")])
    assert decision.worker_id == "b"
    assert decision.policy == "kv_aware" and decision.matched_blocks == 8
    assert decision.candidates == (
        Candidate("a", 0, 10, 0.0, 10.0),
        Candidate("b", 8, 2, 0.0, 2.0),
        Candidate("c", 0, 10, 0.0, 10.0),
    )


def test_kv_aware_cost_trades_prefill_against_load():
    policy = KvAwarePolicy(prefill_weight=1.0, imbalance_slack=1000)
    loads = [idle("a", used_blocks=5), idle("b", used_blocks=30)]
    # b saves 8 blocks of prefill but carries 25 more blocks of load.
    assert policy.choose(10, {"b": 8}, loads).worker_id == "a"
    # With prefill weighed 4x, the 8 blocks saved are worth 32.
    heavy_prefill = KvAwarePolicy(prefill_weight=4.0, imbalance_slack=1000)
    assert heavy_prefill.choose(10, {"b": 8}, loads).worker_id == "b"


def test_default_weight_keeps_a_busy_holder_over_a_cold_idle_worker():
    """The routing bench's case: the holder serves one long request whose 64 blocks include
    the very prefix the new request shares; weight 1 sent the request to a cold worker."""
    loads = [idle("holder", total=8192, used_blocks=67), idle("cold", total=8192)]
    assert make_policy("kv_aware").choose(66, {"holder": 64}, loads).worker_id == "holder"
    # On a small pool the same load is a real share of it: the guard may step in.
    small = [idle("holder", total=100, used_blocks=67), idle("cold", total=100)]
    assert make_policy("kv_aware").choose(66, {"holder": 64}, small).worker_id == "cold"
    weight_one = make_policy("kv_aware", prefill_weight=1.0, imbalance_slack=1000)
    assert weight_one.choose(66, {"holder": 64}, loads).worker_id == "cold"


def test_kv_aware_load_definition():
    policy = KvAwarePolicy(block_size=16, waiting_weight=2.0)
    # Reported use wins when larger...
    assert policy.load_of(idle("a", used_blocks=10, inflight_tokens=33)) == 10
    # ...the router's estimate (ceil(33 / 16) = 3 blocks) when the report lags; plus waiting.
    assert policy.load_of(idle("a", used_blocks=1, inflight_tokens=33, num_waiting=2)) == 3 + 4


def test_hot_prefix_moves_off_an_overloaded_holder():
    policy = KvAwarePolicy(imbalance_factor=1.5, imbalance_slack=8)
    holder = idle("a", used_blocks=60)
    loads = [holder, idle("b", used_blocks=10), idle("c", used_blocks=20)]
    # mean 30 -> bound 1.5 * 30 + 8 = 53: a (60) is out even though it saves all 40 blocks.
    assert policy.guard_bound(60 + 10 + 20, 0, 3) == 53
    decision = policy.choose(40, {"a": 40}, loads)
    assert decision.worker_id == "b" and decision.matched_blocks == 0
    assert [c.excluded for c in decision.candidates] == ["overloaded", None, None]
    loads[0] = replace(holder, used_blocks=50)  # mean 26.67 -> bound 48: still over
    assert policy.choose(40, {"a": 40}, loads).worker_id == "b"
    # Under the bound the holder keeps the hot prefix.
    loads[0] = replace(holder, used_blocks=45)  # mean 25 -> bound 45.5: allowed
    assert policy.choose(40, {"a": 40}, loads).worker_id == "a"


def test_hot_prefix_requests_spread_once_the_holder_fills_up():
    """Route a stream of requests sharing a 20-block prefix; the caller counts each one."""
    policy = KvAwarePolicy(imbalance_factor=1.5, imbalance_slack=8, block_size=16)
    loads = {w: idle(w) for w in "abc"}
    matches = {"a": 20}
    chosen = []
    for _ in range(12):
        decision = policy.choose(21, matches, list(loads.values()))
        chosen.append(decision.worker_id)
        loads[decision.worker_id] = sent(loads[decision.worker_id], tokens=21 * 16)
        matches.setdefault(decision.worker_id, 20)  # it now caches the prefix too
    assert chosen[0] == "a"
    assert set(chosen) == {"a", "b", "c"}
    counts = [chosen.count(w) for w in "abc"]
    assert max(counts) - min(counts) <= 1


def test_router_inflight_keeps_back_to_back_requests_apart():
    policy = make_policy("kv_aware")
    loads = [idle("a"), idle("b")]
    first = policy.choose(4, {}, loads)
    assert first.worker_id == "a"  # equal: lowest id
    # No report from the workers yet; only the router's own count changed.
    loads = [sent(loads[0], tokens=64), loads[1]]
    assert policy.choose(4, {}, loads).worker_id == "b"


def test_inflight_count_breaks_ties_even_without_token_estimates():
    loads = [idle("a", inflight=1), idle("b")]
    assert make_policy("kv_aware").choose(4, {}, loads).worker_id == "b"


def test_kv_aware_ignores_matches_of_workers_not_alive_and_clamps():
    decision = make_policy("kv_aware").choose(3, {"dead": 3, "a": 9}, [idle("a"), idle("b")])
    assert decision.worker_id == "a" and decision.matched_blocks == 3
    assert decision.candidates[0].prefill_blocks == 0


def test_kv_aware_ties_break_on_load_then_worker_id():
    policy = KvAwarePolicy(prefill_weight=1.0, imbalance_slack=1000)
    # Equal cost 10: a by prefill (10 + 0), b by load (0 + 10) -> lower load wins.
    loads = [idle("a"), idle("b", used_blocks=10)]
    assert policy.choose(10, {"b": 10}, loads).worker_id == "a"
    assert policy.choose(10, {}, [idle("z"), idle("y")]).worker_id == "y"


def pack_ten(policy: KvAwarePolicy, tokens: int) -> list[str]:
    """Where ten requests of `tokens` each go, one after another, none finishing."""
    loads = {w: idle(w, total=10_000) for w in "ab"}
    chosen = []
    for _ in range(10):
        decision = policy.choose(4, {}, list(loads.values()))
        chosen.append(decision.worker_id)
        loads[decision.worker_id] = sent(loads[decision.worker_id], tokens=tokens)
    return chosen


def test_packing_gathers_light_traffic_on_one_worker_until_it_holds_enough_requests():
    """Workers sharing a machine's cores: a busy worker holding fewer than
    `pack_below_requests` weighs less than an idle one, so requests gather there; from that
    count on they spread as usual."""
    policy = KvAwarePolicy(pack_below_requests=4, block_size=16)
    chosen = pack_ten(policy, tokens=16 * 16)  # 16 blocks each
    # a fills to 4 requests, then b to 4, then they alternate.
    assert chosen[:8] == ["a"] * 4 + ["b"] * 4
    assert sorted(chosen[8:]) == ["a", "b"]
    busy_a = sent(idle("a"), 16 * 16)
    costs = {c.worker_id: c.load for c in policy.choose(4, {}, [busy_a, idle("b")]).candidates}
    assert costs == {"a": -16.0, "b": 0.0}  # weighed: a busy worker below the count, -load
    # Without packing the same requests alternate from the first.
    assert pack_ten(KvAwarePolicy(block_size=16), tokens=16 * 16)[:4] == ["a", "b", "a", "b"]


def test_packing_holds_for_requests_that_may_fill_the_context():
    """A request sent without `max_tokens` reserves what is left of the context: hundreds of
    blocks each. Counted in requests, packing still gathers them."""
    policy = KvAwarePolicy(pack_below_requests=3, block_size=16)
    assert pack_ten(policy, tokens=8192)[:6] == ["a"] * 3 + ["b"] * 3


def test_a_prefix_held_elsewhere_can_outweigh_packing():
    """Packing weighs a busy worker's load against prefill like any load: a long prefix
    cached on the idle worker still wins the request there."""
    policy = KvAwarePolicy(pack_below_requests=6, block_size=16, prefill_weight=1.0)
    busy = sent(idle("a", total=10_000), tokens=16 * 16)  # 16 blocks
    assert policy.choose(40, {"b": 32}, [busy, idle("b", total=10_000)]).worker_id == "b"
    assert policy.choose(40, {"b": 8}, [busy, idle("b", total=10_000)]).worker_id == "a"


def test_packing_is_on_where_the_workers_share_cores_unless_the_options_say():
    from pagedserve.cluster.routing.policies import PACK_BELOW_REQUESTS, options_of

    packing = {"pack_below_requests": PACK_BELOW_REQUESTS}
    assert options_of("kv_aware", {}, share_cores=True) == packing
    assert options_of("kv_aware", {"pack_below_requests": 0}, True) == {"pack_below_requests": 0}
    assert options_of("kv_aware", {"prefill_weight": 2.0}, False) == {"prefill_weight": 2.0}
    assert options_of("least_loaded", {}, True) == {}
    with pytest.raises(ValueError, match="pack_below_requests must be >= 0"):
        KvAwarePolicy(pack_below_requests=-1)
    with pytest.raises(ValueError, match="pack_below_requests must be an integer"):
        KvAwarePolicy(pack_below_requests=2.5)
