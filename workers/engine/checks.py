"""What an `EngineConfig` asks of its model and of this machine, checked without loading
weights: the model resolves, its config and tokenizer load and it holds weights, the device
and dtype exist here, the KV budget holds a block, and the lengths fit the model.

`pagedserve serve` runs `check_engine` before it starts Ray (`cluster/serve/preflight.py`): each of
these mistakes would otherwise surface minutes later, inside a worker, once per worker it
retried. The checks read what the worker would read (`model.registry.resolve_model`, HF's
config and tokenizer files) and use the KV equations the worker sizes its pool by
(`kv.memory`, as `pagedserve kv-calc`), so they pass exactly when the worker's start would.

    config.json, tokenizer ──► ModelShape ──► KV block bytes vs the budget
                                         └──► context vs max_model_len, block_size
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.workers.engine.config import (
    AUTO_DTYPE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DTYPE_NAMES,
    EngineConfig,
)
from pagedserve.workers.kv.memory import kv_bytes_per_token
from pagedserve.workers.model.registry import resolve_model

# What `from_pretrained` loads weights from (sharded checkpoints too).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


class EngineConfigError(ValueError):
    """A setting no worker could start with.

    Args:
        field: the `EngineConfig` field at fault (`speculative.draft_model` for the draft's).
        message: what is wrong with its value, for the user as it is.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that size its KV pool and bound its sequences."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the KV's dtype: the engine's, or the checkpoint's own for `auto`
    context: int  # longest sequence the model serves (`model.loader.context_length`)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block: `block_size` × M_KV (equation (1) of `kv.memory`)."""
        return block_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )


def check_engine(config: EngineConfig, local_devices: bool = True) -> ModelShape:
    """Everything a worker of `config` needs, short of loading weights.

    Args:
        config: the engine config (its own field checks have passed).
        local_devices: whether the workers run on this machine (its devices are theirs); a
            cluster joined by address has its own.

    Returns:
        The model's shape.

    Raises:
        EngineConfigError: naming the field and what is wrong.
    """
    if local_devices:
        check_device(config.device, config.dtype)
    check_backend(config)
    shape = model_shape(config.model, config.dtype, "model")
    check_kv_budget(config, shape)
    check_lengths(config, shape)
    if config.speculative is not None and config.speculative.draft_model is not None:
        model_shape(config.speculative.draft_model, config.dtype, "speculative.draft_model")
    if config.kv_disk_tier_dir is not None:
        check_writable_dir(config.kv_disk_tier_dir, "kv_disk_tier_dir")
    return shape


def check_device(device: str, dtype: str) -> None:
    """`device` exists on this machine, and takes `dtype`."""
    import torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise EngineConfigError(
            "device", f"no CUDA device is available here (torch {torch.__version__}, {build})"
        )
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise EngineConfigError(
            "device", f"this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    name = DTYPE_NAMES.get(str(dtype).removeprefix("torch.").lower())
    if name == "bfloat16" and not torch.cuda.is_bf16_supported():
        gpu = torch.cuda.get_device_name(index)
        raise EngineConfigError("dtype", f"{gpu} does not support bfloat16; use float16")


def check_backend(config: EngineConfig) -> None:
    """The attention backend runs on the device (`kernels.dispatch.get_kernel_ops`'s rules)."""
    backend, on_cuda = config.attention_backend, config.device.startswith("cuda")
    if backend == "cpu" and on_cuda:
        raise EngineConfigError("attention_backend", "'cpu' runs on CPU pools only")
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineConfigError(
            "attention_backend", "'triton' needs a CUDA device (--device cuda); use 'auto'"
        )


def model_shape(model: str | None, dtype: str, field: str) -> ModelShape:
    """The shape of `model` (a built-in name, checkpoint directory or converted GGUF file),
    from its config; its tokenizer files, if any, must load and it must hold weights."""
    try:
        source = resolve_model(model)
    except (OSError, ValueError) as error:
        raise EngineConfigError(field, str(error)) from None
    if source.path is None:
        from pagedserve.workers.model.tiny_llama import tiny_llama_config

        return _shape(tiny_llama_config(), dtype, "float32")
    hf_config = _load_config(source.path, field)
    _check_tokenizer(source.path, field)
    if not any(glob.glob(os.path.join(source.path, pattern)) for pattern in WEIGHT_FILES):
        raise EngineConfigError(
            field, f"{source.path} holds no weights ({', '.join(WEIGHT_FILES)})"
        )
    return _shape(hf_config, dtype, _checkpoint_dtype(hf_config))


def _load_config(path: str, field: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # what HF raises for a missing, broken or unknown config
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise EngineConfigError(field, f"its config.json does not load: {first}") from None


def _check_tokenizer(path: str, field: str) -> None:
    from pagedserve.workers.model.tokenizer import load_tokenizer

    try:
        load_tokenizer(path, strict=True)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0]
        raise EngineConfigError(field, f"{first} (remove them to serve token ids only)") from None


def _checkpoint_dtype(hf_config: Any) -> str:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


def _shape(hf_config: Any, dtype: str, checkpoint_dtype: str) -> ModelShape:
    from pagedserve.workers.model.loader import context_length

    text = hf_config.get_text_config()
    num_heads = text.num_attention_heads
    name = str(dtype).removeprefix("torch.").lower()
    return ModelShape(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        dtype=checkpoint_dtype if name == AUTO_DTYPE else DTYPE_NAMES[name],
        context=context_length(text),
    )


def check_kv_budget(config: EngineConfig, shape: ModelShape) -> None:
    """The pool holds at least one block (`engine.sizing.num_kv_blocks`'s arithmetic). A
    CUDA pool's default budget is a share of the device's free memory, known only there."""
    if config.num_kv_blocks is not None:
        return
    budget = config.kv_cache_bytes
    if budget is None and config.device.startswith("cuda"):
        return
    budget = DEFAULT_CPU_KV_CACHE_BYTES if budget is None else budget
    if config.kv_cache_dtype != AUTO_DTYPE:  # 8-bit codes; the scales are counted apart
        shape = dataclasses.replace(shape, dtype="float8_e4m3fn")
    block_bytes = shape.block_bytes(config.block_size)
    if budget < block_bytes:
        raise EngineConfigError(
            "kv_cache_bytes",
            f"holds no KV block of this model: a block of {config.block_size} tokens takes "
            f"{block_bytes} bytes ({shape.num_layers} layers x {shape.num_kv_heads} KV heads "
            f"x {shape.head_dim} x K and V x {shape.dtype}); give at least {block_bytes}",
        )


def check_lengths(config: EngineConfig, shape: ModelShape) -> None:
    """`max_model_len` and `block_size` within the model's context; a whole sequence fits
    one step when prefills are not chunked (the engine's own rule)."""
    if config.max_model_len is not None and config.max_model_len > shape.context:
        raise EngineConfigError(
            "max_model_len", f"is longer than the model's context ({shape.context} tokens)"
        )
    if config.block_size > shape.context:
        raise EngineConfigError(
            "block_size", f"is longer than the model's context ({shape.context} tokens)"
        )
    max_model_len = min(config.max_model_len or shape.context, shape.context)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise EngineConfigError(
            "max_num_batched_tokens",
            f"must be >= max_model_len ({max_model_len}) when chunked prefill is off",
        )


def check_writable_dir(path: str, field: str) -> None:
    """`path` is a directory this process may write, or can be created as one."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise EngineConfigError(field, f"{probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise EngineConfigError(field, f"{probe} is not writable")
