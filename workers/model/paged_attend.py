"""One layer's paged attention: store the step's new K/V in the pool, then attend to it.

Shared by both forward paths (``FusedDecoder`` and HF's modules through ``ModelRunner``), so
the choice between the decode-only kernel and the prefill kernel is made in one place.
"""

from __future__ import annotations

from torch import Tensor

from pagedserve.kernels import KernelOps
from pagedserve.workers.model.attention_metadata import AttentionMetadata


def write_and_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    metadata: AttentionMetadata,
    ops: KernelOps,
    scale: float,
) -> Tensor:
    """``[T, heads, D]`` attention of each new query (``q``/``k``/``v`` token-major, last dim
    unit-stride) to its sequence's whole context, after writing ``k``/``v`` at
    ``metadata.slot_mapping``."""
    ops.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
    if metadata.is_decode_only:
        return ops.paged_decode_attention(
            q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, scale
        )
    return ops.paged_prefill_attention(
        q,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale,
    )
