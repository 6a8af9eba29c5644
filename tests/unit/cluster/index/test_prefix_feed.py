"""The prefix index's change feed (`FeedLog`) and a router's copy fed by it (`PrefixView`)."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cluster.index.feed import (
    Evicted,
    FeedBatch,
    FeedLog,
    Removed,
    Stored,
    WorkerCleared,
    WorkerReplaced,
)
from pagedserve.cluster.index.prefix_index import PrefixIndexState
from pagedserve.cluster.index.view import FeedFollower, PrefixView
from pagedserve.workers.protocol.events import (
    TIER_NAMES,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVSnapshot,
)


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def joined(state: PrefixIndexState, worker: str, hashes=(), epoch: str = "e1") -> None:
    assert state.apply_snapshot(KVSnapshot(worker, epoch, 0, tuple(h(i) for i in hashes)))


def follow(view: PrefixView, state: PrefixIndexState) -> None:
    """What the follower does, in one step: read from the view's cursor and apply."""
    assert view.apply(state.feed.read(view.epoch, view.next_offset))


def assert_mirrors(view: PrefixView, state: PrefixIndexState) -> None:
    view.check_invariants()
    workers = set(state.workers()) | set(view.stats().workers)
    assert {w: view.hashes_of(w) for w in workers} == {w: state.hashes_of(w) for w in workers}
    assert view.stats().entries == state.num_entries()
    for w in workers:  # and each block's tier
        tiers = {b: view.tier_of(w, b) for b in view.hashes_of(w)}
        assert tiers == {b: state.tier_of(w, b) for b in state.hashes_of(w)}


# --------------------------------------------------------------------- the log
def test_offsets_run_contiguously_in_apply_order():
    state = PrefixIndexState()
    joined(state, "w0", [1])
    state.publish("w0", "e1", [BlockStored(0, h(2), h(1), 2), BlockRemoved(1, h(1), 1)])
    state.publish("w0", "e1", [AllCleared(2)])
    state.remove_worker("w0")
    batch = state.feed.read(state.feed.epoch, 0)
    assert batch.dump is None and batch.next_offset == 5
    assert batch.entries == (
        WorkerReplaced(0, "w0", frozenset({h(1)})),
        Stored(1, "w0", h(2)),
        Removed(2, "w0", h(1)),
        WorkerCleared(3, "w0"),
        WorkerCleared(4, "w0"),
    )
    assert state.feed.read(state.feed.epoch, 3).entries == batch.entries[3:]
    assert state.feed.read(state.feed.epoch, 5).entries == ()


def test_a_change_that_changes_nothing_is_not_logged():
    state = PrefixIndexState()
    joined(state, "w0", [1])
    state.publish("w0", "e1", [BlockStored(0, h(1), None, 1), BlockRemoved(1, h(9), 9)])
    assert state.feed.next_offset == 1  # only the snapshot
    assert state.remove_worker("nobody") == 0 and state.feed.next_offset == 1


def test_lru_evictions_are_logged_after_the_store_that_caused_them():
    state = PrefixIndexState(max_entries=2)
    joined(state, "w0")
    state.publish("w0", "e1", [BlockStored(i, h(i), None, i) for i in range(3)])
    entries = state.feed.read(state.feed.epoch, 1).entries
    assert entries == (
        Stored(1, "w0", h(0)),
        Stored(2, "w0", h(1)),
        Stored(3, "w0", h(2)),
        Evicted(4, h(0)),
    )


def test_a_snapshot_over_the_bound_logs_what_it_left():
    state = PrefixIndexState(max_entries=2)
    joined(state, "w1", [7])
    joined(state, "w0", [1, 2, 3])
    entries = state.feed.read(state.feed.epoch, 1).entries
    assert entries[-1] == WorkerReplaced(entries[-1].offset, "w0", frozenset({h(2), h(3)}))
    assert [e for e in entries if isinstance(e, Evicted)] == [Evicted(1, h(7)), Evicted(2, h(1))]


def test_a_cursor_too_old_or_ahead_or_of_another_epoch_gets_a_dump():
    state = PrefixIndexState(feed_capacity=2)
    joined(state, "w0", [1])
    state.publish("w0", "e1", [BlockStored(i, h(10 + i), None, i) for i in range(3)])
    feed = state.feed
    assert feed.first_offset == 2 and feed.next_offset == 4
    expected_dump = {"w0": frozenset({h(1), h(10), h(11), h(12)})}
    for epoch, cursor in ((feed.epoch, 1), (feed.epoch, 5), ("another", 3), (None, 0)):
        batch = feed.read(epoch, cursor)
        assert batch == FeedBatch(feed.epoch, 4, (), expected_dump, {"w0": {}}), (epoch, cursor)
    assert [e.offset for e in feed.read(feed.epoch, 2).entries] == [2, 3]


def test_every_append_calls_the_listener():
    calls = []
    log = FeedLog(dict, capacity=4, on_append=lambda: calls.append(1))
    log.append(Stored, "w0", h(1))
    log.append(Evicted, h(1))
    assert len(calls) == 2 and log.read(log.epoch, 0).entries == (
        Stored(0, "w0", h(1)),
        Evicted(1, h(1)),
    )


def test_each_feed_log_is_its_own_epoch():
    assert FeedLog(dict).epoch != FeedLog(dict).epoch


# -------------------------------------------------------------------- the view
def test_a_new_view_resets_from_the_dump_then_follows_entries():
    state = PrefixIndexState()
    joined(state, "w0", [1, 2])
    view = PrefixView()
    follow(view, state)
    assert view.resets == 1 and view.epoch == state.feed.epoch
    assert view.match([h(1), h(2), h(3)]) == {"w0": 2}
    state.publish("w0", "e1", [BlockStored(0, h(3), h(2), 3)])
    follow(view, state)
    assert view.resets == 1 and view.entries_applied == 1
    assert view.match([h(1), h(2), h(3)]) == {"w0": 3}
    assert_mirrors(view, state)


