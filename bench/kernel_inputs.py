"""The data the attention-kernel benchmark (`bench/kernels.py`, `bench/gpu_sweep.py`) measures
on, and the torch references each kernel is checked against.

The same random KV is laid out twice: in a paged pool whose blocks are in shuffled order (what
the Triton kernels read through block tables) and contiguous `[B, Hkv, ctx, D]` (what
`F.scaled_dot_product_attention` reads), so every kernel and its reference see identical
values. `varlen_batch` packs sequences of uneven lengths and query counts into one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Shapes:
    """The attention shapes a run measures (query and KV heads, head dim, block size), its
    dtype and device."""

    heads: int
    kv_heads: int
    head_dim: int
    block: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass
class PagedData:
    """Random KV in a shuffled paged pool, plus the same KV contiguous `[B, Hkv, ctx, D]`."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def make_paged(s: Shapes, batch: int, context: int, gen: torch.Generator) -> PagedData:
    """`batch` sequences of `context` tokens of random KV, paged and contiguous."""
    blocks_per_seq = -(-context // s.block)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, s.block, s.kv_heads, s.head_dim)
    key_cache = torch.randn(shape, device=s.device, dtype=s.dtype)
    value_cache = torch.randn(shape, device=s.device, dtype=s.dtype)
    order = torch.randperm(num_blocks, generator=gen).to(s.device)
    tables = order.view(batch, blocks_per_seq)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        flat = cache[tables].view(batch, blocks_per_seq * s.block, *shape[2:])
        return flat[:, :context].transpose(1, 2).contiguous()

    return PagedData(
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=s.device),
        keys=contiguous(key_cache),
        values=contiguous(value_cache),
    )


def sdpa_decode(q: torch.Tensor, d: PagedData, scale: float, flash: bool) -> torch.Tensor:
    """SDPA over contiguous KV; the query heads of a KV head become its query rows, so no
    K/V expansion is needed and flash attention applies (one token: nothing to mask)."""
    batch, heads, dim = q.shape
    kv_heads = d.keys.shape[1]
    q4 = q.view(batch, kv_heads, heads // kv_heads, dim)
    with sdpa_backend(flash):
        out = F.scaled_dot_product_attention(q4, d.keys, d.values, scale=scale)
    return out.reshape(batch, heads, dim)


def sdpa_backend(flash: bool):
    from contextlib import nullcontext

    if not flash:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def varlen_batch(s: Shapes, ctx_lens: list[int], q_lens: list[int], gen):
    """A packed batch over one shuffled pool: (query, cache, tables, starts, seq_lens)."""
    from pagedserve.kernels.testing import make_paged_kv

    kv = make_paged_kv(ctx_lens, s.kv_heads, s.head_dim, s.block, s.dtype, s.device,
                       generator=gen, spare_blocks=0)  # fmt: skip
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), s.heads, s.head_dim, generator=gen).to(s.dtype)
    return (q.to(s.device), kv.key_cache, kv.value_cache, kv.block_tables,
            starts.to(s.device), kv.seq_lens, s.scale)  # fmt: skip
