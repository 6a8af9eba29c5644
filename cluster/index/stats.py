"""What the prefix index reports (`PrefixIndexActor.stats`): kept apart from the actor so the
router's light types can name it without importing Ray actor code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class IndexStats:
    """Entry and worker counts, and the counters since the index (re)started.

    Attributes:
        entries: block hashes held (each with one or more holders).
        max_entries: the LRU bound on `entries`.
        workers: worker id → block hashes the index believes it holds.
        stale_workers: workers with a detected gap, awaiting a snapshot.
        resyncs: snapshots applied.
        gaps_detected: batches refused for a gap in sequence numbers.
        restarts_detected: batches from a new worker epoch (the worker restarted).
        evictions: entries dropped by the LRU bound.
        events_applied: KV events applied.
        duplicates_ignored: events seen twice (sequence number below the expected one).
        registered_workers: (actor) workers whose handle the index holds.
        snapshot_failures: (actor) snapshots that failed or missed their deadline.
        startup_resyncs: (actor) workers resynced when the index (re)started.
    """

    entries: int
    max_entries: int
    workers: dict[str, int] = field(default_factory=dict)
    stale_workers: tuple[str, ...] = ()
    resyncs: int = 0
    gaps_detected: int = 0
    restarts_detected: int = 0
    evictions: int = 0
    events_applied: int = 0
    duplicates_ignored: int = 0
    registered_workers: tuple[str, ...] = ()
    snapshot_failures: int = 0
    startup_resyncs: int = 0
