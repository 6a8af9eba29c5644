"""Smoke tests of `pagedserve bench serve`, `bench ablate` and `bench block-sweep` at tiny sizes.

Each command runs once on a workload that includes a request too long for the context, and the
JSON must keep it as a failed record with its reason (failures are never dropped).
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest
import ray

from pagedserve.bench.serve_metrics import (
    RECORD_FIELDS,
    Delta,
    RequestRecord,
    measure,
    summarize,
)
from pagedserve.bench.serve_workload import (
    SEED_LENGTHS,
    WorkloadConfig,
    arrival_times,
    make_workload,
    read_length_file,
)
from pagedserve.cli import main

SUMMARY_FIELDS = (
    "num_requests",
    "completed",
    "failed",
    "failures_by_reason",
    "request_throughput",
    "output_token_throughput",
    "total_token_throughput",
    "goodput",
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
    "queue_time_s",
)


@pytest.fixture
def no_ray():
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# prompt output\n20 4\n48, 6\n3000 4\n")  # 3000 + 4 > context 2048
    return str(path)


# --- workloads and summaries (no Ray) ------------------------------------------------------


def test_workloads_are_seeded_and_labelled():
    for kind in ("uniform", "lognormal", "seed-lengths", "shared-prefix"):
        config = WorkloadConfig(kind=kind, num_requests=10, request_rate=5.0, seed=3)
        workload = make_workload(config)
        assert workload == make_workload(config) and len(workload) == 10
        assert "constructed" in config.describe()
        arrivals = [p.arrival_s for p in workload]
        assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    seeds = make_workload(WorkloadConfig(kind="seed-lengths", num_requests=5))
    assert tuple(len(p.token_ids) for p in seeds) == SEED_LENGTHS


def test_shared_prefix_users_share_their_system_prompt():
    config = WorkloadConfig(
        kind="shared-prefix", num_requests=None, num_system_prompts=2, num_users=3,
        system_prompt_len=10, user_len=4,
    )  # fmt: skip
    workload = make_workload(config)
    assert sorted(p.group for p in workload) == [f"{k}/{m}" for k in range(2) for m in range(3)]
    prefixes = {}
    for p in workload:
        assert prefixes.setdefault(p.group[0], p.token_ids[:10]) == p.token_ids[:10]
    assert prefixes["0"] != prefixes["1"]


def test_gamma_arrivals_keep_the_rate_and_burstiness_spreads_them():
    def gaps(burstiness):
        times = arrival_times(4001, 10.0, burstiness, random.Random(0))
        deltas = [b - a for a, b in zip(times, times[1:], strict=False)]
        mean = sum(deltas) / len(deltas)
        return mean, sum((d - mean) ** 2 for d in deltas) / len(deltas)

    for burstiness in (0.5, 1.0, 4.0):
        mean, var = gaps(burstiness)
        assert mean == pytest.approx(0.1, rel=0.1)
        assert var == pytest.approx(0.01 / burstiness, rel=0.2)  # gamma: CV² = 1 / shape
    assert arrival_times(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def test_length_file_names_a_bad_line(tmp_path, lengths_file):
    assert read_length_file(lengths_file) == [(20, 4), (48, 6), (3000, 4)]
    bad = tmp_path / "bad.txt"
    bad.write_text("10 2\n7\n")
    with pytest.raises(ValueError, match="bad.txt:2"):
        read_length_file(str(bad))


def test_summary_counts_failures_and_goodput():
    fast = RequestRecord(0, 0.0, 10, 3, ttft_s=0.01, tpot_s=0.002, e2e_s=0.02, output_tokens=3)
    slow = RequestRecord(1, 0.1, 10, 3, ttft_s=0.5, tpot_s=0.002, e2e_s=0.6, output_tokens=3)
    for record in (fast, slow):
        record.finish_reason = "length"
    refused = RequestRecord(2, 0.2, 3000, 4, finish_reason="error", error="INVALID_ARGUMENT: x")
    summary = summarize([fast, slow, refused], 1.0, slo_ttft_ms=100)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["failures_by_reason"] == {"INVALID_ARGUMENT": 1}
    assert summary["goodput"] == 1.0 and summary["output_token_throughput"] == 6.0
    assert summary["ttft_s"]["count"] == 2 and summary["ttft_s"]["median"] == pytest.approx(0.255)


def test_timeouts_and_broken_streams_are_recorded_with_their_reason():
    def stream(*deltas, error=None):
        async def gen():
            for delta in deltas:
                yield delta
            if error:
                raise error

        return gen

    def run(make):
        record = RequestRecord(0, 0.0, 5, 4)
        return asyncio.run(measure(record, make, lambda e: f"{type(e).__name__}: {e}"))

    timed_out = run(stream(Delta(1), Delta(1), Delta(0, finish_reason="timeout", cached_tokens=0)))
    assert not timed_out.ok and timed_out.error == "finish_reason=timeout"
    assert timed_out.output_tokens == 2 and len(timed_out.itl_s) == 1
    broken = run(stream(Delta(1), error=ConnectionError("reset")))
    assert broken.error == "ConnectionError: reset" and broken.finish_reason == "error"
    assert run(stream(Delta(1))).error == "stream ended without a finish reason"


# --- the commands --------------------------------------------------------------------------


def _check_records(records, num_requests):
    assert len(records) == num_requests  # nothing dropped
    for record in records:
        assert set(RECORD_FIELDS) <= set(record)
    refused = [r for r in records if r["prompt_tokens"] == 3000]
    assert refused and all(not r["ok"] and "context" in r["error"] for r in refused)
    done = [r for r in records if r["ok"]]
    assert done and all(r["ttft_s"] is not None and r["e2e_s"] >= r["ttft_s"] for r in done)
    assert all(
        r["output_tokens"] == r["max_tokens"] and r["cached_tokens"] is not None for r in done
    )
    return done


def test_bench_serve_through_grpc_keeps_the_refused_request(no_ray, tmp_path, lengths_file):
    out = tmp_path / "serve"
    argv = ["bench", "serve", "--start-local", "--num-workers", "1", "--no-progress"]
    argv += ["--model", "tiny-llama"]
    argv += ["--workload", "file", "--length-file", lengths_file, "--num-requests", "6"]
    argv += ["--request-rate", "30", "--slo-ttft-ms", "10000", "--poll-interval", "0.05"]
    argv += ["--json", f"{out}.json", "--markdown", f"{out}.md", "--plot-prefix", str(out)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "serve.json").read_text())
    done = _check_records(data["records"], 6)
    assert all(r["worker_id"] and r["preemptions"] == 0 and r["migrations"] is None for r in done)
    assert all(r["queue_time_s"] is not None and len(r["itl_s"]) >= 1 for r in done)
    summary = data["summary"]
    assert set(SUMMARY_FIELDS) <= set(summary)
    assert summary["failed"] == 2 and summary["failures_by_reason"] == {"INVALID_ARGUMENT": 2}
    assert data["kv_samples"] and max(s["total_blocks"] for s in data["kv_samples"]) > 0
    assert "from file" in data["workload"]["description"]
    assert "p99" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "serve_cdf.png").stat().st_size and (tmp_path / "serve_kv.png").exists()


def test_bench_ablate_runs_each_arm_on_the_same_arrivals(ray_cluster, tmp_path, lengths_file):
    # `bench ablate` drives each arm's worker group from this process: it runs on the Ray it
    # finds, the test process's shared cluster. (`bench serve --start-local` above starts Serve
    # with its proxies on every node, so it gets a local Ray of its own.)
    out = tmp_path / "ablate"
    argv = ["bench", "ablate", "--factors", "prefix-caching", "attention", "--device", "cpu"]
    argv += ["--num-workers", "1", "--workload", "file", "--length-file", lengths_file]
    argv += ["--num-requests", "4", "--json", f"{out}.json", "--plot-prefix", str(out)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "ablate.json").read_text())
    names = [arm["arm"] for arm in data["arms"]]
    assert names == ["baseline", "enable_prefix_caching=False", "attention_backend=triton"]
    ran = [arm for arm in data["arms"] if not arm["skipped"]]
    assert len(ran) == 2 and "GPU" in data["arms"][2]["skipped"]
    arrivals = [[r["arrival_s"] for r in arm["records"]] for arm in ran]
    assert arrivals[0] == arrivals[1]
    for arm in ran:
        _check_records(arm["records"], 4)
        assert arm["summary"]["failures_by_reason"] == {"RequestRejected": 1}
    ratio = data["ratios"][0]
    assert ratio["arm"] == "enable_prefix_caching=False" and ratio["throughput_ratio"] > 0
    assert (tmp_path / "ablate_ratios.png").exists()


def test_bench_block_sweep_measures_what_the_equations_say(tmp_path):
    argv = ["bench", "block-sweep", "--block-sizes", "8,32", "--num-requests", "3"]
    argv += ["--output-len", "3", "--json", str(tmp_path / "sweep.json")]
    argv += ["--plot", str(tmp_path / "sweep.png")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["result"]["lengths"] == [40, 94, 131]
    for row in data["result"]["rows"]:
        analytic, measured = row["analytic"], row["measured"]
        assert measured["peak_allocated"] <= analytic["allocated"]
        assert measured["peak_block_table_bytes"] <= analytic["block_table_bytes"]
        assert measured["idle_used_blocks"] == 0 and measured["samples"]
    by_b = {row["block_size"]: row["analytic"] for row in data["result"]["rows"]}
    assert by_b[8]["tail_waste"] < by_b[32]["tail_waste"]
    assert (tmp_path / "sweep.png").stat().st_size
