"""PrefixIndexActor on a real Ray (the test process's shared cluster): resync from a worker's
snapshot, and its deadline; a restarted index resyncs from the worker pool's members at once."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import ray
from support.wait import until

from pagedserve.cluster.index.prefix_index import PublishResult, get_or_create_prefix_index
from pagedserve.cluster.pool.types import Member, Membership, MembershipVersion, MemberState
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import KVSnapshot

# The deadline of one snapshot pull. A stand-in answers at once on a quiet machine, but a
# pull that misses the deadline is a failed resync, not a slow one: under a loaded machine 1 s
# was missed (the first publish then found the index blind). Only the stuck-worker test, which
# waits out the deadline on purpose, uses the short one.
SNAPSHOT_TIMEOUT_S = 30.0
STUCK_SNAPSHOT_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def indexes_go_with_the_module(ray_cluster):
    """The indexes made here are named and detached, in this module's job namespace: killed
    after its last test, so the shared cluster (support/shared_cluster.py) is clean for the
    next module."""
    yield
    namespace = ray.get_runtime_context().namespace
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == namespace:
            ray.kill(ray.get_actor(actor["name"], namespace=namespace), no_restart=True)


@ray.remote
class StandInWorker:
    """A worker reduced to its KV pool: caches chains of blocks and publishes their events.

    Async, so that it answers `kv_snapshot()` while its own `publish` call is pending.
    """

    def __init__(self, worker_id: str, index) -> None:
        self.worker_id = worker_id
        self.index = index
        self.epoch = uuid.uuid4().hex
        self.pool = BlockPool(16)

    async def cache_chain(self, token_blocks: list[list[int]]) -> list[bytes]:
        parent, hashes = None, []
        for tokens in token_blocks:
            (block,) = self.pool.get_new_blocks(1)
            key = BlockKey(parent, tuple(tokens), ())
            parent = block_hash(parent, tokens)
            self.pool.cache_full_block(block, parent, key)
            self.pool.free_blocks([block])
            hashes.append(parent)
        return hashes

    async def flush(self, lose: bool = False) -> PublishResult | None:
        events = self.pool.take_events()
        if lose:
            return None
        return await self.index.publish.remote(self.worker_id, self.epoch, events)

    async def restart(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.pool = BlockPool(16)

    async def cached(self) -> set[bytes]:
        return set(self.pool.cached)

    async def incarnation(self) -> str:
        return self.epoch

    async def kv_snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            self.worker_id, self.epoch, self.pool.next_event_seq, tuple(self.pool.cached)
        )


@ray.remote
class StuckWorker:
    """A worker whose snapshot never comes."""

    async def kv_snapshot(self) -> KVSnapshot:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


@ray.remote
class StandInPool:
    """A worker pool reduced to its membership: the members it was given, as they are."""

    def __init__(self, members: list[tuple[str, object, MemberState]]) -> None:
        listed = tuple(Member(w, handle, state) for w, handle, state in members)
        self._membership = Membership(MembershipVersion("stand-in", len(listed)), listed)

    async def membership(self, router_id=None, held=None) -> Membership:
        return self._membership


def register(index, worker_id: str, worker) -> None:
    """`worker` joins the index as `worker_id`, with its incarnation now."""
    ray.get(index.register_worker.remote(worker_id, worker, ray.get(worker.incarnation.remote())))


def _index(name: str, snapshot_timeout_s: float = SNAPSHOT_TIMEOUT_S):
    return get_or_create_prefix_index(
        name=name, max_entries=1000, snapshot_timeout_s=snapshot_timeout_s
    )


def test_named_index_is_shared():
    first = _index("shared")
    ray.get(first.remove_worker.remote("nobody"))
    assert _index("shared")._actor_id == first._actor_id


def test_gap_resyncs_from_the_workers_snapshot_and_agrees_with_its_pool():
    index = _index("resync")
    worker = StandInWorker.remote("w0", index)
    register(index, "w0", worker)
    # Registration pulls the snapshot at once (nothing cached yet), so the first batch of
    # events is in step.
    assert ray.get(index.snapshot_of.remote("w0")) == set()
    chain = ray.get(worker.cache_chain.remote([[1, 2], [3, 4]]))
    assert ray.get(worker.flush.remote()) == PublishResult(2, False)
    assert ray.get(index.snapshot_of.remote("w0")) == set(chain)

    ray.get(worker.cache_chain.remote([[9, 9]]))
    assert ray.get(worker.flush.remote()) == PublishResult(1, False)

    ray.get(worker.cache_chain.remote([[5, 6], [7, 8]]))
    ray.get(worker.flush.remote(lose=True))  # this batch never reaches the index
    ray.get(worker.cache_chain.remote([[1, 2], [3, 4], [5, 5]]))
    result = ray.get(worker.flush.remote())
    assert result.needs_resync and result.resynced
    cached = ray.get(worker.cached.remote())
    assert ray.get(index.snapshot_of.remote("w0")) == cached
    assert len(cached) == 6
    assert ray.get(index.match.remote(chain)) == {"w0": 2}

    stats = ray.get(index.stats.remote())
    assert stats.gaps_detected == 1 and stats.resyncs == 2
    assert stats.registered_workers == ("w0",) and stats.snapshot_failures == 0


def test_restarted_worker_resyncs_and_a_dead_one_is_dropped():
    index = _index("restart")
    worker = StandInWorker.remote("w0", index)
    register(index, "w0", worker)
    ray.get(worker.cache_chain.remote([[1, 2]]))
    ray.get(worker.flush.remote())
    ray.get(worker.restart.remote())
    chain = ray.get(worker.cache_chain.remote([[3, 4]]))
    result = ray.get(worker.flush.remote())
    assert result.resynced
    assert ray.get(index.snapshot_of.remote("w0")) == set(chain)
    assert ray.get(index.remove_worker.remote("w0")) == 1
    assert ray.get(index.match.remote(chain)) == {}
    assert ray.get(index.stats.remote()).registered_workers == ()


def test_a_restarted_worker_that_registers_before_it_publishes_is_resynced():
    """Ray restarted the worker and no router dropped it: the new incarnation registers with
    its epoch and the index replaces the old one's entries at once, before any publish."""
    index = _index("restart-register")
    worker = StandInWorker.remote("w0", index)
    register(index, "w0", worker)
    old = ray.get(worker.cache_chain.remote([[1, 2]]))
    ray.get(worker.flush.remote())
    register(index, "w0", worker)
    assert ray.get(index.snapshot_of.remote("w0")) == set(old)  # same incarnation: kept
    ray.get(worker.restart.remote())
    new = ray.get(worker.cache_chain.remote([[3, 4]]))  # not published
    register(index, "w0", worker)
    assert ray.get(index.snapshot_of.remote("w0")) == set(new)
    assert ray.get(index.match.remote(old)) == {}


