"""`pagedserve serve`: a local Ray cluster (or an existing one) serving the Router app.

This module reads the command line into config data and checks it (`cluster/serve/preflight.py`)
before anything starts: a mistake is one line, `pagedserve: error: ...`, and exit status 2,
with no Ray process started (`--debug`, or PAGEDSERVE_DEBUG=1, adds the traceback). What
runs once the checks pass (start, serve, stop on a signal) is `cluster/serve/process.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serve.node_layout import NodeResources
    from pagedserve.cluster.serve.preflight import Settings

# Engine fields the cluster sets itself: each worker's queue bound is `max_waiting_per_worker`.
ENGINE_FIELDS_SET_BY_THE_CLUSTER = ("max_waiting",)
DEBUG_ENV = "PAGEDSERVE_DEBUG"


def register(subparsers: argparse._SubParsersAction) -> None:
    # Light imports only (no torch, no ray): this runs for every `pagedserve` command.
    from pagedserve.cluster.config import SECTIONS, ClusterConfig
    from pagedserve.workers.config_flags import add_config_flags
    from pagedserve.workers.engine.config import EngineConfig
    from pagedserve.workers.protocol.sampling import Pooling
    from pagedserve.workers.spec.config import SPEC_METHODS
    from pagedserve.workers.telemetry.telemetry import EXPORTERS

    parser = subparsers.add_parser(
        "serve",
        help="start the serving cluster (router + worker actors) on Ray",
        description="Start the serving cluster. Settings come from --config FILE (YAML: "
        "ClusterConfig's sections, `scaling:`, `placement:`, `routing:`, `failure:`, `limits:`, "
        "and `engine:` holding EngineConfig's fields), then from the flags given, which "
        "override the file.",
    )
    parser.add_argument("--config", help="YAML file with a cluster config (flags override it)")
    parser.add_argument(
        "--address", help="join this Ray cluster ('auto': the local one) instead of starting one"
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        help="on SIGINT or SIGTERM, how long requests in flight get to finish (none: the "
        "stop is immediate; a second signal stops at once). Default: `drain_grace_s`",
    )
    parser.add_argument(
        "--ray-dashboard",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="start the local Ray cluster with its dashboard, which `ray list` and the web UI "
        "need; off by default: idle, it costs ~30 CPU-ms a second and ~0.9 GiB in 11 more "
        "processes (bench/README.md, 'Serving defaults'); `ray status` works without",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback behind an error (or set {DEBUG_ENV}=1)",
    )
    parser.error = _one_line_error  # type: ignore[method-assign]
    api = parser.add_argument_group("API")
    api.add_argument(
        "--auth-tokens-file",
        help="require `authorization: Bearer <token>` with a token from this file (one a line)",
    )
    api.add_argument("--served-model-name", help="model id of the OpenAI API")
    api.add_argument(
        "--embedding-pooling",
        choices=[kind.value for kind in Pooling],
        help="how /v1/embeddings pools the final hidden states: the prompt's last token "
        "(default, vLLM's for decoder models) or the mean over its tokens",
    )
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
        "--http-through-proxy",
        action="store_true",
        help="serve HTTP through Serve's proxy, as a joined cluster or several Router replicas "
        "do, instead of from the Router replica itself (one Ray hop less per streamed chunk: "
        "cluster/api/direct_ingress.py)",
    )
    api.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on (default: this machine only; 0.0.0.0: every interface). "
        "The gRPC port takes calls from this machine only when the host is a loopback one",
    )
    # One group per section of the config file; fault injection is for soaks and failure
    # tests (a config file can still set it).
    for section, section_class in SECTIONS.items():
        add_config_flags(
            parser.add_argument_group(f"{section} ({section_class.__name__})"),
            section_class,
            exclude=("fault_injection",),
        )
    add_config_flags(parser.add_argument_group("actor names (ClusterConfig)"), ClusterConfig)
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
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT's format) every worker loads at start (EngineConfig."
        "lora_modules); a request selects one with model: NAME. More load at run time: "
        "POST /v1/load_lora_adapter",
    )
    parser.set_defaults(func=run, one_line_errors=True)


def _one_line_error(message: str) -> NoReturn:
    """argparse's refusal as one line (no usage block), like every start-up mistake."""
    print(f"pagedserve: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(2)


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
    from pagedserve.cluster.config import nest
    from pagedserve.workers.config_flags import config_flags_set
    from pagedserve.workers.engine.config import EngineConfig

    data = nest(_read_config_file(args.config)) if args.config else {}
    engine = {**(data.pop("engine", {}) or {}), **config_flags_set(args, EngineConfig)}
    speculative = _speculative_from_args(args, engine.get("speculative"))
    if speculative is not None:
        engine["speculative"] = speculative
    if getattr(args, "lora_modules", None):
        engine["lora_modules"] = list(args.lora_modules)
    data = merged(data, cluster_flags_set(args))
    if args.served_model_name is not None:
        data["served_model_name"] = args.served_model_name
    if args.embedding_pooling is not None:
        data["embedding_pooling"] = args.embedding_pooling
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
    from pagedserve.cluster.config import nest
    from pagedserve.cluster.serve.node_layout import NodeResources, plan

    data, engine = nest(data), dict(data.get("engine") or {})
    if address is None:
        layout = plan(data, node or NodeResources.of_this_machine(num_gpus))
        data = merged(data, nest(layout.settings))
        data["engine"] = {**engine, **layout.engine}
        return data, layout.describe()
    scaling = dict(data.get("scaling") or {})
    placement = dict(data.get("placement") or {})
    if num_gpus:
        scaling.setdefault("num_workers", num_gpus)
        placement.setdefault("worker_num_gpus", 1.0)
        engine.setdefault("device", "cuda")
    roles = (scaling.get("prefill_workers") or 0) + (scaling.get("decode_workers") or 0)
    scaling.setdefault("num_workers", max(2, roles))
    data.update(scaling=scaling, placement=placement, engine=engine)
    return data, ""


def cluster_flags_set(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster flags given, by section (`{"scaling": {"num_workers": 2}}`)."""
    from pagedserve.cluster.config import SECTIONS, ClusterConfig
    from pagedserve.workers.config_flags import config_flags_set

    data: dict[str, Any] = config_flags_set(args, ClusterConfig)
    for section, section_class in SECTIONS.items():
        if given := config_flags_set(args, section_class):
            data[section] = given
    return data


def merged(data: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`data` with `more` on top, each section's mapping merged key by key."""
    from pagedserve.cluster.config import SECTIONS

    out = dict(data)
    for key, value in more.items():
        if key in SECTIONS and isinstance(value, dict):
            out[key] = {**(out.get(key) or {}), **value}
        else:
            out[key] = value
    return out


def _read_config_file(path: str) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


@dataclass(frozen=True)
class ServePlan:
    """What one `pagedserve serve` starts, checked: the config data as Serve's app takes it,
    the built config, and the process's own settings."""

    data: dict[str, Any]
    config: ClusterConfig
    layout: str  # the machine-sized defaults, in words ('' when none)
    address: str | None
    host: str
    http_port: int
    grpc_port: int
    shutdown_grace_s: float
    ray_dashboard: bool = False
    http_through_proxy: str | None = None  # why HTTP goes through Serve's proxy; None: it does not

    @property
    def direct_ingress(self) -> bool:
        """Whether the Router replica serves HTTP itself (`api.direct_ingress`)."""
        return self.http_through_proxy is None


def run(args: argparse.Namespace) -> int:
    from pagedserve.cluster.serve.preflight import StartError
    from pagedserve.cluster.serve.process import serve_until_stopped
    from pagedserve.cluster.serve.process_watch import Interrupted, StopSignals

    signals = StopSignals()
    signals.install()  # a signal while checking ends the process as cleanly as any other
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        num_gpus = local_gpus() if args.address is None else 0
        plan = checked_plan(args, num_gpus)
    except StartError as error:
        if debug:
            traceback.print_exc()
        print(f"pagedserve: error: {error}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as stop:
        print(f"pagedserve: {stop}: stopped before starting", file=sys.stderr, flush=True)
        return 128 + stop.signum
    except Exception as error:  # a check's own bug: still one line, the traceback on request
        if debug:
            traceback.print_exc()
        what = " ".join(f"{type(error).__name__}: {error}".split())
        hint = "" if debug else f" (--debug or {DEBUG_ENV}=1 shows where)"
        print(f"pagedserve: error: checking the config failed: {what}{hint}", file=sys.stderr)
        return 1
    return serve_until_stopped(plan, args, signals, debug)


def local_gpus() -> int:
    """The GPUs a Ray cluster started here would count (those CUDA_VISIBLE_DEVICES shows)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def checked_plan(args: argparse.Namespace, num_gpus: int) -> ServePlan:
    """The config from the file, the flags and the machine, checked (`cluster/serve/preflight.py`)
    before anything starts.

    Args:
        num_gpus: the GPUs of the cluster: this machine's, or a joined cluster's.

    Raises:
        StartError: the first mistake, naming the setting and its value.
    """
    from pagedserve.cluster.api.direct_ingress import why_through_proxy
    from pagedserve.cluster.serve import preflight
    from pagedserve.cluster.serve.preflight import StartError

    local = args.address is None
    grace = args.shutdown_grace_s
    if grace is not None and not 0 <= grace < float("inf"):
        raise StartError(f"--shutdown-grace-s {grace:g}", "must be a finite number >= 0")
    try:
        user = user_config_from_args(args)
    except Exception as error:  # the file: missing, unreadable, not YAML, not a mapping
        raise StartError(f"--config {args.config}", str(error)) from error
    data, layout = with_machine_defaults(user, args.address, num_gpus)
    settings = settings_of(args, user, data)
    config = preflight.check_config(data, settings)
    if local:
        preflight.check_machine(config, settings, num_gpus)
        preflight.check_ports(args.host, args.http_port, args.grpc_port)
    preflight.check_engine(config, settings, local)
    through_proxy = why_through_proxy(args.address, config.scaling, args.http_through_proxy)
    return ServePlan(
        data={**data, "direct_ingress": through_proxy is None},
        config=config,
        layout=layout,
        address=args.address,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        shutdown_grace_s=config.failure.drain_grace_s if grace is None else grace,
        ray_dashboard=args.ray_dashboard,
        http_through_proxy=through_proxy,
    )


def settings_of(args: argparse.Namespace, user: dict[str, Any], data: dict[str, Any]) -> Settings:
    """Where each setting of `data` came from: a flag, the `--config` file, or this machine."""
    from pagedserve.cluster.serve.preflight import Settings, defaults
    from pagedserve.workers.config_flags import config_flags_set
    from pagedserve.workers.engine.config import EngineConfig

    flags = set(_paths(cluster_flags_set(args)))
    flags |= {f"engine.{name}" for name in config_flags_set(args, EngineConfig)}
    speculative = {
        "method": args.speculative_method,
        "num_tokens": args.num_speculative_tokens,
        "draft_model": args.speculative_draft_model,
    }
    flags |= {f"engine.speculative.{k}" for k, v in speculative.items() if v is not None}
    if args.auth_tokens_file is not None:
        flags.add("auth.tokens_file")
    from pagedserve.cluster.config import nest

    file_data = nest(_read_config_file(args.config)) if args.config else {}
    in_file = set(_paths(file_data)) - flags
    return Settings(
        data=data,
        flags=frozenset(flags),
        config_file=args.config,
        in_file=frozenset(in_file),
        machine=frozenset(set(_paths(data)) - set(_paths(user))),
        defaults=defaults(),
    )


def _paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of the leaves of nested config data (`engine.block_size`)."""
    from pagedserve.cluster.config import SECTIONS

    nested = ("engine", "speculative", "auth", "telemetry", *SECTIONS)
    paths = []
    for key, value in data.items():
        if isinstance(value, dict) and key in nested:
            paths += _paths(value, f"{prefix}{key}.")
        else:
            paths.append(f"{prefix}{key}")
    return paths
