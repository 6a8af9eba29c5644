"""What names a KV block between processes: its chained hash (`BlockHash`: what KV events,
snapshots and the prefix index carry) and everything that hash covers (`BlockKey`: what an
exported prefix carries beside its KV, so the importing pool verifies each block exactly).

    worker ── export_prefix ──► (BlockKey list, packed KV) ── router ── import_prefix ──► peer
"""

from __future__ import annotations

from dataclasses import dataclass

BlockHash = bytes  # a full block's chained hash (`workers/kv/block_hash.py`)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything a block's hash covers, kept to verify a cache hit exactly."""

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]
