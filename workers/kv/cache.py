"""The KV tensors of one worker: the paged device pool and its CPU swap area.

    device pool   key_caches[l], value_caches[l]: [num_blocks, block_size, num_kv_heads, row]
                  (views into one [L, 2, num_blocks, ...] allocation)
    swap area     one CPU tensor [L, 2, num_swap_blocks, block_size, num_kv_heads, row]
                  (pinned when the pool is on CUDA, so copies can overlap)

row is head_dim, or for an 8-bit pool head_dim + 4: each (token, KV head) row's codes and its
float32 scale (`pagedserve.kernels.kv_quant`), so every copy below moves codes and scales
together, and a packed export of an 8-bit pool is 8-bit, never a converted copy.

Which block holds what is the block manager's business; this class only moves bytes, and checks
the block ids it is given so a bad id fails loudly instead of corrupting another request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedserve.kernels import KernelOps
from pagedserve.kernels.kv_quant import KV8_DTYPES, SCALE_BYTES, as_bytes, row_width
from pagedserve.workers.kv.memory import kv_bytes_per_token


class KVDtypeMismatch(ValueError):
    """Blocks from a pool of another KV dtype: they are never converted (the caller
    recomputes, or the router falls back to a worker that does)."""


class KVCache:
    """Owns the per-layer K/V tensors of one worker's pool and its CPU swap area."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_swap_blocks: int = 0,
        ops: KernelOps,
    ) -> None:
        """Allocate the pool (zeroed: never-written slots must not hold NaNs) and swap area.

        Args:
            num_layers: decoder layers, one K and one V pool each.
            num_blocks: device blocks per layer.
            block_size: tokens per block.
            num_kv_heads: KV heads per token.
            head_dim: dimension of each head.
            dtype: element dtype of the pool and the swap area (an fp8 dtype or int8: 8-bit
                KV with a scale per row, `kv_quant`).
            device: where the pool lives.
            num_swap_blocks: blocks in the CPU swap area (0: no swapping).
            ops: the kernels that copy, gather and scatter blocks.
        """
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops
        block_shape = (block_size, num_kv_heads, row_width(head_dim, dtype))
        self._pool = torch.zeros(
            (num_layers, 2, num_blocks, *block_shape), dtype=dtype, device=self.device
        )
        self.key_caches: list[Tensor] = [self._pool[layer, 0] for layer in range(num_layers)]
        self.value_caches: list[Tensor] = [self._pool[layer, 1] for layer in range(num_layers)]
        self._swap = torch.zeros(
            (num_layers, 2, num_swap_blocks, *block_shape),
            dtype=dtype,
            pin_memory=self.device.type == "cuda" and num_swap_blocks > 0,
        )

    @staticmethod
    def num_blocks_for_budget(
        kv_cache_bytes: int,
        *,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks a byte budget holds: ``floor(bytes / (block_size * M_KV))``.

        An 8-bit pool's scales are counted apart (`scale_bytes_per_block`), as block tables are:
        the budget holds 2x the positions of a 16-bit pool and 4x those of a float32 one.

        Raises:
            ValueError: not even one block fits.
        """
        bytes_per_block = block_size * kv_bytes_per_token(
            num_layers, num_kv_heads, head_dim, _dtype_name(dtype)
        )
        num_blocks = kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {kv_cache_bytes} bytes holds no block "
                f"({bytes_per_block} bytes per block of {block_size} tokens)"
            )
        return num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool."""
        return int(self._pool.shape[2])

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return int(self._pool.shape[3])

    @property
    def num_swap_blocks(self) -> int:
        """Blocks in the CPU swap area."""
        return int(self._swap.shape[2])

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V one block occupies across all layers (block_size * M_KV)."""
        return self.block_size * kv_bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, _dtype_name(self.dtype)
        )

    @property
    def scale_bytes_per_block(self) -> int:
        """Bytes of one block's 8-bit scales across all layers (0 for a full-precision pool)."""
        if self.dtype not in KV8_DTYPES:
            return 0
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * SCALE_BYTES

    @property
    def packed_bytes_per_block(self) -> int:
        """Bytes one block really occupies, scales included (what a tier or a transfer holds)."""
        return self.bytes_per_block + self.scale_bytes_per_block

    @property
    def device_bytes(self) -> int:
        """Bytes of the device pool, scales included."""
        return self.num_blocks * self.packed_bytes_per_block

    @property
    def swap_bytes(self) -> int:
        """Bytes of the CPU swap area, scales included."""
        return self.num_swap_blocks * self.packed_bytes_per_block

    @property
    def row_width(self) -> int:
        """Elements per (token, KV head) row: head_dim, plus the scale bytes when 8-bit."""
        return row_width(self.head_dim, self.dtype)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks ``src -> dst`` in every layer (copy-on-write of a shared block).

        A dst may appear only once and never as a src: the kernels copy pairs in parallel.
        """
        if not pairs:
            return
        src, dst = _split_pairs(pairs)
        _check_ids("copy src", src, self.num_blocks)
        _check_ids("copy dst", dst, self.num_blocks, unique=True)
        if set(src) & set(dst):
            raise ValueError(f"copy_blocks: a block is both src and dst in {list(pairs)}")
        mapping = torch.tensor(pairs, dtype=torch.int64).to(self.device, non_blocking=True)
        self.ops.copy_blocks(self.key_caches, self.value_caches, mapping)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks into swap blocks: ``(device block, swap block)`` pairs."""
        if not pairs:
            return
        device_ids, swap_ids = _split_pairs(pairs)
        _check_ids("swap_out device block", device_ids, self.num_blocks)
        _check_ids("swap_out swap block", swap_ids, self.num_swap_blocks, unique=True)
        packed = self.ops.gather_blocks(
            self.key_caches, self.value_caches, self._device_ids(device_ids)
        )
        as_bytes(self._swap).index_copy_(2, torch.tensor(swap_ids), as_bytes(packed.to("cpu")))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy swap blocks back into device blocks: ``(swap block, device block)`` pairs."""
        if not pairs:
            return
        swap_ids, device_ids = _split_pairs(pairs)
        _check_ids("swap_in swap block", swap_ids, self.num_swap_blocks)
        _check_ids("swap_in device block", device_ids, self.num_blocks, unique=True)
        packed = as_bytes(self._swap).index_select(2, torch.tensor(swap_ids)).view(self.dtype)
        self._scatter(packed, device_ids)

    def export_blocks(self, block_ids: Sequence[int]) -> Tensor:
        """Device blocks packed as ``[L, 2, M, B, Hkv, D]`` on the CPU (K at index 0 of dim 1)."""
        block_ids = [int(i) for i in block_ids]
        _check_ids("export block", block_ids, self.num_blocks)
        packed = self.ops.gather_blocks(
            self.key_caches, self.value_caches, self._device_ids(block_ids)
        )
        return packed.to("cpu")

    def import_blocks(self, packed: Tensor, block_ids: Sequence[int]) -> None:
        """Write ``export_blocks`` output (from any worker of the same model and KV dtype) into
        ``block_ids``.

        Raises:
            KVDtypeMismatch: the blocks come from a pool of another KV dtype (never converted).
            ValueError: their shape is not this pool's, or a block id is bad.
        """
        block_ids = [int(i) for i in block_ids]
        if packed.dtype != self.dtype:
            raise KVDtypeMismatch(
                f"import_blocks: blocks of KV dtype {_dtype_name(packed.dtype)} cannot enter a "
                f"pool of kv_cache_dtype {_dtype_name(self.dtype)}; recompute them instead"
            )
        expected = (
            self.num_layers,
            2,
            len(block_ids),
            self.block_size,
            self.num_kv_heads,
            self.row_width,
        )
        if tuple(packed.shape) != expected:
            raise ValueError(f"import_blocks: packed shape {tuple(packed.shape)} != {expected}")
        _check_ids("import block", block_ids, self.num_blocks, unique=True)
        if not block_ids:
            return
        self._scatter(packed, block_ids)

    def _device_ids(self, block_ids: list[int]) -> Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def _scatter(self, packed: Tensor, device_ids: list[int]) -> None:
        packed = packed.to(device=self.device).contiguous()
        self.ops.scatter_blocks(
            packed, self.key_caches, self.value_caches, self._device_ids(device_ids)
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _split_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    first = [int(a) for a, _ in pairs]
    second = [int(b) for _, b in pairs]
    return first, second


def _check_ids(what: str, ids: list[int], limit: int, *, unique: bool = False) -> None:
    """Raise ValueError unless every id is in ``[0, limit)`` (and distinct when ``unique``)."""
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise ValueError(f"{what} ids {bad} outside [0, {limit})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{what} ids {ids} repeat an id")
