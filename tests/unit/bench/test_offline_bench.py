"""Smoke test for `pagedserve bench offline` (pagedserve.bench.offline), run through the CLI."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.offline import default_num_kv_blocks, make_prompts
from pagedserve.cli import main

TINY_WORKLOAD = ["--num-prompts", "4", "--max-tokens", "4", "--min-len", "8", "--max-len", "40"]


def test_tiny_run_writes_json_and_summary(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    argv = ["bench", "offline", *TINY_WORKLOAD, "--hf-batch-size", "2", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "CONSTRUCTED" in out and "ratio ours/HF" in out

    report = json.loads(path.read_text())
    assert report["config"]["num_prompts"] == 4
    assert report["workload"]["lengths_constructed"] is True
    assert all(8 <= n <= 40 for n in report["prompt_lens"])
    for side in ("ours", "hf"):
        assert report[side]["generated_tokens"] == 4 * 4
        assert report[side]["tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["ours"]["tokens_per_s"] / report["hf"]["tokens_per_s"]
    )
    kv = report["kv"]
    assert 0 < kv["step_weighted"] <= 1 and 0 < kv["time_weighted"] <= 1
    assert kv["num_samples"] > 0 and kv["peak_running_seqs"] == 4
    agreement = report["agreement"]
    assert agreement["num_prompts"] == 4 and 0 <= agreement["fraction_equal"] <= 1


def test_prompts_are_reproducible_and_skip_special_ids() -> None:
    first = make_prompts(50, 16, 256, vocab_size=259, excluded_ids=frozenset({256, 257, 258}))
    again = make_prompts(50, 16, 256, vocab_size=259, excluded_ids=frozenset({256, 257, 258}))
    assert first == again
    assert all(16 <= len(p) <= 256 and max(p) < 256 for p in first)


def test_default_pool_holds_every_sequence_at_full_length() -> None:
    # (20 + 4) -> 2 blocks of 16, (40 + 4) -> 3 blocks; plus 1% watermark and one spare.
    assert default_num_kv_blocks([20, 40], 4, 16, "paged", max_len=2048) == 7
    assert default_num_kv_blocks([20, 40], 4, 16, "reserve-max", max_len=2048) == 260
