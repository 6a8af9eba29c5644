"""Load the model a worker serves: a built-in model, a local HF checkpoint or a GGUF file.

``model.registry.resolve_model`` says what a name means (and converts GGUF files once into a
cached checkpoint). Nothing here ever downloads: checkpoints are read with
``local_files_only=True``. The result is a
``LoadedModel`` that carries the model, its tokenizer (if any) and the few architecture numbers
the KV cache and the engine need, so nobody else has to dig through HF configs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.workers.engine.config import AUTO_DTYPE, DTYPE_NAMES
from pagedserve.workers.model.registry import resolve_model
from pagedserve.workers.model.tiny_llama import TINY_LLAMA_NAME, build_tiny_llama
from pagedserve.workers.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()
}
# "auto": the checkpoint's own dtype (float32 for tiny-llama).
_AUTO = AUTO_DTYPE


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve, with its tokenizer and the architecture numbers the pool needs.

    ``device`` is where the model's weights are: the device a one-process engine serves on,
    the host for a tensor-parallel engine's rank 0 (which serves on its own device,
    `engine.sizing.serving_device`), ``meta`` once `release_weights` dropped them.
    """

    model: PreTrainedModel
    tokenizer: Tokenizer | None
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device


def load_model(
    model: str | None = None,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Load ``model`` onto ``device`` in eval mode.

    Args:
        model: a built-in name (``smollm2-135m``, the default when ``None``; ``tiny-llama``), a
            local HF checkpoint directory or a ``.gguf`` file (Llama, Qwen2, Mistral and other
            decoders using HF's attention interface).
        dtype: ``float32``, ``float16``, ``bfloat16`` (or ``fp32``/``fp16``/``bf16``/``half``), or
            ``auto`` for the checkpoint's own dtype.
        device: where the weights go.
        seed: weight seed of ``tiny-llama`` (ignored for checkpoints).

    Returns:
        The ``LoadedModel``.

    Raises:
        ValueError: unknown dtype, or ``model`` names nothing loadable (see ``resolve_model``),
            or the directory holds no loadable checkpoint.
    """
    torch_dtype = _resolve_dtype(dtype)
    device = torch.device(device)
    if model is not None and not isinstance(model, str | os.PathLike):
        raise ValueError(f"model must be a name or a path, got {model!r}")
    source = resolve_model(model)
    if source.path is None:
        hf_model = build_tiny_llama(seed, torch_dtype or torch.float32)
        name, tokenizer = TINY_LLAMA_NAME, ByteTokenizer()
    else:
        hf_model = _load_checkpoint(source.path, torch_dtype)
        name, tokenizer = source.name, load_tokenizer(source.path)
    hf_model = hf_model.to(device).eval()
    return _describe(hf_model, tokenizer, name, device)


def release_weights(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` without its weights: every parameter and buffer of its model moves to the
    ``meta`` device (shape and dtype kept, storage freed once nothing else holds it). The
    config, tokenizer and numbers stay; the model can no longer run (its ``device`` says
    ``meta``). A tensor-parallel rank 0 calls this once it has sliced every rank's shard."""
    loaded.model.to(torch.device("meta"))
    return dataclasses.replace(loaded, device=torch.device("meta"))


def _resolve_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype named by ``dtype``; ``None`` for ``auto``."""
    name = str(dtype).removeprefix("torch.").lower()
    if name == _AUTO:
        return None
    if name not in _DTYPES:
        known = ", ".join([*_DTYPES, _AUTO])
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of: {known}")
    return _DTYPES[name]


def _load_checkpoint(path: str, torch_dtype: torch.dtype | None) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            dtype=torch_dtype if torch_dtype is not None else _AUTO,
            attn_implementation="sdpa",
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load a causal LM checkpoint from {path!r}: {exc}") from exc


def _describe(
    model: PreTrainedModel, tokenizer: Tokenizer | None, name: str, device: torch.device
) -> LoadedModel:
    config = model.config.get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        max_model_len=context_length(config),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        dtype=model.dtype,
        device=device,
    )


def context_length(config: Any) -> int:
    """Longest context served: the position limit, capped by a sliding window if one is used.

    Paged attention here is full causal attention; it equals sliding-window attention only while
    the context fits in the window.
    """
    max_len = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    # Mistral-style configs have no layer_types and slide in every layer; Qwen2-style ones list
    # which layers slide (and set sliding_window=None when none do).
    if window and (layer_types is None or "sliding_attention" in layer_types):
        max_len = min(max_len, int(window))
    return max_len


def _eos_token_ids(model: PreTrainedModel, tokenizer: Tokenizer | None) -> frozenset[int]:
    """Every id that ends generation: from the config, the generation config and the tokenizer."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (model.config.get_text_config(), generation_config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)
