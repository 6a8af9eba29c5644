"""The `pagedserve` command line: one subcommand per part, each registered by its own module.

Every command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` as the default. Command modules keep heavy imports (torch, ray) inside the
function they run, so that ``pagedserve --help`` and light commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedserve.bench.extras import is_missing_bench_extra, missing_extra_message
from pagedserve.cluster.serve.ray_startup import exec_only_forks

COMMAND_MODULES: tuple[str, ...] = (
    "pagedserve.bench.kv_calc",
    "pagedserve.bench.cli",
    "pagedserve.cluster.client_cli",  # generate (cluster, or --offline), status
    "pagedserve.cluster.serve.cli",
    "pagedserve.cluster.trace_view",  # trace show
    "pagedserve.workers.model.cli",  # model list, model prepare
    "pagedserve.workers.process.drain_node",  # drain-node (a pod's preStop hook)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="Paged-KV LLM serving: engine, cluster, benchmarks and tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        # Every listed module is part of the package: a missing one is a broken install and
        # must fail here, not vanish from --help.
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any command imports grpc: this process starts Ray's (cluster/serve/ray_startup.py).
    exec_only_forks()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # what parse_args does, unless the command refuses in one line (`serve`)
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if not getattr(args, "one_line_errors", False):
            parser.error(message)
        print(f"pagedserve: error: {message}", file=sys.stderr)
        return 2
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as error:
        if not is_missing_bench_extra(error):
            raise
        print(f"pagedserve: error: {missing_extra_message(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
