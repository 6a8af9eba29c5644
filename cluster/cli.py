"""`pagedserve serve`: a local Ray cluster (or an existing one) serving the Router app."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.cluster.node_layout import NodeResources

# Engine fields the cluster sets itself: each worker's queue bound is `max_waiting_per_worker`.
ENGINE_FIELDS_SET_BY_THE_CLUSTER = ("max_waiting",)


def register(subparsers: argparse._SubParsersAction) -> None:
    # Light imports only (no torch, no ray): this runs for every `pagedserve` command.
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.workers.config_flags import add_config_flags
    from pagedserve.workers.engine_config import EngineConfig
    from pagedserve.workers.spec_config import SPEC_METHODS
    from pagedserve.workers.telemetry import EXPORTERS

    parser = subparsers.add_parser(
        "serve",
        help="start the serving cluster (router + worker actors) on Ray",
        description="Start the serving cluster. Settings come from --config FILE (YAML: the "
        "fields of ClusterConfig, with `engine:` holding EngineConfig's), then from the flags "
        "given, which override the file.",
    )
    parser.add_argument("--config", help="YAML file with a cluster config (flags override it)")
    parser.add_argument(
        "--address", help="join this Ray cluster ('auto': the local one) instead of starting one"
    )
    api = parser.add_argument_group("API")
    api.add_argument(
        "--auth-tokens-file",
        help="require `authorization: Bearer <token>` with a token from this file (one a line)",
    )
    api.add_argument("--served-model-name", help="model id of the OpenAI API")
    api.add_argument(
        "--trace-exporter",
        choices=EXPORTERS,
        help="where spans go (default none; otlp honours OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    api.add_argument(
        "--trace-file", help="write spans as JSON lines here (see `pagedserve trace show`)"
    )
    api.add_argument("--http-port", type=int, default=8000, help="(default: 8000)")
    api.add_argument("--grpc-port", type=int, default=9000, help="(default: 9000)")
    api.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on (default: this machine only; 0.0.0.0: every interface). "
        "The gRPC port takes calls from this machine only when the host is a loopback one",
    )
    add_config_flags(parser.add_argument_group("cluster (ClusterConfig)"), ClusterConfig)
    add_config_flags(
        parser.add_argument_group("engine of every worker (EngineConfig)"),
        EngineConfig,
        exclude=ENGINE_FIELDS_SET_BY_THE_CLUSTER,
    )
    spec = parser.add_argument_group(
        "speculative decoding (EngineConfig.speculative; off by default)"
    )
    spec.add_argument("--speculative-method", choices=SPEC_METHODS, help="ngram or draft")
    spec.add_argument(
        "--num-speculative-tokens", type=int, help="draft tokens per step, k (default: 3)"
    )
    spec.add_argument("--speculative-draft-model", help="the draft model of method 'draft'")
    parser.set_defaults(func=run)


def _speculative_from_args(args: argparse.Namespace, given: dict | None) -> dict | None:
    """The YAML file's `engine.speculative`, with the speculative flags given on top."""
    flags = {
        "method": args.speculative_method,
        "num_tokens": args.num_speculative_tokens,
        "draft_model": args.speculative_draft_model,
    }
    flags = {name: value for name, value in flags.items() if value is not None}
    if not flags:
        return given
    return {**(given or {}), **flags}


def cluster_config_from_args(
    args: argparse.Namespace, num_gpus: int, node: NodeResources | None = None
) -> dict[str, Any]:
    """Merge the YAML file, then flags, then machine defaults into plain config data.

    `node`: the machine the defaults are sized to (None: this one; see `node_layout`)."""
    data, _ = with_machine_defaults(user_config_from_args(args), args.address, num_gpus, node)
    return data


