"""Per-request block tables over a `BlockPool`: the only KV interface the scheduler uses.

    request tokens   t0 … t15 | t16 … t31 | t32 t33 ·
    block table      [   b7   ,    b2     ,   b9    ]      logical block i → physical block
    slot of token p  block_table[p // B] * B + p % B

`allocate_slots` either succeeds whole or changes nothing; a block another table shares is
copied before a request writes into it (copy-on-write), and `fork` shares a table's blocks with
a new request. The manager's other parts each own one concern over the same tables: the prefix
cache's lookup and registration (`workers/kv/prefix_lookup.py`), taking slots back after a
dropped step or a draft verification (`workers/kv/slot_rollback.py`), and the swap area
(`workers/kv/swap.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.kv.memory import (
    ALLOCATION_MODES,
    BLOCK_TABLE_ENTRY_BYTES,
    AllocationMode,
    blocks_needed,
)
from pagedserve.workers.kv.prefix_lookup import NO_HIT, ComputedBlocks, KVPrefixLookup
from pagedserve.workers.kv.slot_rollback import KVSlotRollback
from pagedserve.workers.kv.swap import KVSwap
from pagedserve.workers.protocol.blocks import BlockHash
from pagedserve.workers.protocol.stats import KVUsage


class KVRequest(Protocol):
    """What the manager needs to know about a request."""

    request_id: str
    all_token_ids: Sequence[int]  # prompt + output so far (every token whose KV may be computed)
    cache_extra_keys: tuple[str, ...]  # model id, cache salt: blocks share only when these match


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """What one successful `allocate_slots` did: blocks taken and copies the runner must do."""

    new_block_ids: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]  # (src, dst) copy-on-write block copies, before the step


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[Block]
    block_hashes: list[BlockHash]  # chained hashes of the leading full blocks, in order
    num_tokens: int  # positions whose KV is written or being written this step
    swap_slots: list[int] = field(default_factory=list)
    # Positions past `num_tokens` held this step for draft tokens the target verifies.
    num_draft_slots: int = 0


class KVCacheManager(KVPrefixLookup, KVSlotRollback, KVSwap):
    """Owns every request's block table and the swap slots; allocation goes through the pool.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block (B).
        max_model_len: longest sequence a request may reach; `reserve-max` reserves this much.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        allocation_mode: `paged` grows tables as tokens arrive; `reserve-max` reserves
            ceil(max_model_len / B) blocks at admission (the contiguous baseline).
        watermark: fraction of blocks kept free when admitting a new request, so that running
            requests can still grow without immediate preemption.
        num_swap_blocks: CPU swap slots for preempted requests.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_prefix_caching: bool = True,
        allocation_mode: AllocationMode | str = AllocationMode.PAGED,
        watermark: float = 0.01,
        num_swap_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if allocation_mode not in ALLOCATION_MODES:
            raise ValueError(
                f"allocation_mode must be one of {ALLOCATION_MODES}, got {allocation_mode!r}"
            )
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.allocation_mode = AllocationMode(allocation_mode)
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.reserve_blocks = int(watermark * num_blocks)
        self.num_swap_blocks = num_swap_blocks
        self._free_swap_slots = list(range(num_swap_blocks - 1, -1, -1))
        self._swap_slot_owners: Counter[int] = Counter()  # slot → requests holding it
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---------------------------------------------------------------- tables
    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._requests[request_id].blocks]

    # ------------------------------------------------------------ allocation
    def can_fit_ever(self, num_tokens: int) -> bool:
        """Whether a request reaching `num_tokens` could be admitted alone into an empty pool."""
        needed = blocks_needed(num_tokens, self.block_size)
        if self.allocation_mode is AllocationMode.RESERVE_MAX:
            needed = max(needed, blocks_needed(self.max_model_len, self.block_size))
        return needed <= self.pool.num_blocks - self.reserve_blocks

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_HIT,
        *,
        num_draft_tokens: int = 0,
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` more tokens of `request`, all or nothing.

        Args:
            request: the request; its `all_token_ids` must hold every token to be computed.
            num_new_tokens: tokens whose KV this step computes.
            computed: for a request holding no blocks yet, the prefix-cache hit to reuse.
            num_draft_tokens: slots after those for draft tokens (not in `all_token_ids`),
                written this step and resolved by `accept_draft_slots` or `rollback_slots`.

        Returns:
            The blocks taken and copy-on-write copies, or None (and nothing changed) when the
            pool cannot supply them.
        """
        state = self._requests.get(request.request_id)
        admitting = state is None
        if admitting:
            blocks: list[Block] = list(computed.blocks)
            num_computed = computed.num_tokens
        else:
            if computed.blocks:
                raise ValueError(
                    f"request {request.request_id} holds blocks; a hit cannot be added"
                )
            if state.num_draft_slots:
                raise ValueError(
                    f"request {request.request_id} still holds {state.num_draft_slots} draft "
                    "slots; accept or roll them back first"
                )
            blocks = state.blocks
            num_computed = state.num_tokens
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        total = num_computed + num_new_tokens
        if total > len(request.all_token_ids):
            raise ValueError(
                f"request {request.request_id}: {total} tokens to compute but only "
                f"{len(request.all_token_ids)} are known"
            )
        end = total + num_draft_tokens
        num_target = blocks_needed(end, self.block_size)
        if admitting and self.allocation_mode is AllocationMode.RESERVE_MAX:
            num_target = max(num_target, blocks_needed(self.max_model_len, self.block_size))
        num_grow = max(0, num_target - len(blocks))
        shared_in_write_range = self._shared_blocks_to_write(blocks, num_computed, end)
        num_revived = sum(1 for block in blocks if block.ref_cnt == 0) if admitting else 0
        needed = num_grow + len(shared_in_write_range) + num_revived
        reserve = self.reserve_blocks if admitting else 0
        if needed > self.pool.num_free_blocks - reserve:
            return None

        if admitting:
            # Counted on admission only: a lookup that is retried while the pool is full
            # must not inflate the hit rate's denominator.
            self.prefix_queries_tokens += len(request.all_token_ids)
            self.prefix_hits_tokens += computed.num_tokens
            self.pool.touch(blocks)
            state = _RequestBlocks(blocks, list(computed.block_hashes), num_computed)
            self._requests[request.request_id] = state
        copies = self._copy_on_write(state, shared_in_write_range, num_computed)
        new_blocks = self.pool.get_new_blocks(num_grow)
        state.blocks.extend(new_blocks)
        state.num_tokens = total
        state.num_draft_slots = num_draft_tokens
        self._cache_full_blocks(request, state)  # up to `total`: never a draft position
        new_ids = tuple(b.block_id for b in new_blocks) + tuple(dst for _, dst in copies)
        return SlotAllocation(new_ids, copies)

    def _shared_blocks_to_write(self, blocks: list[Block], start: int, end: int) -> list[int]:
        """Indices of blocks that positions [start, end) write into and another table shares."""
        if end <= start:
            return []
        B = self.block_size
        last = min((end - 1) // B, len(blocks) - 1)
        return [i for i in range(start // B, last + 1) if blocks[i].ref_cnt > 1]

    def _copy_on_write(
        self, state: _RequestBlocks, indices: list[int], num_computed: int
    ) -> tuple[tuple[int, int], ...]:
        """Give the request private copies of shared blocks it is about to write into."""
        copies = []
        for index in indices:
            shared = state.blocks[index]
            (private,) = self.pool.get_new_blocks(1)
            if index * self.block_size < num_computed:  # holds KV worth keeping
                copies.append((shared.block_id, private.block_id))
            self.pool.free_blocks([shared])
            state.blocks[index] = private
        return tuple(copies)

    # ------------------------------------------------------------- releasing
    def free(self, request_id: str) -> bool:
        """Return every block of the request (tail first). False when it held none."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.pool.free_blocks(reversed(state.blocks))
        self._release_swap_slots(state.swap_slots)
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int | None = None) -> None:
        """Let `child_id` share the blocks of `parent_id`'s first `num_tokens` positions (all
        by default); copy-on-write gives it a private copy of a shared block it writes into."""
        if child_id in self._requests:
            raise ValueError(f"request {child_id} already holds blocks")
        parent = self._requests[parent_id]
        if parent.swap_slots or parent.num_draft_slots:
            raise ValueError(f"request {parent_id} is swapped out or mid-draft; cannot fork")
        blocks, hashes = parent.blocks, parent.block_hashes
        if num_tokens is None:  # the whole table (with `reserve-max`, its reserved blocks too)
            num_tokens = parent.num_tokens
        elif 0 <= num_tokens <= parent.num_tokens:
            blocks = blocks[: blocks_needed(num_tokens, self.block_size)]
            hashes = hashes[: num_tokens // self.block_size]
        else:
            raise ValueError(f"cannot fork {num_tokens} of {parent.num_tokens} tokens")
        self.pool.touch(blocks)
        self._requests[child_id] = _RequestBlocks(list(blocks), list(hashes), num_tokens)

    # ----------------------------------------------------------------- usage
    def usage(self) -> KVUsage:
        B = self.block_size
        filled: dict[int, int] = {}
        entries = 0
        for state in self._requests.values():
            entries += len(state.blocks)
            for index, block in enumerate(state.blocks):
                in_block = min(B, max(0, state.num_tokens - index * B))
                filled[block.block_id] = max(filled.get(block.block_id, 0), in_block)
        used = self.pool.num_blocks - self.pool.num_free_blocks
        cached_free = self.pool.num_cached_free_blocks
        useful = sum(filled.values())
        return KVUsage(
            block_size=B,
            total_blocks=self.pool.num_blocks,
            used_blocks=used,
            cached_free_blocks=cached_free,
            free_blocks=self.pool.num_free_blocks - cached_free,
            reserve_blocks=self.reserve_blocks,
            useful_tokens=useful,
            allocated_positions=used * B,
            wasted_positions=used * B - useful,
            block_table_entries=entries,
            block_table_bytes=entries * BLOCK_TABLE_ENTRY_BYTES,
            swap_blocks_used=self.num_swap_blocks - len(self._free_swap_slots),
            swap_blocks_total=self.num_swap_blocks,
            num_requests=len(self._requests),
            prefix_queries_tokens=self.prefix_queries_tokens,
            prefix_hits_tokens=self.prefix_hits_tokens,
        )
