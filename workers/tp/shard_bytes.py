"""How many bytes of weights one rank of a tensor-parallel group holds, counted from the loaded
model's shapes without slicing anything (pool sizing needs it before the shards exist).

It counts exactly what `sharded_decoder.slice_weights` copies out for the rank (its rows of
q/k/v, gate/up and the LM head, its columns of o and down, the replicated embedding and norms,
rank 0's row-parallel biases), less the rotary table (a few KiB).
"""

from __future__ import annotations

from torch import Tensor, nn

from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.tp.shards import TPShard, plan_shards


def model_shards(loaded: LoadedModel, size: int) -> list[TPShard]:
    """Every rank's `TPShard` of ``loaded`` split ``size`` ways (`shards.plan_shards`)."""
    config = loaded.model.config.get_text_config()
    return plan_shards(
        size,
        num_heads=loaded.num_heads,
        num_kv_heads=loaded.num_kv_heads,
        intermediate=int(config.intermediate_size),
        vocab=loaded.vocab_size,
    )


def shard_weight_bytes(model: nn.Module, shard: TPShard, head_dim: int) -> int:
    """Bytes of the weights `slice_weights(model, shard, head_dim)` gives rank ``shard.rank``
    (the model's parameters may already be on ``meta``: only shapes are read)."""
    decoder = model.model
    total = _bytes(decoder.embed_tokens.weight) + _bytes(decoder.norm.weight)
    total += _rows(model.lm_head.weight, _length(shard.vocab))
    return total + sum(_layer_bytes(layer, shard, head_dim) for layer in decoder.layers)


def _layer_bytes(layer: nn.Module, shard: TPShard, head_dim: int) -> int:
    attention, mlp = layer.self_attn, layer.mlp
    q_rows, kv_rows = shard.num_q_heads * head_dim, shard.num_kv_heads * head_dim
    inter = _length(shard.intermediate)
    column_parallel = (
        (attention.q_proj, q_rows),
        (attention.k_proj, kv_rows),
        (attention.v_proj, kv_rows),
        (mlp.gate_proj, inter),
        (mlp.up_proj, inter),
    )
    total = _bytes(layer.input_layernorm.weight) + _bytes(layer.post_attention_layernorm.weight)
    for linear, rows in column_parallel:
        total += _rows(linear.weight, rows) + _rows(linear.bias, rows)
    for linear, columns in ((attention.o_proj, q_rows), (mlp.down_proj, inter)):
        weight = linear.weight
        total += weight.shape[0] * columns * weight.element_size()
        if shard.rank == 0:  # the row-parallel biases live on rank 0 only
            total += _bytes(linear.bias)
    return total


def _rows(tensor: Tensor | None, rows: int) -> int:
    if tensor is None:
        return 0
    per_row = tensor.numel() // tensor.shape[0]
    return rows * per_row * tensor.element_size()


def _bytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _length(span: tuple[int, int]) -> int:
    return span[1] - span[0]
