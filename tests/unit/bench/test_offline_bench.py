"""Tests for `pagedserve bench offline`: the workload, the HF accounting, and CLI smoke runs."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.bench.offline_hf import batch_order, run_hf, trim_to_lengths
from pagedserve.bench.offline_report import agreement
from pagedserve.bench.offline_workload import (
    OUTPUT_LEN_DISTRIBUTIONS,
    default_num_kv_blocks,
    make_output_lens,
    make_prompts,
)
from pagedserve.cli import main

TINY_WORKLOAD = ["--num-prompts", "4", "--min-len", "8", "--max-len", "40", "--hf-batch-size", "2"]


# --- workload -----------------------------------------------------------------------------


def test_prompts_are_reproducible_and_skip_special_ids() -> None:
    first = make_prompts(50, 16, 256, vocab_size=259, excluded_ids=frozenset({256, 257, 258}))
    again = make_prompts(50, 16, 256, vocab_size=259, excluded_ids=frozenset({256, 257, 258}))
    assert first == again
    assert all(16 <= len(p) <= 256 and max(p) < 256 for p in first)


@pytest.mark.parametrize("distribution", ["uniform", "lognormal"])
def test_output_lens_are_deterministic_by_seed_and_in_range(distribution: str) -> None:
    first = make_output_lens(200, 8, 128, distribution=distribution, seed=3)
    assert first == make_output_lens(200, 8, 128, distribution=distribution, seed=3)
    assert first != make_output_lens(200, 8, 128, distribution=distribution, seed=4)
    assert all(8 <= n <= 128 for n in first)
    assert len(set(first)) > 10  # they really vary


def test_fixed_output_lens_are_all_max_tokens() -> None:
    assert sorted(OUTPUT_LEN_DISTRIBUTIONS) == ["fixed", "lognormal", "uniform"]
    assert make_output_lens(5, 8, 64, distribution="fixed", seed=1) == [64] * 5


def test_default_pool_holds_every_sequence_at_its_full_length() -> None:
    # (20 + 4) -> 2 blocks of 16, (40 + 30) -> 5 blocks; plus 1% watermark and one spare.
    assert default_num_kv_blocks([20, 40], [4, 30], 16, "paged", max_len=2048) == 9
    assert default_num_kv_blocks([20, 40], [4, 30], 16, "reserve-max", max_len=2048) == 260


# --- HF accounting ------------------------------------------------------------------------


def test_trim_keeps_each_requests_first_max_tokens() -> None:
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert trim_to_lengths(outputs, [2, 4, 1]) == [[1, 2], [5, 6, 7, 8], [9]]
    with pytest.raises(RuntimeError, match="below its 5"):
        trim_to_lengths(outputs, [2, 5, 1])


class _CountingModel:
    """Stands in for an HF model: token j of a row is 1000 * (its prompt length) + j."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (batch rows, max_new_tokens)

    def generate(self, input_ids, attention_mask, max_new_tokens, min_new_tokens, **kwargs):
        assert kwargs["eos_token_id"] is None and min_new_tokens == max_new_tokens
        self.calls.append((input_ids.shape[0], max_new_tokens))
        lens = attention_mask.sum(dim=1, keepdim=True)
        new = 1000 * lens + torch.arange(max_new_tokens)
        return torch.cat([input_ids, new], dim=1)


@pytest.mark.parametrize("sort_by_length", [False, True])
def test_static_batches_run_to_their_longest_target(sort_by_length: bool) -> None:
    prompts = [[7] * n for n in (5, 1, 4, 2)]
    output_lens = [3, 6, 2, 1]
    model = _CountingModel()
    run = run_hf(model, prompts, output_lens, 2, pad_id=0, sort_by_length=sort_by_length)

    # Outputs come back in prompt order, each trimmed to its own target.
    expected = [
        [1000 * len(p) + j for j in range(n)] for p, n in zip(prompts, output_lens, strict=True)
    ]
    assert run.outputs == expected
    if sort_by_length:  # batches (1, 2) and (4, 5): prompts 1, 3 then 2, 0
        assert model.calls == [(2, 6), (2, 3)]
        assert run.generated_tokens == 2 * 6 + 2 * 3
    else:  # batches (5, 1) and (4, 2)
        assert model.calls == [(2, 6), (2, 2)]
        assert run.generated_tokens == 2 * 6 + 2 * 2
    assert run.elapsed_s > 0


def test_batch_order_sorts_stably_by_prompt_length() -> None:
    prompts = [[1] * n for n in (3, 1, 3, 2)]
    assert batch_order(prompts, sort_by_length=False) == [0, 1, 2, 3]
    assert batch_order(prompts, sort_by_length=True) == [1, 3, 0, 2]


def test_agreement_compares_each_request_over_its_own_target() -> None:
    ours = [[1, 2], [5, 6, 7, 8]]
    hf = [[1, 2, 99], [5, 6, 0, 8]]  # row 0 differs only past its target of 2
    result = agreement(ours, hf, [2, 4])
    assert (result.prompts_equal, result.num_prompts) == (1, 2)
    assert result.mean_common_prefix == pytest.approx((2 / 2 + 2 / 4) / 2)


# --- CLI ----------------------------------------------------------------------------------


def _run_cli(tmp_path, extra: list[str]) -> dict:
    path = tmp_path / "r.json"
    assert main(["bench", "offline", *TINY_WORKLOAD, *extra, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def _check_common(report: dict) -> None:
    assert report["config"]["num_prompts"] == 4
    assert report["workload"]["lengths_constructed"] is True
    assert all(8 <= n <= 40 for n in report["prompt_lens"])
    useful = sum(report["output_lens"])
    for side in ("ours", "hf"):
        assert report[side]["useful_tokens"] == useful
        assert report[side]["tokens_per_s"] > 0
    assert report["ours"]["generated_tokens"] == useful
    assert report["ratio"] == pytest.approx(
        report["ours"]["tokens_per_s"] / report["hf"]["tokens_per_s"]
    )
    kv = report["kv"]
    assert 0 < kv["step_weighted"] <= 1 and 0 < kv["time_weighted"] <= 1
    assert kv["num_samples"] > 0 and kv["peak_running_seqs"] == 4
    assert report["agreement"]["num_prompts"] == 4


def test_cli_fixed_output_lens_waste_nothing(tmp_path, capsys) -> None:
    report = _run_cli(tmp_path, ["--output-len-dist", "fixed", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "CONSTRUCTED" in out and "ratio ours/HF" in out and "prompt order" in out
    _check_common(report)
    assert report["output_lens"] == [4] * 4
    assert report["hf"]["generated_tokens"] == 16 and report["hf_waste"] == 0


def test_cli_uniform_output_lens_count_hf_waste(tmp_path, capsys) -> None:
    # min 2: a 1-token request finishes in its prefill step, before the first usage sample.
    extra = ["--min-tokens", "2", "--max-tokens", "8", "--seed", "2", "--hf-sort-by-length"]
    report = _run_cli(tmp_path, extra)
    assert "sorted by prompt length" in capsys.readouterr().out
    _check_common(report)
    lens = report["output_lens"]
    assert all(2 <= n <= 8 for n in lens) and len(set(lens)) > 1
    order = sorted(range(4), key=lambda i: report["prompt_lens"][i])
    batches = [order[:2], order[2:]]
    assert report["hf"]["generated_tokens"] == sum(2 * max(lens[i] for i in b) for b in batches)
    assert report["hf_batching"] == "sorted by prompt length"


def test_cli_rejects_min_tokens_above_max_tokens() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--min-tokens", "9", "--max-tokens", "8"])
