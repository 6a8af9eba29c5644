"""`pagedserve bench serve`: a workload against a running cluster, through the real gRPC client.

Requests go out at their arrival times (Poisson at `--request-rate`, gamma with
`--burstiness`; see `serve_workload` for the workloads, all constructed but `file`) as
`AsyncClient.generate_stream` calls with greedy sampling and `ignore_eos`, so each asks for
exactly its output length. `GetStats` is polled through the same client while it runs (KV usage
over time). Per request (see `serve_metrics`): send delay, worker queue time, TTFT, TPOT,
inter-token gaps, E2E, tokens, cached tokens, preemptions, worker, and for a failure its gRPC
status and message — kept, never dropped. Migrations are not exposed per request by the API
(recorded as null; the cluster-wide `GetStats.migrations` before and after is in the JSON).

With no `--address` (or `--start-local`) it starts a local app first (Ray, Serve, the Router
and `--num-workers` CPU workers of `--model`, SmolLM2-135M by default), waits until it serves,
and tears it down after. Prompts are random token ids below 256 (text for tiny-llama, arbitrary
tokens for a real model: the figures are about speed, not answers).

    $ pagedserve bench serve --workload shared-prefix --request-rate 4 --json serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from pagedserve.bench.bench_io import ensure_ray
from pagedserve.bench.serve_metrics import Delta, kv_sample_from_pb, record_dict, summarize
from pagedserve.bench.serve_runner import RunResult, run_workload
from pagedserve.bench.serve_workload import (
    WORKLOADS,
    PlannedRequest,
    WorkloadConfig,
    make_workload,
)
from pagedserve.cluster.config import LimitsConfig
from pagedserve.cluster.routing.policies import policy_names
from pagedserve.workers.config_flags import add_config_flags, config_flags_set
from pagedserve.workers.model.registry import DEFAULT_MODEL

LOCAL_ENGINE = {"attention_backend": "torch", "block_size": 16}


# --- the gRPC front end --------------------------------------------------------------------


def grpc_error_reason(error: BaseException) -> str:
    """`CODE: details` for an RPC error (e.g. `RESOURCE_EXHAUSTED: ...`), else the exception."""
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def grpc_sender(client: Any, timeout_s: float | None):
    """`send(planned)` for `run_workload`: one streaming Generate per request."""

    async def send(planned: PlannedRequest) -> AsyncIterator[Delta]:
        stream = client.generate_stream(
            prompt_token_ids=list(planned.token_ids),
            request_id=f"bench-{planned.index}-{time.monotonic_ns()}",
            max_tokens=planned.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        )
        async for response in stream:
            final = bool(response.finish_reason)
            metrics = response.metrics if response.HasField("metrics") else None
            yield Delta(
                num_tokens=len(response.token_ids),
                finish_reason=response.finish_reason or None,
                prompt_tokens=response.usage.prompt_tokens if final else None,
                cached_tokens=response.usage.cached_tokens if final else None,
                queue_time_s=metrics.queue_time_s if metrics else None,
                worker_ttft_s=metrics.ttft_s if metrics else None,
                preemptions=metrics.num_preemptions if metrics else None,
                worker_id=response.worker_id or None,
            )

    return send


async def bench_address(
    address: str,
    workload: list[PlannedRequest],
    *,
    max_concurrency: int | None = None,
    request_timeout_s: float | None = None,
    poll_interval_s: float = 0.25,
    progress: bool = False,
    token: str | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Run `workload` against the cluster at `address`; also returns stats before/after."""
    from google.protobuf.json_format import MessageToDict

    from pagedserve.cluster.client import AsyncClient

    async with AsyncClient(address, token=token, timeout=30.0) as client:
        before = MessageToDict(await client.stats())

        async def poll(t_s: float) -> dict[str, Any]:
            return kv_sample_from_pb(t_s, await client.stats())

        result = await run_workload(
            workload,
            grpc_sender(client, request_timeout_s),
            poll,
            max_concurrency=max_concurrency,
            poll_interval_s=poll_interval_s,
            progress=progress,
            error_reason=grpc_error_reason,
        )
        after = MessageToDict(await client.stats())
    return result, {"before": before, "after": after}


# --- a local app for the run ---------------------------------------------------------------


@contextmanager
def local_app(cluster: dict[str, Any], *, num_cpus: int | None = None) -> Iterator[str]:
    """Start Ray (a fresh local one), Serve and the app on free ports; yield the gRPC address.

    Args:
        cluster: `ClusterConfig` data (`name` names the actors, so give each app its own).
        num_cpus: local Ray CPUs (None: workers + 1).
    """
    import ray
    from ray import serve

    from pagedserve.cluster.api.serve_options import grpc_options
    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.pool.group import stop_worker_group
    from pagedserve.cluster.ports import free_port
    from pagedserve.workers.model.cli import prepare_in_subprocess

    config = ClusterConfig.from_dict(cluster)
    prepare_in_subprocess(config.engine.model)  # a GGUF model: converted once, before workers
    cpus = num_cpus or math.ceil(config.scaling.num_workers * config.placement.worker_num_cpus) + 1
    started_ray = ensure_ray(num_cpus=cpus)
    grpc_port = free_port()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": free_port()},
            grpc_options=grpc_options(grpc_port),
        )
        serve.run(build_app(cluster), name=config.name, route_prefix="/")
        address = f"127.0.0.1:{grpc_port}"
        _wait_serving(address, config.failure.startup_timeout_s)
        yield address
    finally:
        serve.shutdown()
        stop_worker_group(config)
        if started_ray:
            ray.shutdown()


