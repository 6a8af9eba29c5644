"""A ranked decision (loads kept per worker change, a bounded scan) picks what a full scan picks.

`KvAwarePolicy.choose_ranked` reads the prefix holders and the least-loaded workers in order;
`choose` scores every worker. On randomized states (loads with ties, prefix matches, waiting
queues, the guard's parameters, workers joining, leaving, draining, stalling) both pick the
same worker, and every candidate the ranked one lists is scored as the full scan scores it.
`RoutableWorkers` must hold exactly the routable workers' current loads after any change.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from pagedserve.cluster.config import RoutingConfig
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.kv_aware import RANKED_LISTED, KvAwarePolicy
from pagedserve.cluster.routing.policies import make_policy
from pagedserve.cluster.routing.policy import WorkerLoad
from pagedserve.cluster.routing.routable import RoutableWorkers
from pagedserve.workers.kv.block_hash import hash_full_blocks


def random_policy(rng: random.Random) -> KvAwarePolicy:
    return KvAwarePolicy(
        prefill_weight=rng.choice([0.0, 1.0, 4.0, 0.37]),
        block_size=rng.choice([1, 16]),
        waiting_weight=rng.choice([0.0, 0.1, 1.0, 2.5]),
        imbalance_factor=rng.choice([1.0, 1.5, 3.0]),
        imbalance_slack=rng.choice([0.0, 16.0]),
        imbalance_pool_fraction=rng.choice([0.0, 0.25, 1.0]),
        pack_below_requests=rng.choice([0, 0, 1, 3, 6]),
    )


def random_load(rng: random.Random, worker_id: str) -> WorkerLoad:
    small = rng.random() < 0.5  # few distinct values: many ties
    pick = (lambda n: rng.randrange(3)) if small else rng.randrange
    total = rng.choice([0, 64, 1024])
    used = min(pick(200), total)
    return WorkerLoad(
        worker_id,
        num_running=pick(8),
        num_waiting=pick(4),
        used_blocks=used,
        total_blocks=total,
        free_blocks=total - used,
        inflight=pick(6),
        inflight_tokens=pick(4000),
    )


def random_matches(rng: random.Random, ids: list[str], num_prompt_blocks: int) -> dict[str, int]:
    holders = rng.sample(ids, rng.randrange(min(len(ids), 6) + 1)) + ["not-alive"]
    return {w: rng.randrange(1, num_prompt_blocks + 4) for w in holders}


def assert_same_choice(policy, num_prompt_blocks, matches, ranking, loads) -> None:
    full = policy.choose(num_prompt_blocks, matches, loads)
    ranked = policy.choose_ranked(num_prompt_blocks, matches, ranking)
    assert ranked.worker_id == full.worker_id
    assert ranked.matched_blocks == full.matched_blocks
    scored = {c.worker_id: c for c in full.candidates}
    assert all(c == scored[c.worker_id] for c in ranked.candidates)
    listed = [c.worker_id for c in ranked.candidates]
    assert listed == sorted(listed)


def test_ranked_choice_equals_the_full_scan_on_random_states():
    rng = random.Random(19)
    for _ in range(3000):
        policy = random_policy(rng)
        ids = [f"w{i:03d}" for i in rng.sample(range(500), rng.randrange(1, 40))]
        loads = [random_load(rng, w) for w in ids]
        ranking = policy.new_ranking()
        for load in loads:
            ranking.put(load)
        num_prompt_blocks = rng.randrange(0, 24)
        matches = random_matches(rng, ids, max(1, num_prompt_blocks))
        assert_same_choice(policy, num_prompt_blocks, matches, ranking, loads)


def test_ranked_choice_lists_holders_and_a_few_least_loaded_not_everyone():
    policy = KvAwarePolicy()
    loads = [WorkerLoad(f"w{i:02d}", 0, 0, i // 8, 1024, 1024 - i // 8) for i in range(64)]
    ranking = policy.new_ranking()
    for load in loads:
        ranking.put(load)
    decision = policy.choose_ranked(10, {"w50": 10}, ranking)
    assert decision.worker_id == "w50"  # holds the whole prompt, lightly loaded
    assert [c.worker_id for c in decision.candidates] == ["w00", "w01", "w02", "w03", "w50"]
    assert len(decision.candidates) == RANKED_LISTED + 1


def test_when_rounding_excludes_everyone_both_drop_the_guard():
    """Mean load (3 · 1.1 / 3 = 1.0999…) below each equal load 1.1 with no slack: the guard
    would exclude all three; both ways then choose as if there were no guard."""
    policy = KvAwarePolicy(waiting_weight=0.1, imbalance_factor=1.0, imbalance_slack=0.0)
    loads = [WorkerLoad(w, 0, 1, 1, 100, 99) for w in ("a", "b", "c")]
    ranking = policy.new_ranking()
    for load in loads:
        ranking.put(load)
    full = policy.choose(2, {"b": 1}, loads)
    assert full.worker_id == "b" and all(c.excluded is None for c in full.candidates)
    assert_same_choice(policy, 2, {"b": 1}, ranking, loads)


def test_other_policies_score_the_ranked_loads_in_full():
    for name in ("least_loaded", "round_robin"):
        policy = make_policy(name)
        ranking = policy.new_ranking()
        loads = [WorkerLoad(w, 1, 0, 0, 8, 8) for w in ("b", "a")]
        for load in loads:
            ranking.put(load)
        assert list(ranking.ordered()) == []
        decision = policy.choose_ranked(3, {}, ranking)
        assert [c.worker_id for c in decision.candidates] == ["a", "b"]


# ----------------------------------------------------------------- the router's tracking
def stats(rng: random.Random, total: int) -> SimpleNamespace:
    used = rng.randrange(total + 1)
    kv = SimpleNamespace(total_blocks=total, used_blocks=used, reserve_blocks=0)
    running, waiting = rng.randrange(4), rng.randrange(3)
    return SimpleNamespace(kv=kv, num_running=running, num_waiting=waiting, owned_requests=())


def change_something(rng: random.Random, workers: dict[str, WorkerState]) -> None:
    """One of the changes a router sees: a poll, a request begun or ended, liveness, drain,
    stall, a worker joining, leaving or being replaced by a fresh state."""
    state = rng.choice(list(workers.values()))
    action = rng.randrange(9)
    if action == 0:
        state.stats = stats(rng, 64)
    elif action == 1:
        state.begin(rng.randrange(1, 500))
    elif action == 2 and state.inflight:
        state.end(state.inflight_tokens // state.inflight)
    elif action == 3:
        state.alive = not state.alive
    elif action == 4:
        state.draining = rng.random() < 0.3
    elif action == 5:
        state.stalled = rng.random() < 0.2
    elif action == 6:
        state.mark_alive(SimpleNamespace(num_blocks=64))
    elif action == 7 and len(workers) > 1:
        del workers[state.worker_id]
    elif action == 8:
        worker_id = rng.choice([state.worker_id, f"new{rng.randrange(100)}"])
        fresh = WorkerState(worker_id, handle=None)
        fresh.mark_alive(SimpleNamespace(num_blocks=64))
        workers[worker_id] = fresh


def test_routable_workers_track_every_change_and_choose_as_a_full_scan():
    rng = random.Random(7)
    policy = KvAwarePolicy()
    workers = {f"w{i}": WorkerState(f"w{i}", handle=None) for i in range(16)}
    for state in workers.values():
        state.mark_alive(SimpleNamespace(num_blocks=64))
    routable = RoutableWorkers(workers, policy.new_ranking())
    for step in range(3000):
        for _ in range(rng.randrange(1, 4)):
            change_something(rng, workers)
        ranking = routable.current()
        alive = [w for w in workers.values() if w.routable]
        expected = sorted((w.load() for w in alive), key=lambda load: load.worker_id)
        assert sorted(ranking.loads(), key=lambda load: load.worker_id) == expected, step
        assert list(ranking.ordered()) == sorted(policy.rank_key(load) for load in expected)
        if alive:
            matches = random_matches(rng, [w.worker_id for w in alive], 8)
            assert_same_choice(policy, 8, matches, ranking, [w.load() for w in alive])


def test_a_worker_s_cached_load_follows_every_assignment():
    state = WorkerState("w0", handle=None)
    state.mark_alive(SimpleNamespace(num_blocks=64))
    first = state.load()
    assert state.load() is first  # kept while nothing changed
    state.begin(32)
    assert state.load().inflight == 1 and state.load().inflight_tokens == 32
    state.stats = stats(random.Random(1), 64)
    assert state.load().used_blocks == state.stats.kv.used_blocks


@pytest.mark.parametrize("exclude", [frozenset(), frozenset({"w1"})])
def test_router_routes_from_its_ranking(exclude):
    config = RouterConfig(
        routing=RoutingConfig(enable_pull=False),
    )
    core = RouterCore(config, index=None, workers={f"w{i}": None for i in range(3)})
    for state in core.workers.values():
        state.mark_alive(SimpleNamespace(num_blocks=64, block_size=16, max_model_len=1024))
    core.model_name = "m"
    tokens = list(range(64))
    core.view._link("w2", hash_full_blocks(tokens, core.block_size, ("m",))[0])
    core.workers["w0"].begin(16)  # w0 busier; w1 and w2 idle, w2 holds the first block
    worker, matched = asyncio.run(core.route(tokens, None, exclude=exclude))
    assert (worker.worker_id, matched) == ("w2", 1)
    core.workers["w2"].draining = True  # the ranking sees it at once: w1 next (unless refused)
    worker, _ = asyncio.run(core.route(tokens, None, exclude=exclude))
    assert worker.worker_id == ("w0" if exclude else "w1")
