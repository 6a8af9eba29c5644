"""`pagedserve serve`: a local Ray cluster (or an existing one) serving the Router app."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="start the serving cluster (router + worker actors) on Ray"
    )
    parser.add_argument("--config", help="YAML file with a cluster config (flags override it)")
    parser.add_argument(
        "--address", help="join this Ray cluster ('auto': the local one) instead of starting one"
    )
    parser.add_argument(
        "--model", help="smollm2-135m (default), tiny-llama, an HF checkpoint dir or a .gguf file"
    )
    parser.add_argument("--num-workers", type=int, help="worker actors (default: GPUs, or 2)")
    parser.add_argument("--routing-policy", choices=["kv_aware", "least_loaded", "round_robin"])
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--on-worker-failure", choices=["replay", "fail"])
    parser.add_argument(
        "--auth-tokens-file",
        help="require `authorization: Bearer <token>` with a token from this file (one a line)",
    )
    parser.add_argument("--served-model-name", help="model id of the OpenAI API")
    parser.add_argument(
        "--trace-exporter",
        choices=["otlp", "console", "file", "none"],
        help="where spans go (default none; otlp honours OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--trace-file", help="write spans as JSON lines here (see `pagedserve trace show`)"
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on (default: this machine only; 0.0.0.0: every interface). "
        "The gRPC port takes calls from this machine only when the host is a loopback one",
    )
    parser.set_defaults(func=run)


def cluster_config_from_args(args: argparse.Namespace, num_gpus: int) -> dict[str, Any]:
    """Merge the YAML file, then flags, then machine defaults into plain config data."""
    data: dict[str, Any] = {}
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: expected a mapping at the top level")
    engine = dict(data.pop("engine", {}) or {})
    for flag, key in (
        ("model", "model"),
        ("block_size", "block_size"),
        ("num_kv_blocks", "num_kv_blocks"),
        ("kv_cache_bytes", "kv_cache_bytes"),
        ("dtype", "dtype"),
    ):
        if getattr(args, flag) is not None:
            engine[key] = getattr(args, flag)
    for flag in ("num_workers", "routing_policy", "on_worker_failure", "served_model_name"):
        if getattr(args, flag) is not None:
            data[flag] = getattr(args, flag)
    if args.auth_tokens_file is not None:
        data["auth"] = {**(data.get("auth") or {}), "tokens_file": args.auth_tokens_file}
    telemetry = dict(data.get("telemetry") or {})
    if args.trace_file is not None:
        # Absolute: worker processes may not share this process's working directory.
        trace_file = os.path.abspath(args.trace_file)
        telemetry.update(trace_file=trace_file, exporter=args.trace_exporter or "file")
    elif args.trace_exporter is not None:
        telemetry["exporter"] = args.trace_exporter
    if telemetry:
        data["telemetry"] = telemetry
    if num_gpus:
        data.setdefault("num_workers", num_gpus)
        data.setdefault("worker_num_gpus", 1.0)
        engine.setdefault("device", "cuda")
    data.setdefault("num_workers", 2)
    data["engine"] = engine
    return data


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from pagedserve.cluster.api_config import split_app_args
    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.grpc_status import proxy_env_vars
    from pagedserve.cluster.serve_options import grpc_options, http_options
    from pagedserve.workers.model_cli import prepare_in_subprocess

    # 'local' starts a fresh cluster even when another one runs on this machine; join an
    # existing one with --address auto (or its address).
    ray.init(address=args.address or "local", include_dashboard=False)
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    try:
        data = cluster_config_from_args(args, num_gpus)
        build_app(data)  # validate the cluster and API config before starting anything
        prepare_in_subprocess(data["engine"].get("model"))  # a GGUF model: convert it once here
    except (OSError, ValueError, TypeError) as error:
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2
    config = ClusterConfig.from_dict(split_app_args(data)[0])
    env_vars = proxy_env_vars(args.host, config.max_request_bytes)
    serve.start(
        http_options=http_options(args.host, args.http_port),
        grpc_options=grpc_options(args.grpc_port),
        controller_options={"runtime_env": {"env_vars": env_vars}},
    )
    serve.run(build_app(data), name="pagedserve", route_prefix="/")
    print(
        f"pagedserve: serving on http://{args.host}:{args.http_port} and gRPC :{args.grpc_port}"
        f" with {data['num_workers']} workers; Ctrl-C stops",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            continue
    except KeyboardInterrupt:
        print("pagedserve: stopping", flush=True)
    from pagedserve.cluster.worker_group import stop_worker_group

    serve.shutdown()
    stop_worker_group(config)
    return 0
