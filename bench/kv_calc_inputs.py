"""`pagedserve kv-calc`'s inputs, validated up front so that nothing later can fail on bad
input: the sequence lengths (`--lengths`, `--lengths-file`), the block sizes and `--max-len`,
and the model shape equation (1) needs (`ModelShape`), from the shape flags and/or a local HF
`config.json` (`--model`). Every problem is a `KvCalcError` whose message names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.bench import kv_calc_dtype
from pagedserve.workers.kv.memory import check_lengths, dtype_bytes, kv_bytes_per_token


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


def positive_ints(what: str, text: str) -> tuple[int, ...]:
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
    return positive_ints(f"--lengths-file {path}", text)


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
