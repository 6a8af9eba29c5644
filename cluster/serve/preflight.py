"""What `pagedserve serve` checks before it starts anything: no Ray, no Serve, no worker.

Each mistake found here is a `StartError`: one line that names the setting as the user gave
it (the flag and its value, or the config file's key) and what is wrong with it;
`pagedserve serve` prints it as `pagedserve: error: ...` and exits 2 within seconds, where a
mistake found by a worker used to cost a Ray start, a Serve start and a retry per worker.
In order, cheapest first:

1. the config: `ClusterConfig` (with each worker's `EngineConfig`) and the API's (the auth
   tokens file) from the merged file, flags and machine defaults;
2. this machine, for a cluster started here: the cores `worker_cpus` and `control_cpus`
   name, the CPUs and GPUs the first workers reserve, the HTTP and gRPC ports;
3. the engine (`workers/engine/checks.py`): the model resolves, its config and tokenizer
   load and it holds weights, the device and dtype exist, the KV budget holds a block, the
   lengths fit the model. A GGUF model is converted first, as the workers would find it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.config import SECTIONS, ClusterConfig
from pagedserve.workers.engine.config import EngineConfig

# Settings whose flag is not `--` + the field's name (field paths as in the config file).
FLAG_NAMES: dict[str, str] = {
    "engine.speculative.method": "--speculative-method",
    "engine.speculative.num_tokens": "--num-speculative-tokens",
    "engine.speculative.draft_model": "--speculative-draft-model",
    "auth.tokens_file": "--auth-tokens-file",
    "auth.tokens": "--auth-tokens-file",
    "telemetry.trace_file": "--trace-file",
    "telemetry.exporter": "--trace-exporter",
}


class StartError(Exception):
    """A mistake in what `pagedserve serve` was asked to start, as one line for the user."""

    def __init__(self, setting: str, problem: str) -> None:
        line = " ".join(f"{setting}: {problem}".split())  # one line, whatever the cause wrote
        super().__init__(line)


@dataclass(frozen=True)
class Settings:
    """Where each setting of one start came from, so that an error names it as the user gave
    it. Paths are the config file's: `scaling.num_workers`, `engine.model`, `auth.tokens_file`.

    Attributes:
        data: the merged config data (file, flags, machine defaults) being checked.
        flags: paths given as flags.
        config_file: the `--config` file, if any, and `in_file` the paths it set.
        machine: paths sized to this machine (`node_layout`).
    """

    data: dict[str, Any]
    flags: frozenset[str] = frozenset()
    config_file: str | None = None
    in_file: frozenset[str] = frozenset()
    machine: frozenset[str] = frozenset()
    defaults: dict[str, Any] = field(default_factory=dict)

    def name(self, path: str) -> str:
        """`path` as the user gave it, with its value: `--num-workers 0`, `cluster.yaml:
        engine.block_size 0`, `--kv-cache-bytes 1000 (sized to this machine)`."""
        flag = FLAG_NAMES.get(path) or "--" + path.rsplit(".", 1)[-1].replace("_", "-")
        value = self.value(path)
        if path in self.flags:
            return f"{flag} {value}"
        if path in self.in_file:
            return f"{self.config_file}: {path} {value}"
        if path in self.machine:
            return f"{flag} {value} (sized to this machine)"
        return f"{flag} {value} (the default)"

    def value(self, path: str) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return self.defaults.get(path)
            node = node[part]
        return node

    def named_in(self, message: str) -> str | None:
        """The setting a config check's message is about: of the fields it names, one the
        user set if any, else the first named."""
        named = []
        for path in _field_paths():
            match = re.search(rf"(?<![\w.]){re.escape(path.split('.', 1)[-1])}\b", message)
            if match:
                named.append((match.start(), path))
        if not named:
            return None
        given = [item for item in named if item[1] in self.flags | self.in_file]
        return min(given or named)[1]


def _field_paths() -> list[str]:
    """Every config field's path: each section's (`scaling.num_workers`), the top level's
    (`name`), `engine.` fields, `engine.speculative.`."""
    from dataclasses import fields

    from pagedserve.workers.spec.config import SpeculativeConfig

    top = [f.name for f in fields(ClusterConfig) if f.name != "engine" and f.name not in SECTIONS]
    sections = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)]
    engine = [f"engine.{f.name}" for f in fields(EngineConfig) if f.name != "speculative"]
    spec = [f"engine.speculative.{f.name}" for f in fields(SpeculativeConfig)]
    return [*spec, *engine, *sections, *top]  # "speculative.x" before "x": the longer first


def defaults() -> dict[str, Any]:
    """Each field's default, by path (what `Settings.value` shows for a field left unset)."""
    values: dict[str, Any] = {}
    for path in _field_paths():
        node: Any = ClusterConfig()
        for part in path.split("."):
            node = getattr(node, part, None)
        values[path] = node
    return values


