"""`pagedserve bench structured` on tiny-llama, small: both arms run, the mask timer measures
the schema arm's steps only and puts the sampler's function back, compile times are reported."""

from __future__ import annotations

import argparse

from pagedserve.bench import structured
from pagedserve.workers.sampling import sampler


def test_bench_structured_small():
    original = sampler.apply_token_constraints
    args = argparse.Namespace(model="tiny-llama", batch=1, max_tokens=320, repeats=1, json=None)
    data = structured.bench(args)
    assert sampler.apply_token_constraints is original
    free, schema = data["arms"]["free"], data["arms"]["schema"]
    assert free["tokens_per_s"] > 0 and schema["tokens_per_s"] > 0
    assert schema["mask_ms_per_step"] > 0
    assert schema["valid_json"] == 1, "320 tokens hold the schema's longest document"
    assert data["compile"]["new_ms"] > 0 and data["compile"]["cached_ms"] >= 0
    text = structured.format_text(data)
    assert "tok/s" in text and "compile: new schema" in text
