"""`pagedserve kv-calc`: the seed paper's KV memory equations for given lengths and shapes.

Positions (equations (2)-(3) in ``pagedserve.workers.kv.memory``) are always reported; bytes
(equation (1), M_KV per token) are added when a model shape is known, either from
``--layers/--kv-heads/--head-dim/--dtype`` or from a local HF ``config.json`` (``--model``).
Block-table bytes are reported beside the KV bytes, never folded into utilization.

    $ pagedserve kv-calc --lengths 37,91,128,201,511 --block-sizes 16,32 --max-len 512

Bad input exits 2 with ``pagedserve kv-calc: error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedserve.bench import kv_calc_dtype
from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.extras import require_bench_extra
from pagedserve.bench.kv_calc_text import format_text
from pagedserve.workers.kv.memory import (
    LayoutUsage,
    check_lengths,
    dtype_bytes,
    kv_bytes_per_token,
    paged_usage,
    reserve_max_usage,
)

PROG = "pagedserve kv-calc"
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (16,)
PLOT_SWEEP: tuple[int, ...] = tuple(2**k for k in range(10))  # 1, 2, 4, ..., 512


class KvCalcError(ValueError):
    """Bad input; the message names the problem and is shown to the user as is."""


@dataclass(frozen=True)
class ModelShape:
    """The four numbers equation (1) needs: layers, KV heads, head dim and dtype; and the
    pool's KV dtype (`auto`: the dtype; `fp8`...: 1 byte per value plus scales, apart)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str = "auto"
    tensor_parallel_size: int = 1

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads on the fullest rank of a tensor-parallel group (the first ranks take the
        remainder: `workers/tp/shards.py`); each rank's device holds this share of the pool."""
        return -(-self.num_kv_heads // self.tensor_parallel_size)

    @property
    def kv_bytes_per_token_per_rank(self) -> int:
        """M_KV of the fullest rank: 2 · L · ceil(h_kv / k) · d_h · b."""
        return kv_bytes_per_token(
            self.num_layers, self.kv_heads_per_rank, self.head_dim, self.kv_value_dtype
        )

    @property
    def kv_value_dtype(self) -> str:
        """The dtype b of equation (1): the model's, or the 8-bit format's."""
        return kv_calc_dtype.code_dtype(self.dtype, self.kv_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """M_KV = 2 · L · h_kv · d_h · b."""
        return kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_value_dtype
        )

    @property
    def scale_bytes_per_token(self) -> int:
        """Scale bytes per position of an 8-bit pool (0 otherwise), beside M_KV."""
        return kv_calc_dtype.scale_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.kv_dtype
        )


@dataclass(frozen=True)
class KvCalcInputs:
    """Validated inputs for one run."""

    lengths: tuple[int, ...]
    block_sizes: tuple[int, ...]
    max_len: int
    max_len_given: bool
    shape: ModelShape | None


# --- parsing ------------------------------------------------------------------------------


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """Parse integers separated by commas and/or whitespace; ``#`` starts a comment line.

    Args:
        text: e.g. ``"37,91,128"`` or one integer per line.
        what: Name used in error messages, e.g. ``"--lengths"``.

    Returns:
        The integers in order (not yet checked for sign).

    Raises:
        KvCalcError: On an empty list or a token that is not an integer.
    """
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    tokens = " ".join(lines).replace(",", " ").split()
    if not tokens:
        raise KvCalcError(f"{what}: no values given")
    values = []
    for token in tokens:
        try:
            values.append(int(token))
        except ValueError:
            raise KvCalcError(f"{what}: {token!r} is not an integer") from None
    return tuple(values)


def _positive_ints(what: str, text: str) -> tuple[int, ...]:
    values = parse_int_list(text, what)
    for value in values:
        if value < 1:
            raise KvCalcError(f"{what}: values must be >= 1, got {value}")
    return values


def _read_lengths_file(path: str) -> tuple[int, ...]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise KvCalcError(f"--lengths-file: cannot read {path}: {error.strerror}") from None
    return _positive_ints(f"--lengths-file {path}", text)


# --- model shape --------------------------------------------------------------------------


