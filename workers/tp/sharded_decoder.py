"""One rank's slice of a Llama-style decoder's forward (Megatron's split), over its pool shard.

Per layer, with x replicated on every rank:

    q/k/v   column-parallel: rank r computes its query and KV heads only (`TPShard`), writes
            its KV heads into its own pool and attends with them
    o       row-parallel: rank r multiplies its heads' columns; the partial sums are added by
            one all-reduce, so every rank again holds the whole x
    gate/up column-parallel: rank r's intermediate rows
    down    row-parallel, one all-reduce

The embedding is replicated (a lookup costs no compute; a vocabulary-parallel one would add an
all-reduce per step for little memory at these sizes); the LM head is vocabulary-parallel: each
rank scores its vocabulary rows and rank 0 gathers them, the only rank that samples.

Every elementwise operation is `FusedDecoder`'s (HF's, in HF's order); only the sums of the
row-parallel matmuls are taken in another order (rank by rank), so logits equal the k = 1
forward's to float rounding, not bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.kernels import KernelOps
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.cpu_linear import Projection
from pagedserve.workers.model.fused_decoder import _rms_norm, _rope, unfusable_reason
from pagedserve.workers.model.paged_attend import write_and_attend
from pagedserve.workers.tp.collectives import Collectives
from pagedserve.workers.tp.shards import TPShard, split_evenly


@dataclass(frozen=True)
class LayerSlice:
    """One decoder layer's weights on one rank: its rows of q/k/v and gate/up, its columns of o
    and down (their biases on rank 0 only, so the all-reduce adds each once)."""

    input_norm: Tensor
    qkv: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    post_norm: Tensor
    gate_up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]


@dataclass(frozen=True)
class ShardWeights:
    """Everything rank ``shard.rank`` computes with, copied out of the model (rank 0 slices
    the loaded model once and sends each rank its part); no tensor shares storage with the
    model, so its weights can be released once every rank's shard is sliced."""

    shard: TPShard
    head_dim: int
    eps: float
    embed: Tensor
    rotary: nn.Module
    final_norm: Tensor
    lm_head: Tensor
    vocab_size: int
    layers: tuple[LayerSlice, ...]


def slice_weights(model: nn.Module, shard: TPShard, head_dim: int) -> ShardWeights:
    """Rank ``shard.rank``'s copies of ``model``'s weights (`slice_shards` for one rank).

    Raises:
        ValueError: the model is not a Llama-style decoder (`fused_decoder.unfusable_reason`).
    """
    return slice_shards(model, [shard], head_dim)[0]


def slice_shards(
    model: nn.Module,
    shards: Sequence[TPShard],
    head_dim: int,
    *,
    to: Sequence[torch.device] | None = None,
    release: bool = False,
) -> list[ShardWeights]:
    """Every rank's copies of ``model``'s weights, cut layer by layer: rank r's slices go to
    ``to[r]`` (default: where the model is) as soon as they are cut, and with ``release`` each
    layer's own weights are dropped (moved to ``meta``) once every rank has its slice, then the
    rest of the model's: the host then holds about the model once while it is sliced, not
    twice.

    Raises:
        ValueError: the model is not a Llama-style decoder (`fused_decoder.unfusable_reason`).
    """
    reason = unfusable_reason(model)
    if reason is not None:
        raise ValueError(f"tensor parallelism cannot split {type(model).__name__}: {reason}")
    config = model.config.get_text_config()
    decoder = model.model
    places = list(to) if to is not None else [model.lm_head.weight.device] * len(shards)
    layers: list[list[LayerSlice]] = [[] for _ in shards]
    for layer in decoder.layers:
        for cut, shard, place in zip(layers, shards, places, strict=True):
            cut.append(layer_to(_slice_layer(layer, shard, head_dim), place))
        if release:
            layer.to(torch.device("meta"))
    weights = [
        ShardWeights(
            shard=shard,
            head_dim=head_dim,
            eps=float(config.rms_norm_eps),
            embed=decoder.embed_tokens.weight.detach().to(place, copy=True),
            rotary=copy.deepcopy(decoder.rotary_emb).to(place),  # its own: see `release`
            final_norm=decoder.norm.weight.detach().to(place, copy=True),
            lm_head=_rows(model.lm_head.weight, shard.vocab).to(place),
            vocab_size=int(model.lm_head.weight.shape[0]),
            layers=tuple(cut),
        )
        for cut, shard, place in zip(layers, shards, places, strict=True)
    ]
    if release:
        model.to(torch.device("meta"))
    return weights