def test_a_stuck_snapshot_hits_the_deadline_and_the_publish_returns():
    index = _index("stuck", STUCK_SNAPSHOT_TIMEOUT_S)
    stuck = StuckWorker.remote()
    # The snapshot would take an hour: registration (which pulls it) and then a publish (which
    # tries again) each return at the deadline, not after it (the 60 s here only stops a
    # hang; how soon after the deadline depends on the machine).
    started = time.monotonic()
    ray.get(index.register_worker.remote("w9", stuck, "stuck"), timeout=60)
    assert time.monotonic() - started >= STUCK_SNAPSHOT_TIMEOUT_S * 0.9
    started = time.monotonic()
    result = ray.get(index.publish.remote("w9", "e1", []), timeout=60)
    elapsed = time.monotonic() - started
    assert result == PublishResult(0, needs_resync=True, resynced=False)
    assert (
        elapsed >= STUCK_SNAPSHOT_TIMEOUT_S * 0.9
    )  # it did wait for the snapshot, up to the deadline
    stats = ray.get(index.stats.remote())
    assert stats.snapshot_failures == 2 and stats.workers == {}
    # The index still serves everyone else meanwhile.
    assert ray.get(index.match.remote([b"x"]), timeout=60) == {}


def test_publish_from_an_unregistered_worker_is_not_indexed():
    index = _index("unregistered")
    result = ray.get(index.publish.remote("ghost", "e1", []))
    assert result == PublishResult(0, needs_resync=True, resynced=False)
    assert ray.get(index.stats.remote()).workers == {}


def test_a_restarted_index_resyncs_at_once_from_the_pools_members_not_only_its_first_names():
    """The index was created knowing one name (`p0`); the pool grew since (`p1` serving, `p2`
    leaving, `p3` starting). Restarted, with no publish from anyone, it holds what `p0`, `p1`
    and `p2` cache; `p3` registers itself once ready."""
    index = get_or_create_prefix_index(
        name="from-pool",
        snapshot_timeout_s=SNAPSHOT_TIMEOUT_S,
        worker_names=["p0"],
        pool_name="from-pool-pool",
    )
    names = ("p0", "p1", "p2", "p3")
    workers = {w: StandInWorker.options(name=w).remote(w, index) for w in names}
    states = [MemberState.SERVING, MemberState.SERVING, MemberState.LEAVING, MemberState.STARTING]
    members = [(w, h, s) for (w, h), s in zip(workers.items(), states, strict=True)]
    pool = StandInPool.options(name="from-pool-pool").remote(members)  # kept: alive while held
    for number, worker in enumerate(workers.values()):  # cached, never published
        ray.get(worker.cache_chain.remote([[number, 1], [number, 2]]))
    cached = {w: ray.get(h.cached.remote()) for w, h in workers.items()}

    def pid(_index) -> int:  # run in the actor by `__ray_call__` (a local: shipped by value)
        return os.getpid()

    killed_pid = ray.get(index.__ray_call__.remote(pid))
    ray.kill(index, no_restart=False)

    async def resynced():
        # The first instance's own start-up resync runs late on a loaded machine and can find
        # the pool by then: its stats may read 3 too until the kill lands. Ask the new one.
        try:
            if await index.__ray_call__.remote(pid) == killed_pid:
                return None
            stats = await index.stats.remote()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            return None  # restarting (dead until Ray restarts it, or unavailable meanwhile)
        return stats.startup_resyncs == 3 and stats

    stats = asyncio.run(until(resynced, "the restarted index to resync from the pool"))
    assert stats.registered_workers == names[:3] and stats.snapshot_failures == 0
    for worker_id in names[:3]:
        assert ray.get(index.snapshot_of.remote(worker_id)) == cached[worker_id]
    assert ray.get(index.snapshot_of.remote("p3")) == set()
    del pool