def test_a_batch_read_twice_changes_nothing():
    state = PrefixIndexState()
    view = PrefixView()
    follow(view, state)
    joined(state, "w0", [1])
    batch = state.feed.read(view.epoch, view.next_offset)
    assert view.apply(batch) and view.apply(batch)
    assert view.entries_applied == 1 and view.hashes_of("w0") == {h(1)}


def test_a_gap_marks_the_view_for_a_reset_and_the_next_read_is_a_dump():
    state = PrefixIndexState()
    view = PrefixView()
    follow(view, state)
    joined(state, "w0", [1])
    joined(state, "w1", [2])
    batch = state.feed.read(view.epoch, 0)
    skipping = FeedBatch(batch.epoch, batch.next_offset, batch.entries[1:])
    assert not view.apply(skipping)
    assert view.epoch is None and view.hashes_of("w1") == set()  # nothing of it applied
    follow(view, state)
    assert view.resets == 2
    assert_mirrors(view, state)


def test_a_restarted_index_resets_the_view():
    before = PrefixIndexState()
    joined(before, "w0", [1, 2])
    view = PrefixView()
    follow(view, before)
    restarted = PrefixIndexState()  # a new incarnation: a new feed epoch
    joined(restarted, "w1", [5])
    assert not view.apply(FeedBatch(restarted.feed.epoch, 1, ()))  # entries of another epoch
    follow(view, restarted)
    assert view.resets == 2 and view.hashes_of("w0") == set()
    assert view.match([h(5)]) == {"w1": 1}
    assert_mirrors(view, restarted)


def test_dropping_a_worker_from_the_view_is_immediate():
    state = PrefixIndexState()
    joined(state, "w0", [1, 2])
    joined(state, "w1", [1])
    view = PrefixView()
    follow(view, state)
    view.drop_worker("w0")
    assert view.match([h(1), h(2)]) == {"w1": 1}
    state.remove_worker("w0")  # the index's own removal, through the feed, agrees
    follow(view, state)
    assert_mirrors(view, state)


def random_history(state: PrefixIndexState, rng: random.Random, steps: int) -> None:
    """Snapshots, stores, removals, clears, drops, restarts over three workers and 12 hashes."""
    seqs: dict[str, int] = {}
    epochs: dict[str, str] = {}
    for _ in range(steps):
        worker = rng.choice(["w0", "w1", "w2"])
        action = rng.random()
        if worker not in seqs or action < 0.05:
            epochs[worker] = f"e{rng.randrange(1_000_000)}"
            hashes = tuple({h(rng.randrange(12)): 0 for _ in range(rng.randrange(6))})
            tiers = tuple(rng.choice(TIER_NAMES) for _ in hashes)
            seqs[worker] = 0
            state.apply_snapshot(KVSnapshot(worker, epochs[worker], 0, hashes, tiers))
            continue
        if action < 0.1:
            state.remove_worker(worker)
            del seqs[worker]
            continue
        seq = seqs[worker]
        if action < 0.15:
            event = AllCleared(seq)
        elif action < 0.55:
            event = BlockRemoved(seq, h(rng.randrange(12)), 0)
        else:
            tier = rng.choice(TIER_NAMES)  # stored anew, or moved to another tier
            event = BlockStored(seq, h(rng.randrange(12)), None, 0, tier=tier)
        state.publish(worker, epochs[worker], [event])
        seqs[worker] = seq + 1


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_entries=st.integers(1, 16),
    feed_capacity=st.integers(1, 32),
    read_every=st.integers(1, 40),
)
def test_the_view_matches_as_the_index_does_on_random_histories(
    seed, max_entries, feed_capacity, read_every
):
    """Whatever the history (LRU evictions, a log too short, restarts, blocks moving between
    tiers), a view that follows the feed holds the index's entries with their tiers and
    matches every prompt as the index does."""
    rng = random.Random(seed)
    state = PrefixIndexState(max_entries=max_entries, feed_capacity=feed_capacity)
    view = PrefixView()
    for _ in range(4):
        random_history(state, rng, read_every)
        follow(view, state)
        assert_mirrors(view, state)
        for _ in range(5):
            prompt = [h(rng.randrange(12)) for _ in range(rng.randrange(1, 6))]
            assert view.match(prompt) == state.match(prompt)


# ---------------------------------------------------------------- the follower
class _Remote:
    def __init__(self, method):
        self.remote = method


class FakeIndex:
    """An index actor's `read_feed` over a state, in process; `down` makes every read fail."""

    def __init__(self, state: PrefixIndexState) -> None:
        self.state = state
        self.down = False
        self.read_feed = _Remote(self._read_feed)

    async def _read_feed(self, epoch, cursor, wait_s):
        if self.down:
            raise ConnectionError("the index is down")
        return self.state.feed.read(epoch, cursor)


def test_an_unreachable_index_leaves_the_last_view_and_is_counted():
    state = PrefixIndexState()
    joined(state, "w0", [1])
    index = FakeIndex(state)
    view = PrefixView()
    errors = []
    follower = FeedFollower(
        view, index, 1.0, on_error=lambda: errors.append(1), lost_errors=(ConnectionError,)
    )

    async def main():
        assert await follower.read_once(0)
        index.down = True
        assert not await follower.read_once(0)
        return view.match([h(1)])

    assert asyncio.run(main()) == {"w0": 1} and errors == [1]
