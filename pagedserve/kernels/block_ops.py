"""Triton kernels that move whole KV blocks across every layer at once.

All layers' pools are reached through one table of base addresses, ordered
`[K0, V0, K1, V1, ...]`, so one launch covers the model instead of one per layer and tensor.
A block of one pool is `block_size * num_kv_heads * head_dim` contiguous elements; the packed
tensor of `gather_blocks` is `[L, 2, M, block]`, so pool `p = 2 * layer + kv` of block `m`
lands at row `p * M + m`::

    pools:   K0[b] V0[b] K1[b] V1[b] ...           (table entry p = 2*layer + kv)
    packed:  [layer][kv][m][block_size, Hkv, D]    (row p*M + m)

8-bit pools (fp8, int8) move as bytes: their rows hold codes and scales together (`kv_quant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import reference
from pagedserve.kernels._checks import (
    check_block_mapping,
    check_cache_lists,
    check_index,
    check_packed,
)
from pagedserve.kernels.kv_quant import as_bytes
from pagedserve.kernels.launch import DEFAULT_COPY, CopyLaunch

_PTR_TABLES: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _pointer_table(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]
) -> torch.Tensor:
    """Device int64 tensor of the pools' base addresses, cached (the pools live for the run)."""
    device = key_caches[0].device
    ptrs = tuple(t.data_ptr() for pair in zip(key_caches, value_caches, strict=True) for t in pair)
    table = _PTR_TABLES.get((device, ptrs))
    if table is None:
        if len(_PTR_TABLES) >= 8:  # a handful of live pools at most; drop stale ones
            _PTR_TABLES.clear()
        table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        _PTR_TABLES[(device, ptrs)] = table
    return table


@triton.jit
def _pool_ptr(table_ptr, pool, like_ptr):
    # Turn a stored address back into a typed pointer with the pools' element type.
    return tl.load(table_ptr + pool).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def copy_blocks_kernel(
    table_ptr, like_ptr, mapping_ptr, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr
):
    """Program (pair, pool, chunk) copies one chunk of block src to block dst in one pool."""
    pair = tl.program_id(0)
    pool = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = _pool_ptr(table_ptr, pool, like_ptr)
    data = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(base + dst * BLOCK_NUMEL + offs, data, mask=mask)


# num_ids varies with every call: unspecialised, so a new count never compiles a variant.
@triton.jit(do_not_specialize=["num_ids"])
def gather_blocks_kernel(
    table_ptr, packed_ptr, ids_ptr, num_ids, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr
):
    """Program (m, pool, chunk) copies one chunk of block ids[m] of a pool into packed."""
    m = tl.program_id(0)
    pool = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    block = tl.load(ids_ptr + m).to(tl.int64)
    base = _pool_ptr(table_ptr, pool, packed_ptr)
    row = pool.to(tl.int64) * num_ids + m
    data = tl.load(base + block * BLOCK_NUMEL + offs, mask=mask)
    tl.store(packed_ptr + row * BLOCK_NUMEL + offs, data, mask=mask)


