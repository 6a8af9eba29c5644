"""The one rule of a prefix match, shared by the index and every router's copy of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pagedserve.workers.protocol.blocks import BlockHash


def leading_matches(
    block_hashes: Sequence[BlockHash],
    holders: Mapping[BlockHash, set[str]],
    on_hit: Callable[[BlockHash], None] | None = None,
) -> dict[str, int]:
    """Per worker, how many leading `block_hashes` it holds (its cached prefix, in blocks).

    A hash a worker lacks ends that worker's prefix even if it holds later ones; workers with
    no leading block are omitted. Stops as soon as no worker is still matching, so it costs
    O(matched depth × holders). `on_hit` sees each hash some worker still matched (the index
    refreshes its LRU order there).
    """
    matched: dict[str, int] = {}
    still_matching: set[str] | None = None
    for depth, block_hash in enumerate(block_hashes):
        found = holders.get(block_hash)
        if not found:
            break
        survivors = set(found) if still_matching is None else still_matching & found
        if not survivors:
            break
        if on_hit is not None:
            on_hit(block_hash)
        for worker_id in survivors:
            matched[worker_id] = depth + 1
        still_matching = survivors
    return matched