def layer_to(layer: LayerSlice, device: torch.device) -> LayerSlice:
    """``layer`` with every tensor on ``device`` (the same tensors where they already are)."""

    def move(pair: tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor | None]:
        return pair[0].to(device), None if pair[1] is None else pair[1].to(device)

    return LayerSlice(
        input_norm=layer.input_norm.to(device),
        qkv=move(layer.qkv),
        o=move(layer.o),
        post_norm=layer.post_norm.to(device),
        gate_up=move(layer.gate_up),
        down=move(layer.down),
    )


class ShardedLayer(NamedTuple):
    input_norm: Tensor
    qkv: Projection
    o: Projection
    post_norm: Tensor
    gate_up: Projection
    down: Projection


class ShardedDecoder:
    """Rank ``shard.rank``'s part of the forward; every rank of the group calls it in step."""

    def __init__(
        self, weights: ShardWeights, collectives: Collectives, linear_backend: str = "torch"
    ) -> None:
        """Bind this rank's weights (packing them for oneDNN with that backend) to the group."""
        shard, head_dim = weights.shard, weights.head_dim
        self.shard = shard
        self.collectives = collectives
        self.head_dim = head_dim
        self.eps = weights.eps
        self.embed = weights.embed
        self.rotary = weights.rotary
        self.final_norm = weights.final_norm
        self.vocab_size = weights.vocab_size
        self.lm_head = Projection.of(weights.lm_head, None, linear_backend)
        self.layers = [
            ShardedLayer(
                layer.input_norm,
                Projection.of(*layer.qkv, linear_backend),
                Projection.of(*layer.o, linear_backend),
                layer.post_norm,
                Projection.of(*layer.gate_up, linear_backend),
                Projection.of(*layer.down, linear_backend),
            )
            for layer in weights.layers
        ]
        self._qkv_split = (
            shard.num_q_heads * head_dim,
            shard.num_kv_heads * head_dim,
            shard.num_kv_heads * head_dim,
        )
        self._intermediate = shard.intermediate[1] - shard.intermediate[0]
        self._scale = head_dim**-0.5

    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        key_caches: list[Tensor],
        value_caches: list[Tensor],
        ops: KernelOps,
    ) -> Tensor:
        """``[T, hidden]``, the same on every rank: the last layer's output before the final
        norm, after storing this rank's KV heads of every layer in its pool."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(hidden.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        for index, layer in enumerate(self.layers):
            normed = _rms_norm(hidden, layer.input_norm, self.eps)
            attended = self._attend(
                normed, layer, cos, sin, key_caches[index], value_caches[index], metadata, ops
            )
            hidden = hidden + self.collectives.all_reduce(layer.o(attended))
            normed = _rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = layer.gate_up(normed).split(self._intermediate, dim=-1)
            hidden = hidden + self.collectives.all_reduce(layer.down(F.silu(gate) * up))
        return hidden

    def logits(self, hidden: Tensor, logits_indices: Tensor) -> Tensor | None:
        """On rank 0 ``[S', vocab]`` logits of the rows ``logits_indices``; None elsewhere.
        Every rank scores its vocabulary rows; rank 0 gathers them."""
        normed = self.normed(hidden, logits_indices)
        part = self.lm_head(normed)
        # gather needs one shape: pad every part to the widest (the first ranks' rows).
        widest = -(-self.vocab_size // self.shard.size)
        if part.shape[1] < widest:
            part = F.pad(part, (0, widest - part.shape[1]))
        parts = self.collectives.gather(part)
        if parts is None:
            return None
        ranges = split_evenly(self.vocab_size, self.shard.size)
        pieces = [
            piece[:, : stop - start] for piece, (start, stop) in zip(parts, ranges, strict=True)
        ]
        return torch.cat(pieces, dim=1)

    def normed(self, hidden: Tensor, indices: Tensor) -> Tensor:
        """``[S', hidden]`` final-norm output of the rows ``indices`` (what the LM head reads)."""
        return _rms_norm(hidden[indices], self.final_norm, self.eps)

    def _attend(
        self,
        normed: Tensor,
        layer: ShardedLayer,
        cos: Tensor,
        sin: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        metadata: AttentionMetadata,
        ops: KernelOps,
    ) -> Tensor:
        tokens, shard, dim = normed.shape[0], self.shard, self.head_dim
        q, k, v = layer.qkv(normed).split(self._qkv_split, -1)
        q = _rope(q.view(tokens, shard.num_q_heads, dim), cos, sin)
        k = _rope(k.view(tokens, shard.num_kv_heads, dim), cos, sin)
        v = v.reshape(tokens, shard.num_kv_heads, dim)
        out = write_and_attend(q, k, v, key_cache, value_cache, metadata, ops, self._scale)
        return out.reshape(tokens, shard.num_q_heads * dim)


def _rows(weight: Tensor, span: tuple[int, int]) -> Tensor:
    return weight.detach()[span[0] : span[1]].clone()


def _columns(weight: Tensor, span: tuple[int, int]) -> Tensor:
    return weight.detach()[:, span[0] : span[1]].contiguous().clone()


def _bias_rows(linear: nn.Linear, span: tuple[int, int]) -> Tensor | None:
    return None if linear.bias is None else linear.bias.detach()[span[0] : span[1]].clone()


def _slice_layer(layer: nn.Module, shard: TPShard, head_dim: int) -> LayerSlice:
    attention, mlp = layer.self_attn, layer.mlp
    q_rows = (shard.q_heads[0] * head_dim, shard.q_heads[1] * head_dim)
    kv_rows = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    spans = ((attention.q_proj, q_rows), (attention.k_proj, kv_rows), (attention.v_proj, kv_rows))
    qkv = torch.cat([_rows(linear.weight, span) for linear, span in spans])
    qkv_biases = [_bias_rows(linear, span) for linear, span in spans]
    qkv_bias = None if qkv_biases[0] is None else torch.cat(qkv_biases)
    inter = shard.intermediate
    gate_up = torch.cat([_rows(mlp.gate_proj.weight, inter), _rows(mlp.up_proj.weight, inter)])
    gate_up_biases = [_bias_rows(mlp.gate_proj, inter), _bias_rows(mlp.up_proj, inter)]
    gate_up_bias = None if gate_up_biases[0] is None else torch.cat(gate_up_biases)
    return LayerSlice(
        input_norm=layer.input_layernorm.weight.detach().clone(),
        qkv=(qkv, qkv_bias),
        o=(_columns(attention.o_proj.weight, q_rows), _first_rank_bias(attention.o_proj, shard)),
        post_norm=layer.post_attention_layernorm.weight.detach().clone(),
        gate_up=(gate_up, gate_up_bias),
        down=(_columns(mlp.down_proj.weight, inter), _first_rank_bias(mlp.down_proj, shard)),
    )


def _first_rank_bias(linear: nn.Linear, shard: TPShard) -> Tensor | None:
    """A row-parallel layer's bias, on rank 0 only: the all-reduce then adds it once."""
    if linear.bias is None or shard.rank != 0:
        return None
    return linear.bias.detach().clone()