@triton.jit(do_not_specialize=["num_ids"])
def scatter_blocks_kernel(
    table_ptr, packed_ptr, ids_ptr, num_ids, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr
):
    """Program (m, pool, chunk) copies one chunk of packed back into block ids[m] of a pool."""
    m = tl.program_id(0)
    pool = tl.program_id(1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    block = tl.load(ids_ptr + m).to(tl.int64)
    base = _pool_ptr(table_ptr, pool, packed_ptr)
    row = pool.to(tl.int64) * num_ids + m
    data = tl.load(packed_ptr + row * BLOCK_NUMEL + offs, mask=mask)
    tl.store(base + block * BLOCK_NUMEL + offs, data, mask=mask)


def _grid(rows: int, num_layers: int, block_numel: int, chunk: int) -> tuple[int, int, int]:
    # A block larger than one chunk is split over the third grid axis.
    return (rows, 2 * num_layers, triton.cdiv(block_numel, chunk))


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
    *,
    launch: CopyLaunch | None = None,
) -> None:
    """Copy whole blocks `src -> dst` in every layer's K and V pool (Triton, one launch).

    Args:
        key_caches: one `[num_blocks, block_size, num_kv_heads, head_dim]` pool per layer.
        value_caches: same, for values.
        block_mapping: `[P, 2]` int64 (src, dst) pairs, on any device. Pairs are copied in
            parallel, so a dst must not appear twice nor as another pair's src.
        launch: elements per program and warps; None for the defaults.
    """
    dims = check_cache_lists(key_caches, value_caches)
    check_block_mapping(block_mapping)
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.to(device=key_caches[0].device).contiguous()
    block_numel = dims[1] * dims[2] * dims[3]
    launch = launch or DEFAULT_COPY
    grid = _grid(mapping.shape[0], len(key_caches), block_numel, launch.chunk)
    copy_blocks_kernel[grid](
        _pointer_table(key_caches, value_caches),
        as_bytes(key_caches[0]),
        mapping,
        BLOCK_NUMEL=block_numel,
        CHUNK=launch.chunk,
        num_warps=launch.num_warps,
    )


def gather_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    launch: CopyLaunch | None = None,
) -> torch.Tensor:
    """Pack blocks of every layer into one contiguous tensor (Triton, one launch).

    Args:
        key_caches: one `[num_blocks, block_size, num_kv_heads, head_dim]` pool per layer.
        value_caches: same, for values.
        block_ids: `[M]` int64 block ids, on any device.
        launch: elements per program and warps; None for the defaults.

    Returns:
        `[L, 2, M, block_size, num_kv_heads, head_dim]` on the pools' device.
    """
    dims = check_cache_lists(key_caches, value_caches)
    check_index("block_ids", block_ids, 1, None)
    device = key_caches[0].device
    ids = block_ids.to(device=device).contiguous()
    num_ids = ids.shape[0]
    packed = torch.empty(
        (len(key_caches), 2, num_ids, *dims[1:]), dtype=key_caches[0].dtype, device=device
    )
    if num_ids == 0:
        return packed
    block_numel = dims[1] * dims[2] * dims[3]
    launch = launch or DEFAULT_COPY
    gather_blocks_kernel[_grid(num_ids, len(key_caches), block_numel, launch.chunk)](
        _pointer_table(key_caches, value_caches),
        as_bytes(packed),
        ids,
        num_ids,
        BLOCK_NUMEL=block_numel,
        CHUNK=launch.chunk,
        num_warps=launch.num_warps,
    )
    return packed


def scatter_blocks(
    packed: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    launch: CopyLaunch | None = None,
) -> None:
    """Unpack `gather_blocks` output into blocks `block_ids` of every layer (Triton).

    Args:
        packed: `[L, 2, M, block_size, num_kv_heads, head_dim]`. When it is not on the
            pools' device (a CPU swap area), the torch path copies it in layer by layer.
        key_caches: one pool per layer, written in place.
        value_caches: same, for values.
        block_ids: `[M]` int64 destination block ids, on any device.
        launch: elements per program and warps; None for the defaults.
    """
    dims = check_cache_lists(key_caches, value_caches)
    check_index("block_ids", block_ids, 1, None)
    check_packed(packed, key_caches, block_ids.shape[0], dims)
    device = key_caches[0].device
    if packed.device != device:
        reference.scatter_blocks_ref(packed, key_caches, value_caches, block_ids)
        return
    ids = block_ids.to(device=device).contiguous()
    num_ids = ids.shape[0]
    if num_ids == 0:
        return
    block_numel = dims[1] * dims[2] * dims[3]
    launch = launch or DEFAULT_COPY
    scatter_blocks_kernel[_grid(num_ids, len(key_caches), block_numel, launch.chunk)](
        _pointer_table(key_caches, value_caches),
        as_bytes(packed),
        ids,
        num_ids,
        BLOCK_NUMEL=block_numel,
        CHUNK=launch.chunk,
        num_warps=launch.num_warps,
    )
