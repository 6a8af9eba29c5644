"""Argument checks shared by the Triton wrappers and the torch references.

Every public kernel entry point validates its arguments here first, so that a bad call fails
with a ValueError naming the argument instead of a silent out-of-bounds read inside a kernel.
The checks look only at metadata (shape, dtype, device, strides): none of them reads tensor
values, so none of them forces a device synchronisation.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_quant import KV8_DTYPES, SCALE_BYTES, head_dim_of

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
CACHE_DTYPES = (*FLOAT_DTYPES, *KV8_DTYPES)


def _fail(name: str, what: str, tensor: torch.Tensor) -> None:
    raise ValueError(
        f"{name} {what}; got shape {tuple(tensor.shape)}, dtype {tensor.dtype}, "
        f"device {tensor.device}, strides {tuple(tensor.stride())}"
    )


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Raise unless `value` is a torch.Tensor; return it."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_cache_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor, prefix: str = ""
) -> tuple[int, int, int, int]:
    """Check one layer's K and V pools.

    Both must be contiguous `[num_blocks, block_size, num_kv_heads, head_dim]` tensors of the
    same shape, float dtype and device (the kernels compute addresses from these shapes); an
    8-bit pool's last dimension is `head_dim + 4` (codes and scale, `kv_quant`).

    Returns:
        `(num_blocks, block_size, num_kv_heads, row)`: row is the last dimension as stored.
    """
    k_name, v_name = f"{prefix}key_cache", f"{prefix}value_cache"
    check_tensor(k_name, key_cache)
    check_tensor(v_name, value_cache)
    if key_cache.dim() != 4:
        _fail(k_name, "must be [num_blocks, block_size, num_kv_heads, head_dim]", key_cache)
    if key_cache.dtype not in CACHE_DTYPES:
        _fail(k_name, f"must have a dtype in {CACHE_DTYPES}", key_cache)
    if key_cache.dtype in KV8_DTYPES and key_cache.shape[3] % SCALE_BYTES:
        _fail(k_name, "must have an 8-bit row of head_dim + 4, head_dim divisible by 4", key_cache)
    if not key_cache.is_contiguous():
        _fail(k_name, "must be contiguous", key_cache)
    if value_cache.shape != key_cache.shape:
        _fail(v_name, f"must have the shape of {k_name} {tuple(key_cache.shape)}", value_cache)
    if value_cache.dtype != key_cache.dtype or value_cache.device != key_cache.device:
        _fail(v_name, f"must match {k_name} in dtype and device", value_cache)
    if not value_cache.is_contiguous():
        _fail(v_name, "must be contiguous", value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_cache_lists(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]
) -> tuple[int, int, int, int]:
    """Check the per-layer pools of a whole model: every layer shaped and typed alike.

    Returns:
        `(num_blocks, block_size, num_kv_heads, head_dim)` of every layer.
    """
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise ValueError("key_caches and value_caches must be lists of tensors")
    if len(key_caches) == 0 or len(key_caches) != len(value_caches):
        raise ValueError(
            "key_caches and value_caches must be non-empty and of equal length; got "
            f"{len(key_caches)} and {len(value_caches)}"
        )
    first = check_cache_pair(key_caches[0], value_caches[0], prefix="layer 0 ")
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        dims = check_cache_pair(k, v, prefix=f"layer {layer} ")
        if dims != first or k.dtype != key_caches[0].dtype or k.device != key_caches[0].device:
            _fail(f"layer {layer} key_cache", "must match layer 0 in shape, dtype and device", k)
    return first


def check_query(
    name: str, query: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int, head_dim: int
) -> int:
    """Check a `[tokens, num_heads, head_dim]` query against the pool; return num_heads.

    The last dimension must be unit-stride (a slice of a fused QKV projection is fine).
    """
    check_tensor(name, query)
    if query.dim() != 3 or query.shape[2] != head_dim:
        _fail(name, f"must be [tokens, num_heads, head_dim={head_dim}]", query)
    _check_compute_dtype(name, query, key_cache)
    if query.device != key_cache.device:
        _fail(name, f"must be on the cache device {key_cache.device}", query)
    if query.shape[0] > 0 and query.stride(2) != 1:
        _fail(name, "must be unit-stride in its last dimension", query)
    num_heads = query.shape[1]
    if num_heads == 0 or num_heads % num_kv_heads != 0:
        _fail(
            name, f"must have num_heads a positive multiple of num_kv_heads={num_kv_heads}", query
        )
    return num_heads


def _check_compute_dtype(name: str, tensor: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Queries and new K/V have the pool's dtype, or any float dtype for an 8-bit pool."""
    if key_cache.dtype in KV8_DTYPES:
        if tensor.dtype not in FLOAT_DTYPES:
            _fail(name, f"must have a dtype in {FLOAT_DTYPES} (the pool is 8-bit)", tensor)
    elif tensor.dtype != key_cache.dtype:
        _fail(name, f"must have the cache dtype {key_cache.dtype}", tensor)


