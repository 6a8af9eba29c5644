"""`bench serve-compare`: its sweep plan, the arms' commands, the engine arm's layout and loop,
the report's figures (goodput, pair ratios, CPU per token) and its argument checks. Nothing here
starts a server."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import pytest

from pagedserve.bench.openai_load import RequestRecord, Slo, summarize
from pagedserve.bench.serve_compare_arms import ArmRun, our_flags, vllm_env, vllm_server
from pagedserve.bench.serve_compare_report import (
    ArmFigures,
    cpu_ms_per_token,
    pair_ratios,
    ratio_pairs,
)
from pagedserve.bench.serve_compare_sweep import (
    LoadPoint,
    load_points,
    parse_rates,
    plan_runs,
    workload_at,
)


# ------------------------------------------------------------------- the sweep
def test_rates_parse_in_order_and_bad_ones_are_refused():
    assert parse_rates("0.5, 1,2,4") == (0.5, 1.0, 2.0, 4.0)
    assert parse_rates("inf") == (math.inf,)
    for text, why in [("1,0", "> 0"), ("-1", "> 0"), ("nan", "> 0"), ("1,x", "commas"),
                      ("1,1.0", "twice"), ("", "commas")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_rates(text)


def test_a_load_is_a_rate_or_a_closed_loop():
    assert [p.label for p in load_points((0.5, math.inf), 8)] == [
        "0.5 req/s", "all at t=0", "closed loop x8"
    ]  # fmt: skip
    assert [p.key for p in load_points((1.0,), None)] == ["rate=1"]
    with pytest.raises(ValueError, match="exactly one"):
        LoadPoint(rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="> 0"):
        LoadPoint(rate=0.0)


def test_runs_go_load_by_load_with_the_arms_alternated_at_each():
    one, two = LoadPoint(rate=1.0), LoadPoint(rate=4.0)
    plan = [(p.point, p.repeat, p.arm) for p in plan_runs(["ours", "vllm"], [one, two], 3)]
    assert plan == [
        (one, 0, "ours"), (one, 0, "vllm"), (one, 1, "vllm"), (one, 1, "ours"),
        (one, 2, "ours"), (one, 2, "vllm"),
        (two, 0, "ours"), (two, 0, "vllm"), (two, 1, "vllm"), (two, 1, "ours"),
        (two, 2, "ours"), (two, 2, "vllm"),
    ]  # fmt: skip


def test_every_load_gets_the_same_prompts_and_one_arrival_pattern_scaled():
    prompts = [(5, 6), (7,), (8, 9, 10)]
    slow, fast = (workload_at(LoadPoint(rate=r), prompts, 4, seed=0) for r in (1.0, 2.0))
    assert [p.token_ids for p in slow] == [p.token_ids for p in fast] == prompts
    assert all(p.max_tokens == 4 for p in slow)
    assert [f.arrival_s for f in fast] == pytest.approx([s.arrival_s / 2 for s in slow])
    assert slow[-1].arrival_s > 0
    closed = workload_at(LoadPoint(concurrency=2), prompts, 4, seed=0)
    assert [p.arrival_s for p in closed] == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------- the arms
def args_of(**given) -> argparse.Namespace:
    defaults = dict(model="smollm2-135m", ours_num_workers=None, kv_cache_gib=None,
                    worker_threads=None, vllm_dtype="float32", vllm_kv_gib=2)  # fmt: skip
    return argparse.Namespace(**(defaults | given))


def test_the_default_arms_give_no_setting_beyond_what_serving_needs(monkeypatch, tmp_path):
    assert our_flags(args_of()) == [
        "--model", "smollm2-135m", "--served-model-name", "smollm2-135m"
    ]  # fmt: skip
    assert our_flags(args_of(ours_num_workers=1))[:2] == ["--num-workers", "1"]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # not passed on: the options say
    assert vllm_env(args_of())["VLLM_CPU_KVCACHE_SPACE"] == "2"  # what vLLM needs to start
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(args_of(vllm_kv_gib=None))
    server = vllm_server(args_of(), "/vllm/python", "/model", tmp_path, tmp_path / "v.log")
    command = server.command[server.command.index("--model") :]
    assert command[::2] == ["--model", "--served-model-name", "--port", "--host", "--dtype"]
    assert command[-1] == "float32"


def test_equal_settings_are_opt_in_and_apply_to_both():
    args = args_of(kv_cache_gib=3, worker_threads=2)
    flags = our_flags(args, extra="--linear-backend torch")
    assert flags[-6:] == ["--kv-cache-bytes", str(3 << 30), "--worker-threads", "2",
                          "--linear-backend", "torch"]  # fmt: skip
    assert vllm_env(args)["VLLM_CPU_KVCACHE_SPACE"] == "3"  # --kv-cache-gib wins


# ------------------------------------------------------------------- the engine arm
def test_the_engine_arm_gets_the_served_workers_engine_and_threads():
    from pagedserve.bench.serve_compare_engine import served_worker_layout
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serve.node_layout import NodeResources
    from pagedserve.workers.engine.config import EngineConfig

    node = NodeResources(numa_cores=((0, 1, 2),), available_bytes=5 << 30, num_gpus=0)
    flags = our_flags(args_of(model="tiny-llama"))
    layout = served_worker_layout(flags, environ={}, node=node)
    limits, placement = ClusterConfig().limits, ClusterConfig().placement
    assert layout.engine.model == "tiny-llama"
    assert layout.engine.max_waiting == limits.max_waiting_per_worker  # as the cluster sets it
    assert layout.engine.kv_cache_bytes == 1 << 30  # 40% of what the node has free, / 2
    assert layout.engine.linear_backend == "auto"
    assert layout.engine.attention_backend == EngineConfig().attention_backend
    # Two workers share the node's cores; alone with work, as the engine arm is, one has all.
    assert layout.threads == 3 and layout.threads_from.startswith("every core: shared")
    assert (layout.nice, layout.cpus, layout.num_workers) == (placement.worker_nice, None, 2)
    alone = served_worker_layout([*flags, "--num-workers", "1"], environ={}, node=node)
    assert (alone.threads, alone.threads_from) == (3, "the cluster config")
    # Pinned to one core, the worker gets a thread per core of its slice; with no threads set
    # anywhere (joining a cluster by address), Ray's OMP_NUM_THREADS is what the worker keeps.
    pinned = served_worker_layout(
        [*flags, "--num-workers", "1", "--worker-cpus", "1"], environ={}, node=node
    )
    assert pinned.threads == 1 and pinned.cpus == (1,)


def test_the_engine_arm_follows_the_ours_arms_settings():
    from pagedserve.bench.serve_compare_engine import served_worker_layout

    args = args_of(model="tiny-llama", kv_cache_gib=1, worker_threads=2)
    layout = served_worker_layout(our_flags(args, "--worker-nice 3"), environ={})
    assert (layout.threads, layout.nice, layout.engine.kv_cache_bytes) == (2, 3, 1 << 30)
    pinned = served_worker_layout(
        our_flags(args_of(), "--num-workers 1 --worker-cpus 0"), environ={}
    )
    assert (pinned.cpus, pinned.threads) == ((0,), 1)  # one thread per core of its share
    with pytest.raises(ValueError, match="refuses"):
        served_worker_layout(["--no-such-flag"], environ={})


@dataclass
class Completion:
    token_ids: list[int]


@dataclass
class Delta:
    request_id: str
    completions: list[Completion]
    finished: bool


class CountingEngine:
    """Gives every unfinished request one token a step; remembers the most it ever held."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.most = 0

    def add_request(self, request_id, token_ids, params):
        self.left[request_id] = params.max_tokens
        self.most = max(self.most, len(self.left))

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[Delta]:
        deltas = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            deltas.append(Delta(request_id, [Completion([1])], done))
            if done:
                del self.left[request_id]
        return deltas


