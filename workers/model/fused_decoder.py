"""A fused forward pass for Llama-style decoders (Llama, Mistral, Qwen2) over the paged pool.

HF's modelling code runs every projection as its own matmul and every module as its own Python
call, and hands attention its tensors in the ``[1, heads, T, D]`` layout that the paged kernels
then transpose back. For the decoders whose layers are exactly

    x += o_proj(attention(rope(q_proj(norm(x))), rope(k_proj(...)), v_proj(...)))
    x += down_proj(silu(gate_proj(norm(x))) * up_proj(norm(x)))

this module runs the same arithmetic with q/k/v as one matmul and gate/up as one, in the
kernels' token-major ``[T, heads, D]`` layout, with no module dispatch per layer. Every
elementwise operation is HF's own, in HF's order (RMSNorm in float32 then back, RoPE from the
model's own rotary module, ``residual + update``) and each fused matmul's output column comes
from the same weights and inputs as the separate matmul's, so logits match HF's forward to
float rounding (the tests hold them to 1e-4, and greedy ids equal HF's).

The fused weights are the model's own storage: q/k/v (and gate/up) are concatenated once and
the HF linears' weights become views into the concatenation, so no weight is held twice and the
HF modules keep working. With the `onednn` linear backend (`cpu_linear`) each projection also
holds a copy packed into oneDNN's layout, which its matmuls read instead; with `gguf`, a
projection whose weights are GGUF block codes holds those codes (`gguf_blocks.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.kernels import KernelOps
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.cpu_linear import Projection
from pagedserve.workers.model.paged_attend import write_and_attend

if TYPE_CHECKING:
    from pagedserve.workers.lora.batch import LoraBatch

# HF ``model_type``s whose decoder layers are the plain pre-norm Llama block (no QK-norm, no
# logit soft-capping, no sliding window inside the context we serve).
FUSABLE_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights, with q/k/v and gate/up each concatenated along rows."""

    input_norm: Tensor
    qkv: Projection
    o: Projection
    post_norm: Tensor
    gate_up: Projection
    down: Projection