def user_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML file, then flags, as plain config data: what the user set, nothing more."""
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.workers.config_flags import config_flags_set
    from pagedserve.workers.engine_config import EngineConfig

    data = _read_config_file(args.config) if args.config else {}
    engine = {**(data.pop("engine", {}) or {}), **config_flags_set(args, EngineConfig)}
    speculative = _speculative_from_args(args, engine.get("speculative"))
    if speculative is not None:
        engine["speculative"] = speculative
    data.update(config_flags_set(args, ClusterConfig))
    if args.served_model_name is not None:
        data["served_model_name"] = args.served_model_name
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
    data["engine"] = engine
    return data


def with_machine_defaults(
    data: dict[str, Any], address: str | None, num_gpus: int, node: NodeResources | None = None
) -> tuple[dict[str, Any], str]:
    """`data` with what it leaves unset sized to the machine, and a line saying what was
    chosen and why ('' when nothing was).

    A cluster on this machine (`address` None) is sized by `node_layout.plan`; one joined by
    address keeps the fixed defaults: one worker per GPU, else 2 (or the P/D roles' count)."""
    from pagedserve.cluster.node_layout import NodeResources, plan

    data, engine = dict(data), dict(data.get("engine") or {})
    if address is None:
        layout = plan(data, node or NodeResources.of_this_machine(num_gpus))
        data.update(layout.settings)
        data["engine"] = {**engine, **layout.engine}
        return data, layout.describe()
    if num_gpus:
        data.setdefault("num_workers", num_gpus)
        data.setdefault("worker_num_gpus", 1.0)
        engine.setdefault("device", "cuda")
    roles = (data.get("prefill_workers") or 0) + (data.get("decode_workers") or 0)
    data.setdefault("num_workers", max(2, roles))
    data["engine"] = engine
    return data, ""


def _layout(config) -> str:
    """The P/D layout, as the serving line shows it ('' without P/D)."""
    if not config.disaggregated:
        return ""
    mixed = config.num_workers - config.prefill_workers - config.decode_workers
    return f" ({config.prefill_workers} prefill, {config.decode_workers} decode, {mixed} mixed)"


def check_local_cores(config) -> None:
    """Raise ValueError if `worker_cpus` or `control_cpus` names a core this machine lacks."""
    from pagedserve.workers.cpu_placement import check_available, parse_cpu_list

    for name in ("worker_cpus", "control_cpus"):
        if (text := getattr(config, name)) is not None:
            check_available(parse_cpu_list(text, name), name)


def place_local_cluster(config) -> None:
    """Pin this process and the local Ray cluster it started (GCS, raylet, Serve's proxy and
    controller, pooled workers: every process under this one) to `control_cpus`, and give the
    Ray actors among them (niceness 15) `control_nice`; the worker actors are left as they
    placed themselves."""
    import ray

    from pagedserve.workers.cpu_placement import (
        descendants,
        format_cpu_list,
        niceness,
        pin_process,
        set_niceness,
    )

    handles = [
        ray.get_actor(config.worker_name(i), namespace=config.namespace)
        for i in range(config.num_workers)
    ]
    workers = {info.pid for info in ray.get([h.describe.remote() for h in handles])}
    cpus, nice = config.control_cpu_set, config.control_nice
    placed = 0
    for pid in [os.getpid(), *descendants(os.getpid())]:
        if pid in workers:
            continue
        try:
            if cpus is not None:
                pin_process(cpus, pid, what="control plane")
            if nice is not None and niceness(pid) > nice:  # Ray's actors, not its daemons
                set_niceness(nice, pid, what="control plane")
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        placed += 1
    where = "any core" if cpus is None else f"cores {format_cpu_list(cpus)}"
    print(
        f"pagedserve: control plane ({placed} processes) on {where}, niceness "
        f"{'as Ray set it' if nice is None else f'<= {nice}'}; workers on "
        f"{config.worker_cpus or 'any core'}, niceness {config.worker_nice}",
        flush=True,
    )


def _read_config_file(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from pagedserve.cluster.api_config import split_app_args
    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.ray_startup import allow_slow_startup
    from pagedserve.cluster.serve_options import controller_env_vars, grpc_options, http_options
    from pagedserve.workers.model_cli import prepare_in_subprocess

    # 'local' starts a fresh cluster even when another one runs on this machine; join an
    # existing one with --address auto (or its address).
    allow_slow_startup()
    ray.init(address=args.address or "local", include_dashboard=False)
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    try:
        data, layout = with_machine_defaults(user_config_from_args(args), args.address, num_gpus)
        build_app(data)  # validate the cluster and API config before starting anything
        if args.address is None:  # a cluster on this machine: its cores must exist here
            check_local_cores(ClusterConfig.from_dict(split_app_args(data)[0]))
        prepare_in_subprocess(data["engine"].get("model"))  # a GGUF model: convert it once here
    except (OSError, ValueError, TypeError) as error:
        print(f"pagedserve serve: error: {error}", file=sys.stderr)
        return 2
    config = ClusterConfig.from_dict(split_app_args(data)[0])
    if layout:
        print(f"pagedserve: sized to this machine: {layout}", flush=True)
    env_vars = controller_env_vars(
        args.host, config.max_request_bytes, config.max_pending_grpc_calls
    )
    serve.start(
        http_options=http_options(args.host, args.http_port),
        grpc_options=grpc_options(args.grpc_port),
        controller_options={"runtime_env": {"env_vars": env_vars}},
    )
    serve.run(build_app(data), name="pagedserve", route_prefix="/")
    if args.address is None and (config.control_cpus, config.control_nice) != (None, None):
        place_local_cluster(config)
    print(
        f"pagedserve: serving on http://{args.host}:{args.http_port} and gRPC :{args.grpc_port}"
        f" with {data['num_workers']} workers{_layout(config)}; Ctrl-C stops",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            continue
    except KeyboardInterrupt:
        print("pagedserve: stopping", flush=True)
    from pagedserve.cluster.worker_group import drain_worker_group, stop_pool, stop_worker_group

    # Workers first: they drain while the Routers still stream what they finish (new requests
    # are refused meanwhile), so nothing is left in flight when Serve stops; the pool goes
    # before, so that it replaces no draining worker. The index and the workers go last, once
    # no Router is left to ask them.
    print(f"pagedserve: draining workers (up to {config.drain_grace_s:g} s)", flush=True)
    stop_pool(config)
    drain_worker_group(config)
    serve.shutdown()
    stop_worker_group(config, drain_grace_s=0.0)
    return 0
