"""KVCache: sizing, and moving blocks within the pool, to the swap area and between workers."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import get_kernel_ops
from pagedserve.workers.kv.cache import KVCache

LAYERS, HEADS, DIM, BLOCK = 3, 2, 4, 8


def _cache(num_blocks: int = 10, num_swap_blocks: int = 4, dtype=torch.float32) -> KVCache:
    return KVCache(
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype=dtype,
        device="cpu",
        num_swap_blocks=num_swap_blocks,
        ops=get_kernel_ops("torch"),
    )


def _fill_random(cache: KVCache, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for k, v in zip(cache.key_caches, cache.value_caches, strict=True):
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))


def _block(cache: KVCache, block_id: int) -> torch.Tensor:
    """All layers' K and V of one device block, stacked."""
    return torch.stack(
        [
            torch.stack([k[block_id], v[block_id]])
            for k, v in zip(cache.key_caches, cache.value_caches, strict=True)
        ]
    )


def test_num_blocks_for_budget_exact() -> None:
    m_kv = 2 * LAYERS * HEADS * DIM * 2  # float16
    per_block = BLOCK * m_kv
    dims = dict(block_size=BLOCK, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    assert KVCache.num_blocks_for_budget(7 * per_block, dtype=torch.float16, **dims) == 7
    assert KVCache.num_blocks_for_budget(8 * per_block - 1, dtype=torch.float16, **dims) == 7
    assert KVCache.num_blocks_for_budget(2 * per_block, dtype=torch.float32, **dims) == 1
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.num_blocks_for_budget(per_block - 1, dtype=torch.float16, **dims)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.num_blocks_for_budget(2 * per_block - 1, dtype=torch.float32, **dims)


def test_shapes_and_bytes() -> None:
    cache = _cache(num_blocks=10, num_swap_blocks=4)
    assert len(cache.key_caches) == len(cache.value_caches) == LAYERS
    for k in (*cache.key_caches, *cache.value_caches):
        assert k.shape == (10, BLOCK, HEADS, DIM) and k.is_contiguous()
        assert not k.any()  # zeroed: unwritten slots hold no NaNs
    assert (cache.num_blocks, cache.block_size, cache.num_swap_blocks) == (10, BLOCK, 4)
    per_block = BLOCK * 2 * LAYERS * HEADS * DIM * 4
    assert cache.bytes_per_block == per_block
    assert cache.device_bytes == 10 * per_block
    assert cache.swap_bytes == 4 * per_block
    assert _cache(num_swap_blocks=0).swap_bytes == 0


def test_copy_blocks_copies_every_layer_and_nothing_else() -> None:
    cache = _cache()
    _fill_random(cache)
    before = [_block(cache, i).clone() for i in range(cache.num_blocks)]
    cache.copy_blocks([(2, 7), (5, 0)])
    after = [_block(cache, i) for i in range(cache.num_blocks)]
    assert torch.equal(after[7], before[2]) and torch.equal(after[0], before[5])
    for i in set(range(cache.num_blocks)) - {0, 7}:
        assert torch.equal(after[i], before[i])
    cache.copy_blocks([])  # no-op


@pytest.mark.parametrize(
    "pairs, match",
    [([(0, 10)], "outside"), ([(1, 2), (3, 2)], "repeat"), ([(1, 2), (2, 3)], "both src and dst")],
)
def test_copy_blocks_rejects_bad_pairs(pairs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cache().copy_blocks(pairs)


def test_swap_out_and_in_roundtrip() -> None:
    cache = _cache()
    _fill_random(cache)
    original = {i: _block(cache, i).clone() for i in (1, 4, 6)}
    cache.swap_out([(1, 3), (4, 0), (6, 2)])
    _fill_random(cache, seed=1)  # the device blocks get reused by someone else
    cache.swap_in([(3, 8), (0, 9), (2, 1)])
    assert torch.equal(_block(cache, 8), original[1])
    assert torch.equal(_block(cache, 9), original[4])
    assert torch.equal(_block(cache, 1), original[6])


def test_swap_rejects_bad_ids() -> None:
    cache = _cache(num_swap_blocks=2)
    with pytest.raises(ValueError, match="swap_out swap block"):
        cache.swap_out([(0, 2)])
    with pytest.raises(ValueError, match="swap_in device block"):
        cache.swap_in([(0, 10)])
    with pytest.raises(ValueError, match="swap_out swap block"):
        _cache(num_swap_blocks=0).swap_out([(0, 0)])


def test_export_import_roundtrip_between_workers() -> None:
    source, target = _cache(), _cache(num_blocks=6)
    _fill_random(source)
    packed = source.export_blocks([3, 0, 9])
    assert packed.shape == (LAYERS, 2, 3, BLOCK, HEADS, DIM) and packed.device.type == "cpu"
    assert torch.equal(packed[:, :, 0], _block(source, 3))
    target.import_blocks(packed, [5, 1, 2])
    for src, dst in ((3, 5), (0, 1), (9, 2)):
        assert torch.equal(_block(target, dst), _block(source, src))
    assert not _block(target, 0).any()


def test_import_rejects_mismatched_packed() -> None:
    cache = _cache()
    packed = cache.export_blocks([0, 1])
    with pytest.raises(ValueError, match="packed shape"):
        cache.import_blocks(packed, [0])
    with pytest.raises(ValueError, match="repeat"):
        cache.import_blocks(packed, [4, 4])
