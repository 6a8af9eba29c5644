"""Run one forward step of an HF model over a packed batch, with attention on the paged pool.

The model keeps HF's own modelling code; only its attention function is swapped (through
transformers' ``AttentionInterface``) for ``paged_attention_forward``, which per layer:

    1. writes this step's new K/V into the pool at ``slot_mapping``;
    2. attends each new query to its sequence's whole context, read through ``block_tables``.

Llama-style decoders (Llama, Mistral, Qwen2) skip HF's module stack altogether: they run through
``FusedDecoder`` (q/k/v and gate/up as one matmul each, the kernels' token-major layout, HF's
arithmetic), which matches HF's forward and is the faster path on the CPU (bench/README.md; not
yet measured on a GPU). Other models keep HF's modelling code with the attention function
swapped.

The packed batch goes in as one "sample" of T tokens (``[1, T]`` ids and per-token position ids),
so HF sees no padding and builds no mask; everything attention needs travels explicitly in a
``PagedAttentionContext`` keyword argument (no module-level state).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from pagedserve.kernels import KernelOps
from pagedserve.kernels.kv_quant import KV8_DTYPES
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.cpu_linear import describe_block_codes, resolve_linear_backend
from pagedserve.workers.model.fused_decoder import FusedDecoder, unfusable_reason
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.model.paged_attend import write_and_attend

if TYPE_CHECKING:
    from pagedserve.workers.lora.batch import LoraBatch

logger = logging.getLogger(__name__)

PAGED_ATTENTION_NAME = "pagedserve_paged"
# The keyword argument that carries the context from ``model(...)`` down to every layer.
CONTEXT_KWARG = "paged_context"


class PagedAttentionContext(NamedTuple):
    """Everything ``paged_attention_forward`` needs beyond what HF passes it."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    ops: KernelOps


