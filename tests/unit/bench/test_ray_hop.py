"""`bench ray-hop`'s arithmetic and summary (no Ray needed)."""

from __future__ import annotations

import pickle

import pytest

from pagedserve.bench.ray_hop import HopRun, per_message_ms, step_batch, summary_lines


def test_the_idle_floor_over_the_run_is_taken_off_before_dividing():
    # 1.5 CPU-s over 10 s at an idle 0.05 CPU-s a second: 1.0 CPU-s for 500 messages.
    assert per_message_ms(1.5, 0.05, 10.0, 500) == pytest.approx(2.0)


def test_the_message_is_one_token_of_one_request_and_pickles():
    batch = step_batch(7)
    assert [m.token_ids for m in batch.messages] == [[7]]
    assert pickle.loads(pickle.dumps(batch)) == batch


def test_summary_gives_each_transport_s_median_and_spread_at_both_ends():
    runs = [
        HopRun("ray-stream", 10, 1.0, 1.0, 0.9),
        HopRun("ray-stream", 10, 1.0, 1.2, 1.1),
        HopRun("ray-stream", 10, 1.0, 1.1, 1.0),
        HopRun("socket", 10, 1.0, 0.1, 0.2),
    ]
    lines = summary_lines(runs)
    assert lines[1].split() == ["ray-stream", "1.100", "(1.000-1.200)", "1.000", "(0.900-1.100)"]
    assert lines[2].split() == ["socket", "0.100", "(0.100-0.100)", "0.200", "(0.200-0.200)"]
    assert len(lines) == 3  # ray-call had no run: no line