def check_config(data: dict[str, Any], settings: Settings) -> ClusterConfig:
    """The cluster config, and the API's, built as the Router will build them."""
    from pagedserve.cluster.api.auth import TokenAuth
    from pagedserve.cluster.api.config import split_app_args

    try:
        cluster, api = split_app_args(data)
        config = ClusterConfig.from_dict(cluster)
    except (TypeError, ValueError) as error:
        raise _named(error, settings) from error
    try:
        TokenAuth.from_config(api.auth)
    except (OSError, ValueError) as error:
        raise StartError(settings.name("auth.tokens_file"), str(error)) from error
    return config


def _named(error: Exception, settings: Settings) -> StartError:
    # An unknown key is the file's (flags are known by construction), wherever it says the
    # field lives: name the file, not the flag of the field it mentions.
    unknown = str(error).startswith("unknown ")
    path = None if unknown else settings.named_in(str(error))
    where = settings.name(path) if path else (settings.config_file or "the config")
    return StartError(where, str(error))


def check_machine(config: ClusterConfig, settings: Settings, num_gpus: int) -> None:
    """For a cluster started on this machine: the cores named exist, and the first workers
    get what they reserve (Ray would leave the rest waiting for ever)."""
    from pagedserve.workers.process.cpu_placement import check_available, parse_cpu_list

    placement, num_workers = config.placement, config.scaling.num_workers
    for name in ("worker_cpus", "control_cpus"):
        if (text := getattr(placement, name)) is not None:
            try:
                check_available(parse_cpu_list(text, name), name)
            except ValueError as error:
                raise StartError(settings.name(f"placement.{name}"), str(error)) from error
    cpus = os.cpu_count() or 1
    wanted = num_workers * placement.worker_num_cpus
    if wanted > cpus:
        raise StartError(
            settings.name("scaling.num_workers"),
            f"{num_workers} workers of {placement.worker_num_cpus:g} CPU each need "
            f"{wanted:g} CPUs and this machine has {cpus}; Ray would start the rest never "
            "(lower --num-workers or --worker-num-cpus)",
        )
    wanted = num_workers * placement.worker_num_gpus
    if wanted > num_gpus:
        raise StartError(
            settings.name("placement.worker_num_gpus"),
            f"{num_workers} workers need {wanted:g} GPUs and this machine has {num_gpus}",
        )


def check_ports(host: str, http_port: int, grpc_port: int) -> None:
    """Both ports free where Serve's proxies will listen: HTTP on `host`, gRPC on every
    interface (Serve's gRPC proxy binds them all)."""
    if http_port == grpc_port:
        raise StartError(f"--grpc-port {grpc_port}", "is the HTTP port too")
    for flag, port, where in (
        ("--http-port", http_port, host),
        ("--grpc-port", grpc_port, "0.0.0.0"),
    ):
        if not 0 < port < 65536:
            raise StartError(f"{flag} {port}", "is not a TCP port (1..65535)")
        problem = _bind_problem(where, port)
        if problem:
            raise StartError(f"{flag} {port}", problem)


def _bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port` now, or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return f"--host {host} does not resolve: {error.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC do
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return f"already in use on {host} (another server listens there)"
            return f"cannot listen on {host}: {error.strerror}"
    return None


def check_engine(config: ClusterConfig, settings: Settings, local: bool) -> None:
    """The workers' engine, as a worker would load it (`workers/engine/checks.py`)."""
    from pagedserve.workers.engine.checks import EngineConfigError
    from pagedserve.workers.engine.checks import check_engine as check
    from pagedserve.workers.model.cli import prepare_in_subprocess

    engine = config.worker_engine
    try:
        prepare_in_subprocess(engine.model)  # a GGUF model: converted once, here
        check(engine, local_devices=local)
    except EngineConfigError as error:
        raise StartError(settings.name(f"engine.{error.field}"), str(error)) from error
    except ValueError as error:
        raise StartError(settings.name("engine.model"), str(error)) from error