def requests(n: int, max_tokens: int = 3) -> list[dict]:
    return [{"index": i, "arrival_s": 0.0, "token_ids": [5, 6], "max_tokens": max_tokens}
            for i in range(n)]  # fmt: skip


def test_the_engine_arm_records_every_token_and_steps_through_the_given_step():
    from pagedserve.bench.engine_arrivals import run_requests

    engine, stepped = CountingEngine(), []

    def step():
        stepped.append(1)
        return engine.step()

    records, steps = run_requests(engine, requests(3), "r-", step)
    assert engine.most == 3 and len(steps) == len(stepped) == 3
    assert [r["index"] for r in records] == [0, 1, 2]
    assert all(len(r["chunk_times_s"]) == 3 and r["output_tokens"] == 3 for r in records)


def test_the_engine_arms_closed_loop_keeps_that_many_in_flight():
    from pagedserve.bench.engine_arrivals import run_requests

    engine = CountingEngine()
    records, steps = run_requests(engine, requests(5), "r-", concurrency=2)
    assert engine.most == 2 and len(steps) == 9  # 3 waves of 3 steps, the last of one request
    assert [r["send_s"] == r["arrival_s"] for r in records] == [True] * 5
    assert records[2]["send_s"] >= records[0]["end_s"]  # sent when one of the first two ended


# ------------------------------------------------------------------- the report
def record(index: int, ttft: float, tpot: float, tokens: int = 4, error=None) -> RequestRecord:
    chunks = tuple(ttft + tpot * k for k in range(tokens))
    return RequestRecord(index, 0.0, 3, tokens, 0.0, chunks[-1], chunks, tokens,
                         "length", 200, error)  # fmt: skip