def _read_config(path: str) -> dict[str, Any]:
    """Load ``config.json`` from a file path or from the directory that holds it; a built-in
    GGUF model's name (``smollm2-135m``) reads its converted checkpoint's."""
    from pagedserve.workers.model.registry import BUILTIN_GGUF, resolve_model

    if path in BUILTIN_GGUF:
        try:
            path = resolve_model(path).path
        except ValueError as error:
            raise KvCalcError(f"--model: {error}") from None
    config_path = Path(path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise KvCalcError(f"--model: no config.json at {config_path}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise KvCalcError(f"--model: cannot parse {config_path}: {error}") from None
    if not isinstance(config, dict):
        raise KvCalcError(f"--model: {config_path} does not hold a JSON object")
    return config


def _config_int(config: dict[str, Any], keys: Sequence[str], required: bool = True) -> int | None:
    """The first of ``keys`` present (and not null) in ``config``, checked to be an int >= 1."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvCalcError(f"--model: config.json {key} must be an integer >= 1, got {value!r}")
        return value
    if required:
        raise KvCalcError(f"--model: config.json has no {' / '.join(keys)}")
    return None


def shape_from_config(config: dict[str, Any], dtype: str | None = None) -> ModelShape:
    """Read equation (1)'s shape from an HF config dict.

    Multimodal configs keep the language model under ``text_config``; that is read when the
    top level has no layer count. Every layer is counted as full attention, as in the seed.

    Args:
        config: The parsed ``config.json``.
        dtype: Overrides the config's ``dtype`` / ``torch_dtype`` when given.

    Returns:
        The model shape; ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA) and
        the head dim to ``hidden_size / num_attention_heads``.

    Raises:
        KvCalcError: On a missing or invalid field, or an MLA config (not covered by M_KV).
    """
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        config = {**config, **text}
    if "kv_lora_rank" in config:
        raise KvCalcError(
            "--model: config uses MLA (kv_lora_rank), which M_KV = 2*L*h_kv*d_h*b does not "
            "describe; pass --layers/--kv-heads/--head-dim without --model instead"
        )
    num_layers = _config_int(config, ("num_hidden_layers", "n_layer"))
    num_heads = _config_int(config, ("num_attention_heads", "n_head"))
    num_kv_heads = _config_int(config, ("num_key_value_heads",), required=False) or num_heads
    head_dim = _config_int(config, ("head_dim",), required=False)
    if head_dim is None:
        hidden = _config_int(config, ("hidden_size", "n_embd"))
        if hidden % num_heads:
            raise KvCalcError(
                f"--model: hidden_size {hidden} is not divisible by "
                f"num_attention_heads {num_heads}; head_dim is missing"
            )
        head_dim = hidden // num_heads
    if dtype is None:
        dtype = config.get("dtype") or config.get("torch_dtype")
        if dtype is None:
            raise KvCalcError("--model: config.json has no dtype / torch_dtype; pass --dtype")
    return ModelShape(num_layers, num_kv_heads, head_dim, str(dtype))


def resolve_shape(args: argparse.Namespace) -> ModelShape | None:
    """The model shape from ``--model`` and/or the shape flags; flags override the config."""
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model is None:
        if all(value is None for value in flags.values()):
            for name, value in (("--dtype", args.dtype), ("--kv-dtype", args.kv_dtype)):
                if value is not None:
                    raise KvCalcError(f"{name} needs a model shape: --layers/--kv-heads/--head-dim")
            return None
        missing = [name for name, value in flags.items() if value is None]
        if args.dtype is None:
            missing.append("--dtype")
        if missing:
            raise KvCalcError(f"a model shape needs {', '.join(missing)} (or --model)")
        shape = ModelShape(args.layers, args.kv_heads, args.head_dim, args.dtype)
    else:
        shape = shape_from_config(_read_config(args.model), args.dtype)
        shape = ModelShape(
            args.layers or shape.num_layers,
            args.kv_heads or shape.num_kv_heads,
            args.head_dim or shape.head_dim,
            shape.dtype,
        )
    shape = dataclasses.replace(shape, kv_dtype=args.kv_dtype or "auto")
    ranks = args.tensor_parallel_size
    if ranks > shape.num_kv_heads:
        raise KvCalcError(
            f"--tensor-parallel-size {ranks} is more than the model's {shape.num_kv_heads} KV "
            "heads: each rank must own at least one"
        )
    shape = dataclasses.replace(shape, tensor_parallel_size=ranks)
    try:
        dtype_bytes(shape.dtype)
    except ValueError as error:
        source = "--dtype" if args.dtype is not None else "--model: config.json dtype"
        raise KvCalcError(f"{source}: {error}") from None
    return shape


def resolve_inputs(args: argparse.Namespace) -> KvCalcInputs:
    """Validate every input up front so that nothing later can fail on bad input."""
    lengths = args.lengths if args.lengths is not None else _read_lengths_file(args.lengths_file)
    check_lengths(lengths)
    block_sizes = tuple(dict.fromkeys(args.block_sizes))  # dedupe, keep order
    max_len = args.max_len if args.max_len is not None else max(lengths)
    longest = max(lengths)
    if longest > max_len:
        raise KvCalcError(f"length {longest} exceeds --max-len {max_len}")
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        raise KvCalcError(f"--plot writes a PNG; {args.plot!r} must end in .png")
    shape = resolve_shape(args)
    return KvCalcInputs(lengths, block_sizes, max_len, args.max_len is not None, shape)


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
            return _positive_ints(what, text)
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
