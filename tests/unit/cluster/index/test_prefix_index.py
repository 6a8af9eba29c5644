"""PrefixIndexState: ordering, resync, worker removal, prefix matching and the LRU bound."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cluster.index.prefix_index import PrefixIndexState, PublishResult
from pagedserve.cluster.index.stats import IndexStats
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.protocol.blocks import BlockKey
from pagedserve.workers.protocol.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVSnapshot,
)


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def stored(seq: int, i: int) -> BlockStored:
    return BlockStored(seq, h(i), None, block_id=i)


def removed(seq: int, i: int) -> BlockRemoved:
    return BlockRemoved(seq, h(i), block_id=i)


def joined(
    state: PrefixIndexState, worker: str, epoch: str = "e1", hashes=(), next_seq: int = 0
) -> None:
    """Introduce a worker the only way the index accepts: a snapshot."""
    assert state.apply_snapshot(KVSnapshot(worker, epoch, next_seq, tuple(h(i) for i in hashes)))


# ----------------------------------------------------------------- event ordering
def test_unknown_worker_needs_a_snapshot_first():
    state = PrefixIndexState()
    assert state.publish("w0", "e1", [stored(0, 1)]) == PublishResult(0, True)
    assert state.num_entries() == 0 and state.workers() == []
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(0, 1)]) == PublishResult(1, False)
    assert state.holders(h(1)) == {"w0"}


def test_in_order_batches_apply():
    state = PrefixIndexState()
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(0, 1), stored(1, 2)]).applied == 2
    assert state.publish("w0", "e1", [removed(2, 1), stored(3, 3)]).applied == 2
    assert state.publish("w0", "e1", []) == PublishResult(0, False)
    assert state.hashes_of("w0") == {h(2), h(3)}
    assert state.num_entries() == 2
    state.check_invariants()


def test_duplicate_batches_are_ignored_and_overlaps_apply_the_new_part():
    state = PrefixIndexState()
    joined(state, "w0")
    batch = [stored(0, 1), stored(1, 2)]
    state.publish("w0", "e1", batch)
    assert state.publish("w0", "e1", batch) == PublishResult(0, False)
    # seq 1 again, then new seq 2: only the removal applies.
    assert state.publish("w0", "e1", [stored(1, 2), removed(2, 2)]) == PublishResult(1, False)
    assert state.hashes_of("w0") == {h(1)}
    assert state.stats().duplicates_ignored == 3


def test_gap_refuses_the_batch_whole_keeps_entries_and_waits_for_a_snapshot():
    state = PrefixIndexState()
    joined(state, "w0")
    state.publish("w0", "e1", [stored(0, 1)])
    # seq 1 and 2 were lost.
    assert state.publish("w0", "e1", [stored(3, 4), stored(4, 5)]) == PublishResult(0, True)
    assert state.hashes_of("w0") == {h(1)}  # kept as a routing hint while stale
    assert state.is_stale("w0")
    assert state.match([h(1)]) == {"w0": 1}
    # Even a batch that would have continued is refused until the snapshot arrives.
    assert state.publish("w0", "e1", [stored(1, 2)]) == PublishResult(0, True)
    joined(state, "w0", hashes=[1, 4, 5], next_seq=5)
    assert not state.is_stale("w0")
    assert state.publish("w0", "e1", [stored(3, 4), removed(5, 1)]) == PublishResult(1, False)
    assert state.hashes_of("w0") == {h(4), h(5)}
    assert state.stats().gaps_detected == 1


def test_a_hole_inside_a_batch_is_a_gap_and_nothing_of_it_applies():
    state = PrefixIndexState()
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(0, 1), stored(2, 2)]).needs_resync
    assert state.hashes_of("w0") == set()
    assert state.stats().events_applied == 0


def test_events_out_of_order_are_a_gap():
    state = PrefixIndexState()
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(1, 2), stored(0, 1)]).needs_resync


def test_next_seq_catches_a_lost_last_batch_with_an_empty_heartbeat():
    state = PrefixIndexState()
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(0, 1)], next_seq=1) == PublishResult(1, False)
    # [stored(1, 2)] was lost and nothing followed: without next_seq nothing could tell.
    assert state.publish("w0", "e1", []) == PublishResult(0, False)
    assert state.publish("w0", "e1", [], next_seq=2) == PublishResult(0, True)
    assert state.is_stale("w0")


def test_next_seq_must_agree_with_the_batch_but_old_duplicates_pass():
    state = PrefixIndexState()
    joined(state, "w0")
    assert state.publish("w0", "e1", [stored(0, 1), stored(1, 2)], next_seq=2).applied == 2
    assert state.publish("w0", "e1", [stored(0, 1)], next_seq=1) == PublishResult(0, False)
    assert state.publish("w0", "e1", [stored(2, 3)], next_seq=5).needs_resync


def test_new_epoch_drops_the_old_incarnation_at_once():
    state = PrefixIndexState()
    joined(state, "w0", hashes=[1, 2], next_seq=2)
    joined(state, "w1", hashes=[1])
    # The restarted process numbers from 0 again; its cache is empty.
    assert state.publish("w0", "e2", [stored(0, 7)]) == PublishResult(0, True)
    assert state.workers() == ["w1"]
    assert state.holders(h(1)) == {"w1"} and state.holders(h(2)) == set()
    joined(state, "w0", epoch="e2")
    assert state.publish("w0", "e2", [stored(0, 7)]) == PublishResult(1, False)
    # A late batch from the dead incarnation is not applied either.
    assert state.publish("w0", "e1", [stored(2, 3)]).needs_resync
    assert state.stats().restarts_detected == 2
    state.check_invariants()


def test_all_cleared_drops_only_that_worker():
    state = PrefixIndexState()
    joined(state, "w0", hashes=[1, 2])
    joined(state, "w1", hashes=[2])
    assert state.publish("w0", "e1", [AllCleared(0)]).applied == 1
    assert state.hashes_of("w0") == set()
    assert state.holders(h(2)) == {"w1"} and state.num_entries() == 1
    assert state.workers() == ["w0", "w1"]


def test_not_an_event_is_refused():
    state = PrefixIndexState()
    joined(state, "w0")

    @dataclass(frozen=True)
    class Bogus:
        seq: int

    with pytest.raises(TypeError, match="not a KV event"):
        state.publish("w0", "e1", [Bogus(0)])


# ----------------------------------------------------------------- snapshots, removal
def test_apply_snapshot_replaces_everything_about_the_worker():
    state = PrefixIndexState()
    joined(state, "w0", hashes=[1, 2, 3], next_seq=3)
    joined(state, "w1", hashes=[3])
    assert state.apply_snapshot(KVSnapshot("w0", "e1", 10, (h(3), h(4))))
    assert state.hashes_of("w0") == {h(3), h(4)}
    assert state.holders(h(3)) == {"w0", "w1"}
    assert state.holders(h(1)) == set() and state.num_entries() == 2
    assert state.publish("w0", "e1", [stored(9, 5)]) == PublishResult(0, False)  # duplicate
    assert state.publish("w0", "e1", [stored(10, 5)]) == PublishResult(1, False)
    state.check_invariants()


def test_a_late_older_snapshot_of_the_same_epoch_is_ignored():
    state = PrefixIndexState()
    joined(state, "w0", hashes=[1], next_seq=5)
    state.publish("w0", "e1", [stored(5, 2)])
    assert not state.apply_snapshot(KVSnapshot("w0", "e1", 4, ()))
    assert state.hashes_of("w0") == {h(1), h(2)}
    # Another epoch is always taken: a restart is never "older".
    assert state.apply_snapshot(KVSnapshot("w0", "e2", 0, ()))
    assert state.hashes_of("w0") == set()


def test_snapshot_with_negative_next_seq_is_refused():
    with pytest.raises(ValueError, match="next_seq"):
        PrefixIndexState().apply_snapshot(KVSnapshot("w0", "e1", -1, ()))


def test_remove_worker_drops_all_its_entries_at_once():
    state = PrefixIndexState()
    joined(state, "w0", hashes=[1, 2, 3])
    joined(state, "w1", hashes=[1])
    assert state.match([h(1), h(2)]) == {"w0": 2, "w1": 1}
    assert state.remove_worker("w0") == 3
    assert state.match([h(1), h(2)]) == {"w1": 1}
    assert state.workers() == ["w1"] and state.num_entries() == 1
    assert state.remove_worker("w0") == 0
    # A removed worker must resync before it is indexed again.
    assert state.publish("w0", "e1", [stored(0, 9)]).needs_resync
    state.check_invariants()


# ----------------------------------------------------------------- match
def test_match_counts_leading_blocks_only_per_worker():
    state = PrefixIndexState()
    joined(state, "a", hashes=[0, 1, 2, 3])
    joined(state, "b", hashes=[0, 2, 3])  # hole at 1: its prefix is 1 block
    joined(state, "c", hashes=[1, 2, 3])  # lacks the first block: no prefix
    joined(state, "d", hashes=[0, 1])
    query = [h(0), h(1), h(2), h(3)]
    assert state.match(query) == {"a": 4, "b": 1, "d": 2}
    assert state.match([h(1), h(2)]) == {"a": 2, "c": 2, "d": 1}
    assert state.match([h(9), h(0)]) == {}
    assert state.match([]) == {}
    # Extra blocks past what anyone holds do not matter.
    assert state.match([*query, h(7), h(8)]) == {"a": 4, "b": 1, "d": 2}


# ----------------------------------------------------------------- LRU bound
def test_lru_evicts_the_least_recently_used_entry():
    state = PrefixIndexState(max_entries=3)
    joined(state, "w0", hashes=[0, 1, 2], next_seq=0)  # recency: 0, 1, 2
    assert state.match([h(0)]) == {"w0": 1}  # recency: 1, 2, 0
    state.publish("w0", "e1", [stored(0, 3)])  # evicts 1
    assert state.hashes_of("w0") == {h(0), h(2), h(3)}
    joined(state, "w1", hashes=[2], next_seq=0)  # a store refreshes 2: recency 0, 3, 2
    state.publish("w1", "e1", [stored(0, 4)])  # evicts 0
    assert {b for b in map(h, range(5)) if state.holders(b)} == {h(2), h(3), h(4)}
    # Removing an evicted hash is harmless.
    assert state.publish("w0", "e1", [removed(1, 1), removed(2, 0)]).applied == 2
    assert state.stats().evictions == 2
    state.check_invariants()


def test_lru_a_match_miss_does_not_refresh():
    state = PrefixIndexState(max_entries=2)
    joined(state, "a", hashes=[0])
    joined(state, "b", hashes=[1])  # recency: 0, 1
    assert state.match([h(9), h(0)]) == {}  # stops at the miss, 0 not refreshed
    joined(state, "c", hashes=[2])
    assert state.holders(h(0)) == set() and state.holders(h(1)) == {"b"}


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndexState(max_entries=0)


# ----------------------------------------------------------------- stats
def test_stats_counts_everything():
    state = PrefixIndexState(max_entries=2)
    joined(state, "w0")
    state.publish("w0", "e1", [stored(0, 1), stored(1, 2), stored(2, 3)])  # 1 eviction
    state.publish("w0", "e1", [stored(2, 3)])  # duplicate
    state.publish("w0", "e1", [stored(5, 4)])  # gap
    assert state.stats() == IndexStats(
        entries=2,
        max_entries=2,
        workers={"w0": 2},
        stale_workers=("w0",),
        resyncs=1,
        gaps_detected=1,
        restarts_detected=0,
        evictions=1,
        events_applied=3,
        duplicates_ignored=1,
    )


# ----------------------------------------------------------------- a real pool
def _snapshot(pool: BlockPool, worker: str, epoch: str) -> KVSnapshot:
    return KVSnapshot(worker, epoch, pool.next_event_seq, tuple(pool.cached))


def test_index_agrees_with_a_real_block_pool_across_a_lost_batch():
    pool = BlockPool(4)
    state = PrefixIndexState()
    state.apply_snapshot(_snapshot(pool, "w0", "e1"))
    parent = None
    for tokens in ([1, 2], [3, 4], [5, 6]):
        (block,) = pool.get_new_blocks(1)
        key = BlockKey(parent, tuple(tokens), ())
        parent = block_hash(parent, tokens)
        pool.cache_full_block(block, parent, key)
        pool.free_blocks([block])
    assert state.publish("w0", "e1", pool.take_events()).applied == 3
    assert state.hashes_of("w0") == set(pool.cached)
    pool.free_blocks(pool.get_new_blocks(4))  # evicts all three cached blocks
    lost = pool.take_events()
    assert len(lost) == 3
    pool.reset_prefix_cache()
    result = state.publish("w0", "e1", pool.take_events())
    assert result.needs_resync
    assert state.apply_snapshot(_snapshot(pool, "w0", "e1"))
    assert state.hashes_of("w0") == set(pool.cached) == set()
    assert state.publish("w0", "e1", lost) == PublishResult(0, False)  # late: duplicates


# ----------------------------------------------------------------- random streams
@dataclass
class FakeWorker:
    """A pool's event stream and what the index should know of it."""

    worker_id: str
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    next_seq: int = 0
    held: set[bytes] = field(default_factory=set)
    pending: list[KVEvent] = field(default_factory=list)
    indexed: set[bytes] = field(default_factory=set)  # what the index should now believe

    def emit(self, op: str, key: int) -> None:
        if op == "store" and h(key) not in self.held:
            self.held.add(h(key))
            self.pending.append(BlockStored(self.next_seq, h(key), None, key))
        elif op == "remove" and h(key) in self.held:
            self.held.discard(h(key))
            self.pending.append(BlockRemoved(self.next_seq, h(key), key))
        elif op == "clear":
            self.held.clear()
            self.pending.append(AllCleared(self.next_seq))
        else:
            return
        self.next_seq += 1

    def restart(self) -> None:
        self.epoch, self.next_seq, self.pending = uuid.uuid4().hex, 0, []
        self.held = set()

    def flush(self, state: PrefixIndexState, lose: bool) -> None:
        """Publish pending events (or lose them), resyncing as the actor does."""
        events, self.pending = self.pending, []
        if lose:
            return
        if state.publish(self.worker_id, self.epoch, events, self.next_seq).needs_resync:
            snapshot = KVSnapshot(self.worker_id, self.epoch, self.next_seq, tuple(self.held))
            assert state.apply_snapshot(snapshot)
        self.indexed = set(self.held)


