"""The machine's cores shared among its workers (workers/process/core_share.py): each worker's
share follows how many of them have work, a dead or hung peer gives its cores back, and the
last one out removes the board."""

from __future__ import annotations

import multiprocessing
import os
import struct
import time
from pathlib import Path

import pytest
from support.clock import ManualClock

from pagedserve.workers.process.core_share import (
    BOARD_PREFIX,
    SLOTS,
    STALE_S,
    CoreShare,
    board_path,
    remove_dead_boards,
)


def test_a_worker_alone_with_work_takes_every_core_and_halves_them_beside_a_busy_peer(tmp_path):
    board, clock = tmp_path / "board", ManualClock(1000.0)  # a stamp of 0 reads idle
    a, b = CoreShare(board, 4, clock=clock), CoreShare(board, 4, clock=clock)
    assert a.slot != b.slot
    assert a.threads_for_step() == 4  # b has no work yet
    assert b.threads_for_step() == 2  # a is mid-step
    assert a.threads_for_step() == 2
    b.idle()
    assert a.threads_for_step() == 4
    a.close()
    b.close()


def test_more_busy_workers_than_cores_still_get_a_thread_each(tmp_path):
    board = tmp_path / "board"
    shares = [CoreShare(board, 2) for _ in range(3)]
    assert [share.threads_for_step() for share in shares] == [2, 1, 1]
    for share in shares:
        share.close()


def test_a_hung_peer_stops_counting_after_stale_s(tmp_path):
    board, clock = tmp_path / "board", ManualClock(1000.0)  # a stamp of 0 reads idle
    hung, live = CoreShare(board, 2, clock=clock), CoreShare(board, 2, clock=clock)
    hung.threads_for_step()  # and never again
    assert live.threads_for_step() == 1
    clock.now += STALE_S + 1
    assert live.threads_for_step() == 2
    hung.close()
    live.close()


def _take_a_slot_and_die(board: str) -> None:
    share = CoreShare(Path(board), 2)
    share.threads_for_step()  # busy, then the process ends without closing


def test_a_dead_peer_neither_counts_nor_keeps_its_slot(tmp_path):
    board = tmp_path / "board"
    process = multiprocessing.get_context("spawn").Process(
        target=_take_a_slot_and_die, args=(str(board),)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    live = CoreShare(board, 2)
    assert live.slot == 0  # the dead worker's slot, taken again
    assert live.threads_for_step() == 2
    live.close()
    assert not board.exists()  # the last one out removed it


def test_the_last_worker_out_removes_the_board_and_a_full_board_says_so(tmp_path):
    board = tmp_path / "board"
    shares = [CoreShare(board, 2) for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match=f"{SLOTS} workers already share"):
        CoreShare(board, 2)
    for share in shares[1:]:
        share.close()
    assert board.exists()
    shares[0].close()
    shares[0].close()  # twice is fine
    assert not board.exists()


def test_each_app_and_node_has_its_own_board():
    assert board_path("app", "n1") != board_path("app", "n2") != board_path("other", "n1")
    with pytest.raises(ValueError, match="cores must be >= 1"):
        CoreShare(board_path("app", "n1"), 0)


def test_boards_of_killed_apps_are_removed_once_old_and_ownerless(tmp_path):
    def board_of(name: str, owner: int, age_s: float) -> Path:
        board = tmp_path / f"{BOARD_PREFIX}{name}"
        board.write_bytes(struct.pack("<qd", owner, 0.0) + bytes(16))
        old = time.time() - age_s
        os.utime(board, (old, old))
        return board

    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join(60)
    killed = board_of("killed", dead.pid, STALE_S + 5)
    starting = board_of("starting", 0, 1)  # its first worker may be claiming a slot
    live = board_of("live", os.getpid(), STALE_S + 5)
    assert remove_dead_boards(tmp_path) == [killed]
    assert starting.exists() and live.exists()