def paged_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention function over the paged pool (registered as ``pagedserve_paged``).

    Args:
        module: the attention module; ``module.layer_idx`` picks the pool layer.
        query: ``[1, H, T, D]`` after RoPE.
        key: ``[1, Hkv, T, D]`` after RoPE.
        value: ``[1, Hkv, T, D]``.
        attention_mask: ignored (``None`` here): causality and sequence boundaries come from
            the metadata.
        scaling: softmax scale; ``head_dim ** -0.5`` when not given.
        dropout: must be 0 (inference only).
        **kwargs: must hold ``paged_context``; others (e.g. ``sliding_window``) are ignored, as
            the loader caps the context at the window.

    Returns:
        ``([1, T, H, D] attention output, None)``.
    """
    context: PagedAttentionContext | None = kwargs.get(CONTEXT_KWARG)
    if context is None:
        raise RuntimeError(f"{PAGED_ATTENTION_NAME} attention needs the {CONTEXT_KWARG} kwarg")
    metadata, kv_cache, ops = context
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # [1, heads, T, D] -> [T, heads, D], the kernels' token-major layout.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    key_cache = kv_cache.key_caches[module.layer_idx]
    value_cache = kv_cache.value_caches[module.layer_idx]
    out = write_and_attend(q, k, v, key_cache, value_cache, metadata, ops, scaling)
    return out.unsqueeze(0), None


class ModelRunner:
    """Owns the forward pass of one worker's model over its paged KV pool.

    Switches ``loaded.model`` to paged attention for good: that model object then only works
    through this runner (build a separate copy for reference forwards).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        ops: KernelOps,
        *,
        fuse: bool = True,
        linear_backend: str = "auto",
    ) -> None:
        """Bind the model to the pool.

        Args:
            fuse: run a fusable model through ``FusedDecoder`` (False: always HF's modules).
            linear_backend: the fused decoder's projections (`EngineConfig.linear_backend`).

        Raises:
            ValueError: the pool does not fit the model, or the model's code does not go
                through HF's attention interface.
        """
        _check_pool_fits(loaded, kv_cache)
        self.loaded = loaded
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.ops = ops
        # Registration is global but idempotent: it maps a name to a pure function.
        AttentionInterface.register(PAGED_ATTENTION_NAME, paged_attention_forward)
        self.model.set_attn_implementation(PAGED_ATTENTION_NAME)
        if self.model.config._attn_implementation != PAGED_ATTENTION_NAME:
            raise ValueError(
                f"model {loaded.name!r} ({type(self.model).__name__}) does not support "
                "custom attention functions (transformers' AttentionInterface)"
            )
        backend = resolve_linear_backend(linear_backend, loaded.device, loaded.dtype)
        self.fused: FusedDecoder | None = None
        if fuse and unfusable_reason(self.model) is None:
            self.fused = FusedDecoder(
                self.model, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, backend
            )
            if backend == "gguf":
                logger.info("%s: %s", loaded.name, describe_block_codes(self.fused.projections()))

    @torch.inference_mode()
    def execute(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """Run one step: store the new tokens' K/V and return logits for the rows asked for.

        Args:
            input_ids: ``[T]`` int64 packed new tokens of all sequences.
            positions: ``[T]`` int64 position of each token in its sequence.
            metadata: where each sequence's KV lives (and goes) in the pool.
            logits_indices: ``[S']`` int64 rows of the packed batch whose logits are wanted
                (typically the last new token of each sequence that samples this step).

        Returns:
            ``[S', vocab]`` float32 logits, on the model's device.
        """
        return self.execute_pooling(input_ids, positions, metadata, logits_indices, None)[0]

    @torch.inference_mode()
    def execute_pooling(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        logits_indices: Tensor,
        hidden_indices: Tensor | None,
        lora: LoraBatch | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`execute`, and the final hidden states of the rows ``hidden_indices`` (embedding
        requests pool them: `workers/engine/pooling.py`); ``lora``: each token's LoRA adapter
        (`workers/lora/`; the fused decoder only).

        Returns:
            ``[S', vocab]`` float32 logits, and ``[H', hidden]`` hidden states after the final
            norm (what the LM head reads; the model's dtype), or None without
            ``hidden_indices``.
        """
        _check_inputs(input_ids, positions, metadata, logits_indices)
        device = self.loaded.device
        metadata = metadata.to(device, non_blocking=True)
        hidden_rows = None if hidden_indices is None else hidden_indices.to(device)
        if self.fused is not None:
            hidden = self.fused.hidden_states(
                input_ids.to(device, non_blocking=True),
                positions.to(device, non_blocking=True),
                metadata,
                self.kv_cache,
                self.ops,
                lora,
            )
            logits = self.fused.logits(hidden, logits_indices.to(device, non_blocking=True))
            pooled = None if hidden_rows is None else self.fused.normed(hidden, hidden_rows)
            return logits.float(), pooled
        if lora is not None:
            raise ValueError(f"LoRA adapters need a fusable model: {unfusable_reason(self.model)}")
        context = PagedAttentionContext(metadata, self.kv_cache, self.ops)
        # logits_to_keep selects the rows before lm_head, so the full [T, vocab] is never made;
        # going through the CausalLM forward keeps any model-specific logit post-processing.
        output = self.model(
            input_ids=input_ids.to(device, non_blocking=True).unsqueeze(0),
            position_ids=positions.to(device, non_blocking=True).unsqueeze(0),
            use_cache=False,
            logits_to_keep=logits_indices.to(device, non_blocking=True),
            output_hidden_states=hidden_rows is not None,
            **{CONTEXT_KWARG: context},
        )
        # HF's last hidden state is the final norm's output (transformers ties it so).
        pooled = None if hidden_rows is None else output.hidden_states[-1][0][hidden_rows]
        return output.logits[0].float(), pooled

    def close(self) -> None:
        """Nothing to release (a tensor-parallel runner stops its ranks here)."""


def _check_pool_fits(loaded: LoadedModel, kv_cache: KVCache) -> None:
    expected = {
        "num_layers": loaded.num_layers,
        "num_kv_heads": loaded.num_kv_heads,
        "head_dim": loaded.head_dim,
        "dtype": loaded.dtype,
        "device": loaded.device,
    }
    for name, want in expected.items():
        have = getattr(kv_cache, name)
        if name == "device":
            have, want = _canonical_device(have), _canonical_device(want)
        if name == "dtype" and have in KV8_DTYPES:
            continue  # an 8-bit pool (`kv_cache_dtype`): the kernels dequantise it
        if have != want:
            raise ValueError(f"KV cache {name} {have} does not match model {loaded.name!r}: {want}")


def _canonical_device(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` name the same device when 0 is current."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_inputs(
    input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata, logits_indices: Tensor
) -> None:
    """Shape and dtype checks at the boundary (no device sync)."""
    if input_ids.ndim != 1 or input_ids.dtype != torch.int64:
        raise ValueError(
            f"input_ids must be [T] int64, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    if positions.shape != input_ids.shape or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be [T={input_ids.shape[0]}] int64, "
            f"got {tuple(positions.shape)} {positions.dtype}"
        )
    if logits_indices.ndim != 1 or logits_indices.dtype != torch.int64:
        raise ValueError(
            f"logits_indices must be [S'] int64, got {tuple(logits_indices.shape)} "
            f"{logits_indices.dtype}"
        )
    metadata.validate()
    if metadata.num_tokens != input_ids.shape[0]:
        raise ValueError(
            f"slot_mapping has {metadata.num_tokens} slots for {input_ids.shape[0]} tokens"
        )