class FusedDecoder:
    """The forward pass of a fusable HF causal LM, reading and writing the paged pool."""

    def __init__(
        self,
        model: nn.Module,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        linear_backend: str = "torch",
    ):
        """Fuse ``model``'s projections in place (its linears become views of the fused weights).

        Args:
            linear_backend: a resolved `cpu_linear` backend, `torch`, `onednn` or `gguf`.

        Raises:
            ValueError: the model is not one ``fusable`` accepts.
        """
        reason = unfusable_reason(model)
        if reason is not None:
            raise ValueError(f"cannot fuse {type(model).__name__}: {reason}")
        decoder = model.model
        config = model.config.get_text_config()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eps = float(config.rms_norm_eps)
        self.embed = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.lm_head = Projection.of(model.lm_head.weight, None, linear_backend)
        self.layers = [_fuse_layer(layer, linear_backend) for layer in decoder.layers]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self._qkv_split = (q_size, kv_size, kv_size)
        self._intermediate = int(config.intermediate_size)
        self._scale = head_dim**-0.5

    def projections(self) -> list[Projection]:
        """Every projection: each layer's q/k/v, o, gate/up and down, then the LM head."""
        per_layer = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in self.layers]
        return [projection for four in per_layer for projection in four] + [self.lm_head]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        ops: KernelOps,
        logits_indices: Tensor,
    ) -> Tensor:
        """Logits ``[S', vocab]`` (the model's dtype) of the packed rows ``logits_indices``."""
        hidden = self.hidden_states(input_ids, positions, metadata, kv_cache, ops)
        return self.logits(hidden, logits_indices)

    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> Tensor:
        """``[T, hidden]``: the last layer's output for every packed row, before the final
        norm (after storing every layer's new K/V). With ``lora``, each token's adapter adds
        its update after each projection it targets (`workers/lora/batch.py`)."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden.unsqueeze(0), positions.unsqueeze(0))
        # [1, T, D] -> [T, 1, D]: broadcast over the heads of the token-major layout.
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        for index, layer in enumerate(self.layers):
            attended = self._attend(
                _rms_norm(hidden, layer.input_norm, self.eps),
                layer,
                cos,
                sin,
                kv_cache.key_caches[index],
                kv_cache.value_caches[index],
                metadata,
                ops,
                lora,
                index,
            )
            attention_out = layer.o(attended)
            if lora is not None:
                lora.add(index, "o", attended, attention_out)
            hidden = hidden + attention_out
            normed = _rms_norm(hidden, layer.post_norm, self.eps)
            gate_up = layer.gate_up(normed)
            if lora is not None:
                lora.add(index, "gate_up", normed, gate_up)
            gate, up = gate_up.split(self._intermediate, dim=-1)
            activated = F.silu(gate) * up
            mlp_out = layer.down(activated)
            if lora is not None:
                lora.add(index, "down", activated, mlp_out)
            hidden = hidden + mlp_out
        return hidden

    def logits(self, hidden: Tensor, logits_indices: Tensor) -> Tensor:
        """Logits ``[S', vocab]`` of the rows ``logits_indices`` of ``hidden_states``."""
        return self.lm_head(self.normed(hidden, logits_indices))

    def normed(self, hidden: Tensor, indices: Tensor) -> Tensor:
        """``[S', hidden]``: the final norm's output (what the LM head reads) of the rows
        ``indices`` of ``hidden_states``. The norm is per row, so the rows are picked first."""
        return _rms_norm(hidden[indices], self.final_norm, self.eps)

    def _attend(
        self,
        normed: Tensor,
        layer: FusedLayer,
        cos: Tensor,
        sin: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        metadata: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
        index: int = 0,
    ) -> Tensor:
        """``[T, heads * D]``: layer ``index``'s attention output, after storing the new K/V
        (with ``lora``: the adapters' q/k/v updates added first)."""
        tokens = normed.shape[0]
        qkv = layer.qkv(normed)
        if lora is not None:
            lora.add(index, "qkv", normed, qkv)
        q, k, v = qkv.split(self._qkv_split, -1)
        q = _rope(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = _rope(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = write_and_attend(q, k, v, key_cache, value_cache, metadata, ops, self._scale)
        return out.reshape(tokens, self.num_heads * self.head_dim)


def unfusable_reason(model: nn.Module) -> str | None:
    """Why ``FusedDecoder`` cannot run ``model`` (``None`` when it can)."""
    config = model.config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSABLE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(FUSABLE_MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "rotary_emb") or not hasattr(model, "lm_head"):
        return "no model.model.rotary_emb or lm_head"
    if getattr(model.config, "final_logit_softcapping", None):
        return "logit soft-capping"
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(linear) is not nn.Linear for linear in linears):
            return "a projection that is not a plain nn.Linear"
        if any(hasattr(attention, n) for n in ("q_norm", "k_norm")):
            return "QK-norm"
    return None


def _fuse_layer(layer: nn.Module, linear_backend: str) -> FusedLayer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _fuse_rows([attention.q_proj, attention.k_proj, attention.v_proj])
    gate_up_weight, gate_up_bias = _fuse_rows([mlp.gate_proj, mlp.up_proj])
    o_proj, down_proj = attention.o_proj, mlp.down_proj
    return FusedLayer(
        input_norm=layer.input_layernorm.weight,
        qkv=Projection.of(qkv_weight, qkv_bias, linear_backend),
        o=Projection.of(o_proj.weight, o_proj.bias, linear_backend),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=Projection.of(gate_up_weight, gate_up_bias, linear_backend),
        down=Projection.of(down_proj.weight, down_proj.bias, linear_backend),
    )


def _fuse_rows(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) whose rows are the linears' rows in order; each linear's own
    parameters become views into it, so the memory is shared rather than copied."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias.detach() for linear in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("fused projections must all have a bias or none")
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[offset : offset + rows]
        if bias is not None:
            linear.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight, bias


def _rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm, operation for operation."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor in ``[T, heads, D]`` layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
