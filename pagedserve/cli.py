"""The `pagedserve` command line: one subcommand per part, each registered by its own module.

Every command module exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` as the default. Command modules keep heavy imports (torch, ray) inside the
function they run, so that ``pagedserve --help`` and light commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES: tuple[str, ...] = (
    "pagedserve.bench.kv_calc",
    "pagedserve.bench.cli",
    "pagedserve.cluster.client_cli",  # generate (cluster, or --offline), status
    "pagedserve.cluster.cli",
    "pagedserve.cluster.trace_view",  # trace show
    "pagedserve.workers.model_cli",  # model list, model prepare
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="Paged-KV LLM serving: engine, cluster, benchmarks and tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue  # a part that is not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
