"""The disk tier: cached KV blocks in a directory, bounded bytes, surviving a restart.

    engine thread                                   writer thread (one per tier)
    put(hash, key, kv) ─ entry (pending: kv) ─queue─▶ write <hex>.kvb.tmp, rename to <hex>.kvb,
    evict LRU ─ entry dropped ─────────────────queue─▶ unlink <hex>.kvb           entry.pending=None
    get(hash, key) ─ pending kv, else read the file and check its checksum

The engine thread owns the index (`hash → entry`, LRU order) and every decision; the writer
thread only does the file operations, in the order they were queued, so a write and a later
delete of the same block never race. No engine step waits on the disk for a write: a put only
queues, and when the queued writes already hold `max_pending_bytes` the block is dropped instead
(counted in `dropped_blocks`). A write that fails (disk full) is logged and its entry dropped
at the next `reap_failed`.

At start the directory is scanned: every `*.kvb` whose header checks out against this pool's
layout is indexed (LRU order by modification time); anything else is logged and removed, and
leftover `*.tmp` files of an interrupted write are removed. A lock file keeps two engines off
one directory (each cluster worker gets its own subdirectory).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from pagedserve.workers.kv.tier_file import (
    SUFFIX,
    BlockHeader,
    CorruptBlockFile,
    KVLayout,
    encode_block,
    file_name,
    read_block,
    read_header,
)
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey
from pagedserve.workers.protocol.events import KVTier

logger = logging.getLogger(__name__)
LOCK_FILE = "pagedserve-kv-tier.lock"
DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024


class DiskTierError(ValueError):
    """The disk tier cannot use its directory (not writable, or another engine holds it)."""


@dataclass(slots=True)
class DiskEntry:
    key: BlockKey
    num_bytes: int  # the file's size
    pending: Tensor | None  # the KV until the writer has written it
    header: BlockHeader | None = None  # once known (scanned at start, or read back)
    failed: bool = False  # the write failed: the entry goes at the next `reap_failed`


class DiskTier:
    """An LRU directory of block files holding at most `capacity_bytes`.

    Args:
        directory: the tier's own directory (created if missing).
        capacity_bytes: bytes of files it may hold.
        layout: the pool's block layout; files of another layout are not loaded.
        max_pending_bytes: KV queued for writing at most; beyond it new blocks are dropped.
    """

    name = KVTier.DISK

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        layout: KVLayout,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock_file = _claim(self.directory)
        self._entries: OrderedDict[BlockHash, DiskEntry] = OrderedDict()
        self._num_bytes = 0
        self._pending_bytes = 0
        self._guard = threading.Lock()  # pending/failed fields and the pending byte count
        self.dropped_blocks = 0
        self.corrupt_skipped = 0
        self.bytes_written = 0
        self._ops: queue.Queue = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._closed = False
        self._writer.start()

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def holds(self, block_hash: BlockHash, key: BlockKey) -> bool:
        entry = self._entries.get(block_hash)
        return entry is not None and not entry.failed and entry.key == key

    def items(self) -> list[tuple[BlockHash, BlockKey]]:
        """(hash, key) of every entry, oldest first."""
        return [(block_hash, entry.key) for block_hash, entry in self._entries.items()]

    def file_path(self, block_hash: BlockHash) -> Path:
        return self.directory / file_name(block_hash)

    # ---------------------------------------------------------------- changes
    def put(self, block_hash: BlockHash, key: BlockKey, kv: Tensor) -> list[BlockHash] | None:
        """Queue a block for writing (most recently used).

        Returns:
            The hashes evicted (LRU) to make room, or None when the block was dropped: the
            write queue is full, or one block is larger than the whole tier.
        """
        if self._closed:
            return None
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        data = encode_block(block_hash, key, kv, self.layout)
        if len(data) > self.capacity_bytes:
            self.dropped_blocks += 1
            return None
        with self._guard:
            if self._pending_bytes + len(data) > self.max_pending_bytes:
                self.dropped_blocks += 1
                return None
            self._pending_bytes += len(data)
        evicted = self._evict_for(len(data))
        entry = self._entries[block_hash] = DiskEntry(key, len(data), pending=kv)
        self._num_bytes += len(data)
        self._ops.put(("write", block_hash, (entry, data)))
        return evicted

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)

    def get(self, block_hash: BlockHash, key: BlockKey) -> Tensor | None:
        """The block's KV if held with exactly `key` and intact; a hit becomes most recently
        used. A corrupt file is logged and dropped (the caller sees a miss)."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.failed or entry.key != key:
            return None
        with self._guard:
            pending = entry.pending
        if pending is not None:
            self._entries.move_to_end(block_hash)
            return pending
        path = self.file_path(block_hash)
        try:
            header = entry.header or read_header(path, self.layout)
            kv = read_block(path, header, self.layout)
        except CorruptBlockFile as error:
            logger.warning("disk KV tier: skipping a corrupt block: %s", error)
            self.corrupt_skipped += 1
            self.discard(block_hash)
            return None
        entry.header = header
        self._entries.move_to_end(block_hash)
        return kv

    def discard(self, block_hash: BlockHash) -> bool:
        """Drop one entry and queue its file's removal; False if it was not held."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self._num_bytes -= entry.num_bytes
        self._ops.put(("delete", block_hash, None))
        return True

    def reap_failed(self) -> list[BlockHash]:
        """Drop the entries whose write failed; their hashes."""
        with self._guard:
            failed = [h for h, entry in self._entries.items() if entry.failed]
        for block_hash in failed:
            self.discard(block_hash)
        return failed

    def clear(self) -> None:
        for block_hash in list(self._entries):
            self.discard(block_hash)

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests, shutdown)."""
        self._ops.join()

    def close(self) -> None:
        """Finish the queued file operations, stop the writer and release the directory.

        The files stay for the next engine on the directory; this tier's index is emptied, as
        it no longer owns them."""
        if self._closed:
            return
        self._closed = True
        self._ops.put(("stop", b"", None))
        self._writer.join()
        self._entries.clear()
        self._num_bytes = 0
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()

    # -------------------------------------------------------------- internals
    def _evict_for(self, num_bytes: int) -> list[BlockHash]:
        evicted = []
        while self._entries and self._num_bytes + num_bytes > self.capacity_bytes:
            block_hash = next(iter(self._entries))
            self.discard(block_hash)
            evicted.append(block_hash)
        return evicted

    def _scan(self) -> None:
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob("*" + SUFFIX):
            try:
                header = read_header(path, self.layout)
                found.append((path.stat().st_mtime_ns, path.name, header))
            except (CorruptBlockFile, OSError) as error:
                logger.warning("disk KV tier: removing an unusable file: %s", error)
                self.corrupt_skipped += 1
                path.unlink(missing_ok=True)
        for _, _, header in sorted(found, key=lambda item: item[:2]):  # oldest first
            size = header.payload_offset + header.payload_bytes
            self._evict_for(size)
            self._entries[header.block_hash] = DiskEntry(header.key, size, None, header)
            self._num_bytes += size

    def _write_loop(self) -> None:
        while True:
            op, block_hash, data = self._ops.get()
            try:
                if op == "stop":
                    return
                if op == "write":
                    self._write(block_hash, *data)
                else:
                    self.file_path(block_hash).unlink(missing_ok=True)
            except OSError:
                logger.exception("disk KV tier: %s of a block file failed", op)
            finally:
                self._ops.task_done()

    def _write(self, block_hash: BlockHash, entry: DiskEntry, data: bytes) -> None:
        """Write one file (a temporary file, then a rename: no reader sees half a file); the
        entry, possibly dropped from the index meanwhile, learns the outcome."""
        path = self.file_path(block_hash)
        temporary = path.with_name(path.name + ".tmp")
        failed = False
        try:
            with temporary.open("wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:
            logger.warning("disk KV tier: writing %s failed: %s", path.name, error)
            temporary.unlink(missing_ok=True)
            failed = True
        with self._guard:
            self._pending_bytes -= len(data)
            entry.pending = None
            entry.failed = failed
            if not failed:
                self.bytes_written += len(data)


def _claim(directory: Path):
    """Create the directory, check it is writable and lock it for this engine alone."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock_file = (directory / LOCK_FILE).open("a+")
    except OSError as error:
        message = f"kv_disk_tier_dir {str(directory)!r} is not writable: {error}"
        raise DiskTierError(message) from error
    if not os.access(directory, os.W_OK | os.X_OK):
        lock_file.close()
        raise DiskTierError(f"kv_disk_tier_dir {str(directory)!r} is not writable")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        lock_file.close()
        raise DiskTierError(
            f"kv_disk_tier_dir {str(directory)!r} is in use by another engine"
        ) from error
    return lock_file
