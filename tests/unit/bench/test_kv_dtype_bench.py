"""`pagedserve bench kv-dtype` on the real model, at a tiny size: the figures are consistent
and each 8-bit cache (int8, fp8) stays close to the float32 one (a wrong scale or code
table would not)."""

from __future__ import annotations

import argparse

from pagedserve.bench.kv_dtype import format_report, measure


def test_int8_and_fp8_caches_against_one_float32_run_on_smollm2():
    args = argparse.Namespace(
        model="smollm2-135m", dtype="float32", kv_dtype=["int8", "fp8"], backend="auto",
        num_prompts=3, max_tokens=4, min_len=24, max_len=48, seed=1, json=False,
    )  # fmt: skip
    results = measure(args)
    assert [r.kv_dtype for r in results] == ["int8", "fp8"]
    for result in results:
        assert result.num_prompts == 3 and result.scored_tokens == 3 * 4
        assert 0 <= result.prompts_agreeing <= 3
        assert 0 <= result.mean_agreeing_prefix <= 4
        assert 0 < result.mean_abs_dlogprob <= result.max_abs_dlogprob < 1.0
        assert result.reference_kv_dtype == "float32" and result.prompt_lens[0] >= 24
        assert "greedy agreement" in format_report(result)