def _wait_serving(address: str, timeout_s: float) -> None:
    """Health-check until SERVING (workers loaded); raise after `timeout_s`."""
    from pagedserve.cluster.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(address, timeout=5.0) as client:
        while True:
            with contextlib.suppress(Exception):  # the proxy may not be up yet
                if client.health() == "SERVING":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s} s")
            time.sleep(0.2)


# Of the cluster's fields, `bench serve` takes only the backpressure limits as flags.
_LIMITS = ("max_inflight", "max_waiting_per_worker", "retry_after_s")
_NOT_LIMITS = tuple(f.name for f in dataclasses.fields(LimitsConfig) if f.name not in _LIMITS)


def local_cluster_data(args: argparse.Namespace) -> dict[str, Any]:
    engine = {**LOCAL_ENGINE, "model": args.model, "block_size": args.block_size}
    if args.num_kv_blocks:
        engine["num_kv_blocks"] = args.num_kv_blocks
    return {
        "engine": engine,
        "scaling": {"num_workers": args.num_workers},
        "routing": {"routing_policy": args.routing_policy},
        "failure": {"stats_interval_s": 0.1},
        "limits": config_flags_set(args, LimitsConfig),
        "name": "bench-serve",
    }


# --- command line --------------------------------------------------------------------------


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags `bench serve` and `bench ablate` share."""
    d = WorkloadConfig()
    add = parser.add_argument
    add("--workload", choices=WORKLOADS, default=d.kind, help="see the description")
    add("--num-requests", type=int, default=d.num_requests, help="requests to send")
    add("--request-rate", type=float, default=d.request_rate, help="req/s; inf: all at once")
    add("--burstiness", type=float, default=d.burstiness, help="gamma shape; 1 is Poisson")
    add("--seed", type=int, default=d.seed, help="seeds prompts, lengths and arrivals")
    add("--input-len", type=int, default=d.input_len, help="mean / median prompt tokens")
    add("--output-len", type=int, default=d.output_len, help="mean / median output tokens")
    add("--range-ratio", type=float, default=d.range_ratio, help="uniform: ± fraction")
    add("--sigma", type=float, default=d.sigma, help="lognormal shape")
    add("--num-system-prompts", type=int, default=d.num_system_prompts, help="shared-prefix K")
    add("--num-users", type=int, default=d.num_users, help="shared-prefix M")
    add("--system-prompt-len", type=int, default=d.system_prompt_len, help="shared-prefix")
    add("--user-len", type=int, default=d.user_len, help="shared-prefix: tokens per user")
    add("--length-file", default=None, help="file workload: `prompt_len output_len` lines")
    add("--max-concurrency", type=int, default=None, help="open streams at most")
    add("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    add("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    add("--json", metavar="FILE", default=None, help="config, every record, summary")
    add("--markdown", metavar="FILE", default=None, help="the summary as Markdown")
    add("--plot-prefix", metavar="PREFIX", default=None, help="write PREFIX_*.png plots")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        kind=args.workload,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        sigma=args.sigma,
        num_system_prompts=args.num_system_prompts,
        num_users=args.num_users,
        system_prompt_len=args.system_prompt_len,
        user_len=args.user_len,
        length_file=args.length_file,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="latency, throughput and goodput of a cluster through the gRPC client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--address", default=None, help="gRPC host:port of a running cluster")
    add("--start-local", action="store_true", help="start a local app (default without address)")
    add("--token", default=None, help="bearer token when the cluster has auth on")
    add("--request-timeout", type=float, default=None, help="gRPC deadline per request, s")
    add("--poll-interval", type=float, default=0.25, help="seconds between GetStats samples")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--num-workers", type=int, default=2, help="local app: CPU workers")
    add("--model", default=DEFAULT_MODEL, help="local app: built-in name, checkpoint dir, .gguf")
    add("--block-size", type=int, default=16, help="local app: tokens per KV block")
    add("--num-kv-blocks", type=int, default=None, help="local app: KV blocks per worker")
    add(
        "--routing-policy",
        choices=policy_names(),
        default="kv_aware",
        help="local app: routing policy",
    )
    limits = parser.add_argument_group("local app: backpressure limits (LimitsConfig)")
    add_config_flags(
        limits, LimitsConfig, exclude=_NOT_LIMITS
    )  # --max-inflight, --max-waiting-per-worker, --retry-after-s
    add_workload_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve_report import format_serve_markdown, write_serve_outputs

    try:
        config = workload_config(args)
        workload = make_workload(config)
    except (OSError, ValueError) as error:
        print(f"pagedserve bench serve: error: {error}")
        return 2
    local = args.start_local or not args.address
    cluster = local_cluster_data(args) if local else None
    with local_app(cluster) if local else _given(args.address) as address:
        result, stats = asyncio.run(
            bench_address(
                address,
                workload,
                max_concurrency=args.max_concurrency,
                request_timeout_s=args.request_timeout,
                poll_interval_s=args.poll_interval,
                progress=not args.no_progress,
                token=args.token,
            )
        )
    summary = summarize(result.records, result.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    data = {
        "command": "serve",
        "front_end": "gRPC AsyncClient",
        "address": None if local else args.address,
        "local_cluster": cluster,
        "workload": {**vars(config), "description": config.describe()},
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "summary": summary,
        "records": [record_dict(r) for r in result.records],
        "kv_samples": result.kv_samples,
        "poll_errors": result.poll_errors,
        "cluster_stats": stats,
        "unexposed_per_request": ["migrations"],
    }
    print(format_serve_markdown(data))
    write_serve_outputs(data, args.json, args.markdown, args.plot_prefix)
    return 0


@contextmanager
def _given(address: str) -> Iterator[str]:
    yield address