KEYS = st.integers(0, 5)
# Weighted so that losses, restarts and deaths land between stores on the same worker often.
OP_NAMES = ["store"] * 3 + ["remove", "clear", "flush", "flush", "lose", "restart", "dead"]
OPS = st.tuples(
    st.sampled_from([*OP_NAMES, "match"]), st.integers(0, 1), KEYS, st.lists(KEYS, max_size=4)
)


def _expected_match(workers: list[FakeWorker], query: list[bytes]) -> dict[str, int]:
    expected = {}
    for worker in workers:
        depth = 0
        while depth < len(query) and query[depth] in worker.indexed:
            depth += 1
        if depth:
            expected[worker.worker_id] = depth
    return expected


def _run(ops, max_entries: int) -> tuple[PrefixIndexState, list[FakeWorker]]:
    state = PrefixIndexState(max_entries=max_entries)
    workers = [FakeWorker("w0"), FakeWorker("w1")]
    bounded = max_entries < len(workers) * 6
    for op, index, key, query in ops:
        worker = workers[index]
        if op == "match":
            got = state.match([h(k) for k in query])
            if not bounded:
                assert got == _expected_match(workers, [h(k) for k in query])
        elif op in ("flush", "lose"):
            worker.flush(state, lose=op == "lose")
        elif op == "restart":
            worker.restart()
        elif op == "dead":
            state.remove_worker(worker.worker_id)
            worker.indexed = set()
        else:
            worker.emit(op, key)
        state.check_invariants()
        for w in workers:
            indexed = state.hashes_of(w.worker_id)
            assert indexed == w.indexed if not bounded else indexed <= w.indexed
    return state, workers


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=20, max_size=80))
def test_random_streams_keep_the_index_exactly_in_step(ops):
    _run(ops, max_entries=1_000)


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=20, max_size=80), st.integers(1, 4))
def test_random_streams_never_exceed_the_lru_bound(ops, max_entries):
    state, _ = _run(ops, max_entries=max_entries)
    assert state.num_entries() <= max_entries
