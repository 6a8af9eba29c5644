"""Plain-torch references for every paged-KV kernel, with the Triton kernels' signatures.

They are the ground truth the Triton and C++ CPU kernels are tested against, and the CPU
backend where the C++ one cannot be built, so they are vectorised where it is cheap (one gather
of the block table per call or per sequence, then scaled-dot-product attention in float32)
rather than written token by token.

The pool layout, per layer::

    key_cache[num_blocks, block_size, num_kv_heads, head_dim]      (value_cache alike)
    token at position p of a sequence lives in block block_tables[seq, p // block_size],
    row p % block_size; its flat "slot" is block_id * block_size + p % block_size.

Query head h reads KV head h // (num_heads // num_kv_heads), as in HF's `repeat_kv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels._checks import (
    check_block_mapping,
    check_cache_lists,
    check_decode,
    check_index,
    check_packed,
    check_prefill,
    check_write_kv,
)
from pagedserve.kernels.kv_quant import as_bytes, dequantise_rows, is_quantised, quantise_rows

# Decode gathers the KV of a group of sequences at once; this bounds the gathered tokens
# (num_seqs_in_group * longest_context) so a big batch does not materialise the whole pool.
_DECODE_GATHER_TOKENS = 1 << 16


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the K and V of N new tokens into the pool, in place.

    Args:
        key: `[N, num_kv_heads, head_dim]` new keys.
        value: `[N, num_kv_heads, head_dim]` new values.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` pool, written in place.
        value_cache: same shape as `key_cache`.
        slot_mapping: `[N]` int32/int64 flat slots (`block_id * block_size + offset`); a slot
            of -1 skips that token (padding).

    An 8-bit pool (fp8 or int8, `kv_quant`) gets each (token, head) row quantised with its own
    scale.
    """
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if is_quantised(key_cache):
        key = quantise_rows(key, key_cache.dtype)
        value = quantise_rows(value, key_cache.dtype)
    as_bytes(key_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(key))
    as_bytes(value_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(value))


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Gather `[num_seqs, max_len, num_kv_heads, head_dim]` tokens of a pool by block table.

    Table entries past a sequence's last block may be garbage (padding); they are replaced by
    block 0 before indexing and the tokens they yield are masked out by the caller. The rows of
    an 8-bit pool come back dequantised to float32 (`[..., head_dim]`).
    """
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks = -(-max_len // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns but a context of {max_len} "
            f"tokens needs {num_blocks} blocks of {block_size}"
        )
    table = block_tables[:, :num_blocks].long()
    needed = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(num_blocks, device=table.device)
    table = torch.where(cols[None, :] < needed[:, None], table, torch.zeros_like(table))
    tokens = cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    tokens = tokens[:, :max_len]
    # An 8-bit pool: only the gathered rows are dequantised, never the pool.
    return dequantise_rows(tokens) if is_quantised(cache) else tokens


def _sdpa_fp32(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention in float32 over `[batch, heads, len, dim]` tensors; GQA via `enable_gqa`.

    Args:
        mask: boolean, True where a query may attend to a key (broadcast to the scores).
    """
    return F.scaled_dot_product_attention(
        query.float(),
        key.float(),
        value.float(),
        attn_mask=mask,
        scale=float(scale),
        enable_gqa=query.shape[1] != key.shape[1],
    )


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its cached context.

    Args:
        query: `[S, num_heads, head_dim]`, one token per sequence.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` pool.
        value_cache: same shape as `key_cache`.
        block_tables: `[S, max_blocks]` int32 block ids of each sequence, in order.
        seq_lens: `[S]` int32 context lengths, including the query token (whose K/V is
            already in the pool). A length of 0 yields a zero output row.
        scale: softmax scale, usually `head_dim ** -0.5`.

    Returns:
        `[S, num_heads, head_dim]` in the query's dtype.
    """
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    num_seqs = query.shape[0]
    out = torch.zeros_like(query)
    lens = seq_lens.tolist()
    start = 0
    while start < num_seqs:
        # Grow the group while the padded gather stays within budget (always >= 1 sequence).
        stop, longest = start + 1, max(lens[start], 1)
        while stop < num_seqs and (stop + 1 - start) * max(longest, lens[stop]) <= (
            _DECODE_GATHER_TOKENS
        ):
            longest = max(longest, lens[stop])
            stop += 1
        _decode_group(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out, start, stop
        )
        start = stop
    return out


def _decode_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    start: int,
    stop: int,
) -> None:
    """Decode attention for sequences `start:stop`, written into `out[start:stop]`."""
    lens = seq_lens[start:stop]
    max_len = int(lens.max())
    if max_len <= 0:
        return
    tables = block_tables[start:stop]
    keys = _gather_context(key_cache, tables, lens, max_len).transpose(1, 2)
    values = _gather_context(value_cache, tables, lens, max_len).transpose(1, 2)
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < lens.long()[:, None])[:, None, None, :]  # [s, 1, 1, len]
    q = query[start:stop].unsqueeze(2)  # [s, heads, 1, dim]
    attn = _sdpa_fp32(q, keys, values, mask, scale).squeeze(2)
    # A zero-length sequence has every key masked, which SDPA turns into NaN: zero it.
    attn = torch.where((lens > 0)[:, None, None], attn, torch.zeros_like(attn))
    out[start:stop] = attn.to(out.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed variable-length new tokens over cache plus themselves.

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]` (`q_len_i` of them);
    they are its last `q_len_i` positions, `seq_lens[i] - q_len_i ... seq_lens[i] - 1`, and
    their K/V are already in the pool. A query at position p attends to positions <= p. This
    one call covers plain prefill (no cached prefix), chunked prefill and prefix-cache hits
    (a cached prefix) and decodes (`q_len_i == 1`), mixed in one batch.

    Args:
        query: `[T, num_heads, head_dim]` packed new tokens.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` pool.
        value_cache: same shape as `key_cache`.
        block_tables: `[S, max_blocks]` int32 block ids of each sequence.
        query_start_loc: `[S + 1]` int32 cumulative query offsets, starting at 0.
        seq_lens: `[S]` int32 full context length of each sequence, new tokens included.
        scale: softmax scale.

    Returns:
        `[T, num_heads, head_dim]` in the query's dtype (rows past `query_start_loc[-1]`
        are zero).
    """
    check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[-1] > query.shape[0]:
        raise ValueError(f"query_start_loc ends at {starts[-1]} > query tokens {query.shape[0]}")
    for seq, ctx_len in enumerate(lens):
        prefill_one_sequence(
            query, key_cache, value_cache, block_tables, seq, starts, ctx_len, scale, out
        )
    return out


def prefill_one_sequence(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq: int,
    starts: list[int],
    ctx_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Prefill attention of sequence `seq` (rows `starts[seq]:starts[seq + 1]`) into `out`:
    its context gathered once, then one SDPA call with a bottom-right causal mask."""
    q_start, q_end = starts[seq], starts[seq + 1]
    q_len = q_end - q_start
    if q_len <= 0:
        return
    if q_len > ctx_len:
        raise ValueError(f"sequence {seq}: {q_len} new tokens exceed seq_lens[{seq}] = {ctx_len}")
    table = block_tables[seq : seq + 1]
    length = torch.tensor([ctx_len], device=query.device)
    keys = _gather_context(key_cache, table, length, ctx_len).transpose(1, 2)
    values = _gather_context(value_cache, table, length, ctx_len).transpose(1, 2)
    # Bottom-right aligned causal mask: the new tokens are the last q_len positions.
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
    k_pos = torch.arange(ctx_len, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
    attn = _sdpa_fp32(q, keys, values, mask, scale)
    out[q_start:q_end] = attn[0].transpose(0, 1).to(out.dtype)


def copy_blocks_ref(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks `src -> dst` in every layer's K and V pool (copy-on-write).

    Args:
        key_caches: one `[num_blocks, block_size, num_kv_heads, head_dim]` pool per layer.
        value_caches: same, for values.
        block_mapping: `[P, 2]` int64 (src, dst) pairs, on any device. A dst must not appear
            twice nor as another pair's src (the Triton kernel copies pairs in parallel).
    """
    check_cache_lists(key_caches, value_caches)
    check_block_mapping(block_mapping)
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.to(device=key_caches[0].device, dtype=torch.long)
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache = as_bytes(cache)
        cache.index_copy_(0, dst, cache.index_select(0, src))


def gather_blocks_ref(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
) -> torch.Tensor:
    """Pack blocks of every layer into one contiguous tensor (for swap-out or migration).

    Args:
        key_caches: one `[num_blocks, block_size, num_kv_heads, head_dim]` pool per layer.
        value_caches: same, for values.
        block_ids: `[M]` int64 block ids, on any device.

    Returns:
        `[L, 2, M, block_size, num_kv_heads, head_dim]` on the caches' device (index 0 of
        dim 1 is K, 1 is V); move it with `.to("cpu")` to swap out.
    """
    dims = check_cache_lists(key_caches, value_caches)
    check_index("block_ids", block_ids, 1, None)
    device = key_caches[0].device
    ids = block_ids.to(device=device, dtype=torch.long)
    packed = torch.empty(
        (len(key_caches), 2, ids.shape[0], *dims[1:]), dtype=key_caches[0].dtype, device=device
    )
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        torch.index_select(as_bytes(k), 0, ids, out=as_bytes(packed[layer, 0]))
        torch.index_select(as_bytes(v), 0, ids, out=as_bytes(packed[layer, 1]))
    return packed


def scatter_blocks_ref(
    packed: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
) -> None:
    """Unpack `gather_blocks` output into blocks `block_ids` of every layer, in place.

    Args:
        packed: `[L, 2, M, block_size, num_kv_heads, head_dim]`, on any device (a CPU swap
            area is copied to the pools' device one layer at a time).
        key_caches: one pool per layer, written in place.
        value_caches: same, for values.
        block_ids: `[M]` int64 destination block ids, on any device.
    """
    dims = check_cache_lists(key_caches, value_caches)
    check_index("block_ids", block_ids, 1, None)
    check_packed(packed, key_caches, block_ids.shape[0], dims)
    device = key_caches[0].device
    ids = block_ids.to(device=device, dtype=torch.long)
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        as_bytes(k).index_copy_(0, ids, as_bytes(packed[layer, 0]).to(device))
        as_bytes(v).index_copy_(0, ids, as_bytes(packed[layer, 1]).to(device))