AT_1 = LoadPoint(rate=1.0)


def run_of(arm, repeat, records, cpu=None) -> ArmRun:
    return ArmRun(arm, AT_1, repeat, 0.0, tuple(records), summarize(records), cpu or {})


def test_ratios_are_per_alternated_pair_of_one_load():
    latencies = [("ours", 0, 0.2, 0.05), ("vllm", 0, 0.4, 0.1), ("vllm", 1, 0.1, 0.1),
                 ("ours", 1, 0.3, 0.1)]  # fmt: skip
    runs = [run_of(arm, i, [record(0, ttft, tpot)]) for arm, i, ttft, tpot in latencies]
    ratios = pair_ratios(runs, "ours", "vllm")
    assert ratios["ttft_p50_ms"] == pytest.approx([0.5, 3.0])
    assert ratios["tpot_p50_ms"] == pytest.approx([0.5, 1.0])
    assert pair_ratios(runs, "ours", "engine") == {}
    assert ratio_pairs(["ours", "fast", "engine", "vllm"]) == [
        ("ours", "vllm"), ("fast", "vllm"), ("ours", "engine"), ("fast", "engine")
    ]  # fmt: skip
    assert ratio_pairs(["ours", "fast"]) == [("fast", "ours")]


def test_cpu_per_token_splits_the_engine_from_the_rest_of_the_server():
    ours = {"Worker": 0.36, "Router": 0.03, "ProxyActor": 0.01, "client": 0.5}
    vllm = {
        "VLLM::Worker": 0.2,
        "VLLM::EngineCore": 0.1,
        "vllm.entrypoints.openai.api_server": 0.02,
    }
    records = [record(i, 0.1, 0.01, tokens=10) for i in range(4)]  # 40 output tokens
    cpu = cpu_ms_per_token(run_of("ours", 0, records, ours))
    assert cpu["engine"] == pytest.approx(9.0) and cpu["outside"] == pytest.approx(1.0)
    assert "client" not in cpu  # the load client is not the server
    cpu = cpu_ms_per_token(run_of("vllm", 0, records, vllm))
    assert cpu["engine"] == pytest.approx(7.5) and cpu["outside"] == pytest.approx(0.5)


def test_figures_over_runs_median_spread_goodput_and_cpu():
    slo = Slo(ttft_ms=250.0, tpot_ms=60.0)
    runs = [
        run_of("ours", 0, [record(0, 0.1, 0.05), record(1, 0.3, 0.05)], {"Router": 0.016}),
        run_of("ours", 1, [record(0, 0.2, 0.05), record(1, 0.2, 0.07)], {"Worker": 0.08}),
        run_of("ours", 2, [record(0, 0.2, 0.05), record(1, 0.2, 0.05, error="HTTP 500: x")]),
    ]
    f = ArmFigures.of(runs, slo)
    assert f.ttft_p50_spread == pytest.approx((200.0, 200.0))
    assert f.tpot_p50_spread == pytest.approx((50.0, 60.0))
    assert f.median["failures"] == 1
    # Goodput per run: 1 of 2 met the SLO in each; their durations 0.45, 0.41 and 0.35 s.
    assert f.median["goodput_per_s"] == pytest.approx(1 / 0.41)
    assert f.cpu_ms_per_token["Router"] == 0.0  # median of 2, 0 and nothing (0)
    assert f.cpu_ms_per_token["engine"] == pytest.approx(0.0)


# ------------------------------------------------------------------- the command's checks
def test_our_worker_count_is_left_to_the_server_unless_given():
    from pagedserve.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "serve-compare"]).ours_num_workers is None
    assert parse(["bench", "serve-compare", "--ours-num-workers", "2"]).ours_num_workers == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rates", "1,2", "--request-rate", "1"], "not both"),
        (["--rates", "0,1"], "must be > 0"),
        (["--request-rate", "0"], "must be > 0"),
        (["--min-input-len", "300", "--max-input-len", "10"], "above --max-input-len"),
        (["--variant", "vllm=--x"], "new NAME"),
        (["--ours-num-workers", "0"], "count >= 1 or 'default'"),
        (["--vllm-kv-gib", "x"], "count >= 1 or 'default'"),
        (["--slo-tpot-ms", "0"], "must be > 0"),
        (["--closed-loop", "0"], "must be >= 1"),
        (["--engine-arm", "--variant", "x=--y", "--worker-threads", "x"], "expected an integer"),
    ],
)
def test_arguments_that_cannot_run_are_refused_with_why(argv, says, capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve-compare", "--model", "tiny-llama", *argv])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
