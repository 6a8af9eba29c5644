"""Smoke tests of `pagedserve bench routing` and `pagedserve bench pull` at tiny sizes."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.pull import Point, crossover
from pagedserve.bench.routing_report import percentile
from pagedserve.bench.routing_workload import (
    PlannedRequest,
    RoutingBenchConfig,
    ideal_cached_tokens,
    make_workload,
)
from pagedserve.cli import main


def test_workload_is_seeded_poisson_over_shared_system_prompts():
    config = RoutingBenchConfig(
        num_requests=20, num_system_prompts=3, system_prompt_len=40, user_len=7, seed=5
    )
    workload = make_workload(config)
    assert workload == make_workload(config)
    assert workload != make_workload(RoutingBenchConfig(num_requests=20, seed=6))
    arrivals = [r.arrival_s for r in workload]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert all(len(r.token_ids) == 47 for r in workload)
    by_prompt = {}
    for r in workload:
        assert by_prompt.setdefault(r.system_prompt, r.token_ids[:40]) == r.token_ids[:40]
    assert len(by_prompt) == 3


def test_ideal_hits_the_full_system_blocks_of_all_but_the_first_of_each_prompt():
    def planned(index, arrival_s, system_prompt, length):
        return PlannedRequest(index, arrival_s, system_prompt, tuple(range(length)))

    # S = 37 tokens: 2 full blocks of 16. Listed out of arrival order on purpose.
    workload = [
        planned(0, 0.3, 1, 40),
        planned(1, 0.1, 1, 40),
        planned(2, 0.2, 0, 40),
        planned(3, 0.4, 0, 40),
        planned(4, 0.5, 1, 33),  # only 32 tokens may be cached: one is always computed
    ]
    assert ideal_cached_tokens(workload, 37, 16) == [32, 0, 0, 32, 32]
    assert ideal_cached_tokens(workload[:1], 37, 16) == [0]
    assert ideal_cached_tokens([planned(0, 0.0, 0, 32), planned(1, 1.0, 0, 32)], 32, 16) == [0, 16]


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([4.0], 99) == 4.0


def test_crossover_is_where_pull_wins_from_there_on():
    def point(blocks, prefill, pull):
        return Point(blocks, 16 * blocks, prefill, pull, 0.001, 0)

    assert crossover([point(1, 0.01, 0.02), point(4, 0.03, 0.02), point(8, 0.05, 0.02)]) == 4
    assert crossover([point(1, 0.03, 0.02), point(4, 0.01, 0.02), point(8, 0.05, 0.02)]) == 8
    assert crossover([point(1, 0.01, 0.02), point(2, 0.01, 0.02)]) is None


def test_routing_bench_runs_each_policy_on_the_same_arrivals(ray_cluster, tmp_path):
    out = tmp_path / "routing.json"
    # The 4 KV blocks of each system prompt must come back as cached on later requests.
    args = "--num-workers 2 --num-requests 6 --num-system-prompts 2 --system-prompt-len 64"
    args += " --user-len 5 --max-tokens 3 --request-rate 40 --num-kv-blocks 48"
    args += " --policies kv_aware round_robin --ray-num-cpus 3"
    assert main(["bench", "routing", *args.split(), "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    assert list(result["policies"]) == ["kv_aware", "round_robin"]
    schedules = []
    for data in result["policies"].values():
        records, summary = data["records"], data["summary"]
        assert all(r["error"] is None and r["output_tokens"] == 3 for r in records)
        assert all(r["ttft_s"] <= r["e2e_s"] for r in records)
        schedules.append([(r["arrival_s"], r["system_prompt"]) for r in records])
        assert sum(summary["requests_per_worker"].values()) == 6
        assert len(summary["requests_per_worker"]) == 2
        assert 0.0 < summary["hit_rate"] <= summary["ideal_hit_rate"]
        assert summary["blocks_in_use_at_end"] == 0  # nothing leaked on any worker
    assert schedules[0] == schedules[1]
    assert result["kv_aware_ttft_p50_speedup"]["round_robin"] > 0


def test_pull_bench_reports_every_length(ray_cluster, tmp_path, capsys):
    out = tmp_path / "pull.json"
    args = "--lengths 1 4 --repeats 1 --ray-num-cpus 3"
    assert main(["bench", "pull", *args.split(), "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    assert [p["prefix_blocks"] for p in result["points"]] == [1, 4]
    for point in result["points"]:
        assert point["prefill_s"] > 0 and point["pull_s"] > 0 and point["hit_s"] > 0
        assert point["kv_bytes"] > 0
        (sample,) = point["samples"]
        assert sample["blocks_pulled"] == point["prefix_blocks"]
        assert sample["cached_tokens_on_hit"] == 16 * point["prefix_blocks"]
    assert "crossover" in capsys.readouterr().out
