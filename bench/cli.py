"""`pagedserve bench ...`: benchmarks, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: tuple[str, ...] = (
    "pagedserve.bench.kv_manager",
    "pagedserve.bench.offline",
    "pagedserve.bench.compare",
    "pagedserve.bench.routing",
    "pagedserve.bench.pull",
    "pagedserve.bench.tier_cost",
    "pagedserve.bench.serve",
    "pagedserve.bench.ablate",
    "pagedserve.bench.block_sweep",
    "pagedserve.bench.grpc_burst",
    "pagedserve.bench.serve_compare",
    "pagedserve.bench.spec",
    "pagedserve.bench.structured",
    "pagedserve.bench.scale",
    "pagedserve.bench.kv_dtype",
    "pagedserve.bench.fairness",
    "pagedserve.bench.beam",
    "pagedserve.bench.lora",
    "pagedserve.bench.ray_hop",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks and microbenchmarks")
    bench_subparsers = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    for module_name in BENCH_MODULES:
        # A missing module is a broken install: fail, never drop the command silently.
        importlib.import_module(module_name).register(bench_subparsers)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
