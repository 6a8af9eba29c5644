"""`pagedserve kv-calc`: the seed paper's KV memory equations for given lengths and shapes.

Positions (equations (2)-(3) in ``pagedserve.workers.kv.memory``) are always reported; bytes
(equation (1), M_KV per token) are added when a model shape is known, either from
``--layers/--kv-heads/--head-dim/--dtype`` or from a local HF ``config.json`` (``--model``).
Block-table bytes are reported beside the KV bytes, never folded into utilization.

    $ pagedserve kv-calc --lengths 37,91,128,201,511 --block-sizes 16,32 --max-len 512

Bad input exits 2 with ``pagedserve kv-calc: error: ...`` on stderr (the inputs and their
checks: ``bench/kv_calc_inputs.py``; the text report: ``bench/kv_calc_text.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from pagedserve.bench import kv_calc_dtype
from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.extras import require_bench_extra
from pagedserve.bench.kv_calc_inputs import (
    KvCalcError,
    KvCalcInputs,
    ModelShape,
    positive_ints,
    resolve_inputs,
)
from pagedserve.bench.kv_calc_text import format_text
from pagedserve.workers.kv.memory import (
    LayoutUsage,
    dtype_bytes,
    paged_usage,
    reserve_max_usage,
)

PROG = "pagedserve kv-calc"
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (16,)
PLOT_SWEEP: tuple[int, ...] = tuple(2**k for k in range(10))  # 1, 2, 4, ..., 512


# --- results ------------------------------------------------------------------------------


def compute_layouts(inputs: KvCalcInputs) -> list[LayoutUsage]:
    """Reserve-max first, then one paged layout per block size, in the order given."""
    layouts = [reserve_max_usage(inputs.lengths, inputs.max_len)]
    layouts += [paged_usage(inputs.lengths, size) for size in inputs.block_sizes]
    return layouts


def layout_dict(layout: LayoutUsage, shape: ModelShape | None) -> dict[str, Any]:
    """One entry of the JSON ``layouts`` list."""
    paged = layout.name == "paged"
    out: dict[str, Any] = {"name": layout.name}
    out |= {"block_size": layout.block_size} if paged else {"max_len": layout.max_len}
    out |= {"allocated": layout.allocated, "wasted": layout.wasted}
    out["utilization"] = layout.utilization
    if paged:
        out["block_table_entries"] = layout.block_table_entries
    if shape is not None:
        per_token = shape.kv_bytes_per_token
        out |= {
            "allocated_bytes": layout.allocated * per_token,
            "wasted_bytes": layout.wasted * per_token,
            "useful_bytes": layout.useful * per_token,
        }
        if paged:
            out["block_table_bytes"] = layout.block_table_bytes
        if shape.scale_bytes_per_token:
            out["scale_bytes"] = layout.allocated * shape.scale_bytes_per_token
    return out


def report_dict(inputs: KvCalcInputs, layouts: list[LayoutUsage]) -> dict[str, Any]:
    """The ``--json`` object."""
    out: dict[str, Any] = {"useful": sum(inputs.lengths)}
    shape = inputs.shape
    if shape is not None:
        out["kv_bytes_per_token"] = shape.kv_bytes_per_token
        out["kv_bytes_per_token_per_rank"] = shape.kv_bytes_per_token_per_rank
        out["model"] = asdict(shape) | {"dtype_bytes": dtype_bytes(shape.kv_value_dtype)}
        out |= kv_calc_dtype.per_position(shape.kv_bytes_per_token, shape.scale_bytes_per_token)
    out["layouts"] = [layout_dict(layout, shape) for layout in layouts]
    return out


# --- plot ---------------------------------------------------------------------------------


def lengths_note(lengths: Sequence[int]) -> str:
    shown = ", ".join(map(str, lengths[:8])) + (", ..." if len(lengths) > 8 else "")
    return (
        f"Lengths are constructed inputs, not a measured workload: {len(lengths)} sequences, "
        f"sum n = {sum(lengths)} ({shown})."
    )


# --- command ------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``kv-calc`` command."""
    parser = subparsers.add_parser(
        "kv-calc",
        help="KV cache memory per token, tail waste and utilization (seed equations)",
        description=(
            "Per-token KV bytes (M_KV = 2*L*h_kv*d_h*b), allocated positions, tail waste and "
            "utilization for given sequence lengths: reserve-max vs paged blocks."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--lengths",
        type=_int_list_arg("--lengths"),
        metavar="N,N,...",
        help="sequence lengths in tokens, e.g. 37,91,128,201,511",
    )
    source.add_argument(
        "--lengths-file", metavar="FILE", help="file of lengths, one per line or comma-separated"
    )
    parser.add_argument(
        "--block-sizes",
        type=_int_list_arg("--block-sizes"),
        default=DEFAULT_BLOCK_SIZES,
        metavar="B,B,...",
        help="block sizes B to compare (default: 16)",
    )
    parser.add_argument(
        "--max-len",
        type=positive_int,
        metavar="N",
        help="positions reserved per sequence by reserve-max (default: the longest length)",
    )
    shape = parser.add_argument_group("model shape (adds bytes; flags override --model)")
    shape.add_argument(
        "--model", metavar="PATH", help="local HF model dir or its config.json, or smollm2-135m"
    )
    shape.add_argument("--layers", type=positive_int, metavar="L", help="transformer layers")
    shape.add_argument("--kv-heads", type=positive_int, metavar="H", help="KV heads h_kv")
    shape.add_argument("--head-dim", type=positive_int, metavar="D", help="head dim d_h")
    shape.add_argument("--dtype", help="KV dtype: float16, bfloat16, fp8, ... (overrides config)")
    shape.add_argument(
        "--kv-dtype",
        choices=kv_calc_dtype.KV_DTYPES,
        help="the pool's kv_cache_dtype: auto (--dtype), or int8 / fp8 (1 byte per value; "
        "the scales, 4 bytes per token and KV head of K and V, reported apart)",
    )
    shape.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        metavar="K",
        help="ranks the KV heads are split over: adds each device's bytes per token",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="write utilization vs block size")
    parser.set_defaults(func=run)


def _int_list_arg(what: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for a list of positive integers (argparse names the flag)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return positive_ints(what, text)
        except KvCalcError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix(f"{what}: ")) from None

    return parse


def run(args: argparse.Namespace) -> int:
    """Run ``kv-calc``; returns 0, or 2 after printing the problem on bad input."""
    try:
        inputs = resolve_inputs(args)
    except ValueError as error:  # KvCalcError and kv_memory's own checks
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    layouts = compute_layouts(inputs)
    if args.plot is not None:
        require_bench_extra("matplotlib")
        from pagedserve.bench.kv_plot import write_plot  # matplotlib only when plotting

        try:
            write_plot(args.plot, inputs)
        except OSError as error:
            print(
                f"{PROG}: error: --plot: cannot write {args.plot}: {error.strerror}",
                file=sys.stderr,
            )
            return 2
    if args.json:
        print(json.dumps(report_dict(inputs, layouts), indent=2))
    else:
        print(format_text(inputs, layouts))
        if args.plot is not None:
            print(f"\nplot: {args.plot}")
    return 0