def check_index(
    name: str,
    tensor: torch.Tensor,
    dims: int,
    device: torch.device | None,
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
) -> None:
    """Check an integer index tensor: rank, dtype and (when given) device."""
    check_tensor(name, tensor)
    if tensor.dim() != dims:
        _fail(name, f"must have {dims} dimension(s)", tensor)
    if tensor.dtype not in dtypes:
        _fail(name, f"must have a dtype in {dtypes}", tensor)
    if device is not None and tensor.device != device:
        _fail(name, f"must be on device {device}", tensor)


def check_attention_metadata(
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    scale: float,
) -> None:
    """Check block tables, sequence lengths and the softmax scale of an attention call."""
    check_index("block_tables", block_tables, 2, key_cache.device)
    check_index("seq_lens", seq_lens, 1, key_cache.device)
    if block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"must have one row per sequence ({num_seqs})", block_tables)
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        _fail("block_tables", "must be unit-stride in its last dimension", block_tables)
    if seq_lens.shape[0] != num_seqs:
        _fail("seq_lens", f"must have one entry per sequence ({num_seqs})", seq_lens)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")


def check_kv_rows(
    name: str, tensor: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int, head_dim: int
) -> None:
    """Check new `[N, num_kv_heads, head_dim]` keys or values against the pool."""
    check_tensor(name, tensor)
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
        _fail(name, f"must be [N, num_kv_heads={num_kv_heads}, head_dim={head_dim}]", tensor)
    _check_compute_dtype(name, tensor, key_cache)
    if tensor.device != key_cache.device:
        _fail(name, f"must be on the cache device {key_cache.device}", tensor)
    if tensor.shape[0] > 0 and tensor.stride(2) != 1:
        _fail(name, "must be unit-stride in its last dimension", tensor)


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Check the arguments of `write_kv`."""
    _, _, num_kv_heads, _ = check_cache_pair(key_cache, value_cache)
    head_dim = head_dim_of(key_cache)
    check_kv_rows("key", key, key_cache, num_kv_heads, head_dim)
    check_kv_rows("value", value, key_cache, num_kv_heads, head_dim)
    if value.shape != key.shape:
        _fail("value", f"must have the shape of key {tuple(key.shape)}", value)
    check_index("slot_mapping", slot_mapping, 1, key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail("slot_mapping", f"must have one slot per new token ({key.shape[0]})", slot_mapping)


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Check the arguments of `paged_decode_attention`."""
    _, _, num_kv_heads, _ = check_cache_pair(key_cache, value_cache)
    head_dim = head_dim_of(key_cache)
    check_query("query", query, key_cache, num_kv_heads, head_dim)
    check_attention_metadata(key_cache, block_tables, seq_lens, query.shape[0], scale)


def check_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Check the arguments of `paged_prefill_attention`."""
    _, _, num_kv_heads, _ = check_cache_pair(key_cache, value_cache)
    head_dim = head_dim_of(key_cache)
    check_query("query", query, key_cache, num_kv_heads, head_dim)
    num_seqs = block_tables.shape[0] if isinstance(block_tables, torch.Tensor) else -1
    check_attention_metadata(key_cache, block_tables, seq_lens, num_seqs, scale)
    check_index("query_start_loc", query_start_loc, 1, key_cache.device)
    if query_start_loc.shape[0] != num_seqs + 1:
        _fail(
            "query_start_loc", f"must have num_seqs + 1 = {num_seqs + 1} entries", query_start_loc
        )


def check_block_mapping(block_mapping: torch.Tensor) -> None:
    """Check a `[P, 2]` (src, dst) integer block mapping (any device: it is moved as needed)."""
    check_index("block_mapping", block_mapping, 2, None)
    if block_mapping.shape[1] != 2:
        _fail("block_mapping", "must be [P, 2] (src, dst) pairs", block_mapping)


def check_packed(
    packed: torch.Tensor, key_caches: list[torch.Tensor], num_ids: int, dims: tuple[int, ...]
) -> None:
    """Check a `[L, 2, M, B, Hkv, D]` packed block tensor against the pools it fills."""
    check_tensor("packed", packed)
    expected = (len(key_caches), 2, num_ids, *dims[1:])
    if tuple(packed.shape) != expected:
        _fail("packed", f"must have shape [L, 2, M, B, Hkv, D] = {expected}", packed)
    if packed.dtype != key_caches[0].dtype:
        _fail("packed", f"must have the cache dtype {key_caches[0].dtype}", packed)
    if not packed.is_contiguous():
        _fail("packed", "must be contiguous", packed)
