"""Builders for paged-KV test data: random pools, shuffled block tables, naive attention.

Shared by the CPU tests, the CUDA tests and the benchmark so that all of them exercise the
same layouts: blocks handed out in random order from a pool that also holds unused (random)
blocks, and table padding of -1 that a kernel must never dereference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class AttnCase(NamedTuple):
    """One attention configuration of the kernel tests."""

    dtype: torch.dtype
    head_dim: int
    block_size: int
    group: int  # num_heads // num_kv_heads
    num_kv_heads: int

    @property
    def num_heads(self) -> int:
        return self.group * self.num_kv_heads

    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}-d{self.head_dim}-b{self.block_size}-g{self.group}-kv{self.num_kv_heads}"


# The interpreter is slow, so instead of the full product dtype(3) x head_dim(2) x
# block_size(3) x group(2) the tests use this pairwise cover: every pair of values of any two
# factors appears in some case. Group 4 alternates between GQA (2 KV heads) and MQA (1).
PAIRWISE_CASES = [
    AttnCase(torch.float32, 64, 8, 1, 2),
    AttnCase(torch.float32, 128, 16, 4, 1),
    AttnCase(torch.float32, 64, 32, 4, 2),
    AttnCase(torch.float16, 128, 8, 4, 2),
    AttnCase(torch.float16, 64, 16, 1, 2),
    AttnCase(torch.float16, 128, 32, 1, 1),
    AttnCase(torch.bfloat16, 64, 8, 4, 1),
    AttnCase(torch.bfloat16, 128, 16, 1, 2),
    AttnCase(torch.bfloat16, 128, 32, 4, 2),
]


def edge_lens(block_size: int) -> list[int]:
    """Context lengths at the edges: 1, an exact block multiple, a multiple + 1, 300."""
    return [1, block_size, 2 * block_size + 1, 300]


@dataclass
class PagedKV:
    """A random paged pool plus the same KV laid out contiguously per sequence.

    Attributes:
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
        value_cache: same shape.
        block_tables: `[S, max_blocks]` int32, padded with -1.
        seq_lens: `[S]` int32.
        keys: per sequence, its `[seq_len, num_kv_heads, head_dim]` keys, contiguous.
        values: per sequence, its values, contiguous.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
    spare_columns: int = 1,
) -> PagedKV:
    """Build a pool whose blocks are assigned to sequences in random order.

    Args:
        seq_lens: context length of each sequence.
        num_kv_heads: KV heads per token.
        head_dim: channels per head.
        block_size: tokens per block.
        dtype: pool dtype.
        device: pool device.
        generator: CPU generator for reproducible data (values, block shuffle).
        spare_blocks: unused random blocks left in the pool.
        spare_columns: extra -1 columns in each block table.

    Returns:
        The pool, its tables and the contiguous per-sequence KV.
    """
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(needed, default=0) + spare_columns
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    keys, values, taken = [], [], 0
    for seq, (length, count) in enumerate(zip(seq_lens, needed, strict=True)):
        blocks = order[taken : taken + count]
        taken += count
        tables[seq, :count] = blocks.to(torch.int32)
        keys.append(key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].to(device))
        values.append(value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].to(device))
    return PagedKV(
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def naive_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Textbook causal attention of one sequence's last `q_len` tokens, in float64.

    Args:
        query: `[q_len, num_heads, head_dim]`, the sequence's last q_len positions.
        keys: `[seq_len, num_kv_heads, head_dim]`, contiguous.
        values: same shape as keys.
        scale: softmax scale.

    Returns:
        `[q_len, num_heads, head_dim]` in float64.
    """
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`assert_close` tolerances for attention outputs computed in `dtype`."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 2e-2, "rtol": 2e-2}


def specialisation_key(kernel: object, args: tuple, kwargs: dict) -> tuple:
    """What picks a compiled variant of a Triton kernel for one launch, as Triton keys it.

    Triton compiles one binary per distinct (constexpr values, launch options, argument
    dtypes, and for plain ints and pointers: == 1, divisible by 16 / 16-byte aligned). The
    interpreter compiles nothing, so the CPU tests count these keys instead of cache entries.
    Ints named in the kernel's `do_not_specialize` contribute only that they are ints.

    Args:
        kernel: a `@triton.jit` kernel (compiled or interpreted).
        args: positional launch arguments.
        kwargs: keyword launch arguments (constexprs, num_warps, num_stages).

    Returns:
        A hashable key; equal keys reuse one compiled kernel.
    """
    import inspect

    fn = kernel.fn
    params = inspect.signature(fn).parameters
    names = list(params)
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    options = getattr(kernel, "kwargs", None) or {}
    no_spec = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or []
    no_spec = {names[n] if isinstance(n, int) else n for n in no_spec}
    bound = dict(zip(names, args, strict=False)) | kwargs
    key = []
    for name in sorted(bound):
        value = bound[name]
        if isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, float) and name not in constexprs:
            key.append((name, "fp32"))  # runtime floats are never specialised
        elif name in constexprs or name not in names or not isinstance(value, int):
            key.append((name, value))  # constexprs and launch options, by value
        elif isinstance(value, bool):
            key.append((name, value))
        elif name in no_spec:
            key.append((name, "int"))
        else:
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


class KernelRecorder:
    """Stands in for a Triton kernel: records each launch's specialisation key, runs nothing."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.keys: set[tuple] = set()
        self.launches = 0

    def __getitem__(self, grid: tuple):
        def launch(*args, **kwargs) -> None:
            self.launches += 1
            self.keys.add(specialisation_key(self.kernel, args, kwargs))

        return launch


def compiled_variants(kernel: object) -> int | None:
    """Binaries Triton has compiled for `kernel` in this process, over every device.

    None under the interpreter (it compiles nothing) or on a Triton whose cache layout is
    unknown. `device_caches[device][0]` is the per-device binary cache in Triton 3.x.
    """
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    try:
        return sum(len(entry[0]) for entry in caches.values())
    except (TypeError, IndexError, KeyError):
        return None


def quantise_pool(kv: PagedKV, dtype: torch.dtype) -> PagedKV:
    """The same pool in an 8-bit layout (`kv_quant`: 8-bit codes and a scale per row), with the
    contiguous per-sequence KV it now stands for (dequantised, float32)."""
    from pagedserve.kernels.kv_quant import dequantise_rows, quantise_rows

    key_cache = quantise_rows(kv.key_cache, dtype)
    value_cache = quantise_rows(kv.value_cache, dtype)
    keys = [dequantise_rows(quantise_rows(k, dtype)) for k in kv.keys]
    values = [dequantise_rows(quantise_rows(v, dtype)) for v in kv.values]
    return PagedKV(key_cache, value_cache, kv.block_tables, kv.seq_lens, keys, values)
