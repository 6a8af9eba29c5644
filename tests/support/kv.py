"""Shared helpers for block-manager tests: a minimal request and tiny-pool constructors."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.workers.kv.manager import KVCacheManager


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    cache_extra_keys: tuple[str, ...] = ()
    num_computed: int = field(default=0)


def make_manager(num_blocks: int = 8, block_size: int = 4, **kwargs) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 64)
    kwargs.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks, block_size, **kwargs)
