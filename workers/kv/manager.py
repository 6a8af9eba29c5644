"""Per-request block tables over a `BlockPool`: the only KV interface the scheduler uses.

    request tokens   t0 … t15 | t16 … t31 | t32 t33 ·
    block table      [   b7   ,    b2     ,   b9    ]      logical block i → physical block
    slot of token p  block_table[p // B] * B + p % B

`allocate_slots` either succeeds whole or changes nothing. Full blocks are hashed and cached as
soon as they are allocated for computation, so a later request with the same prefix reuses them;
when the step that would compute them drops the request (it was preempted after being
scheduled), `rollback_slots` takes the hashes and positions back.

Speculative decoding allocates slots for draft tokens past a request's known tokens
(`num_draft_tokens`); they are written by the verify forward but never hashed. Once the target
has verified them, `accept_draft_slots` keeps the accepted ones and releases the rest:

    before verify   t0 … t6 t7 | d1 d2 d3 ·  |             num_tokens = 8, draft slots = 3
    accept 1        t0 … t6 t7 | d1 ·  ·  ·  |             num_tokens = 9; the partial block
                                                           keeps only accepted slots
    (k = 5: a block holding only d4 d5 goes back to the free queue, unhashed)

A block is hashed only once every token in it is accepted, so no lookup can hit a rejected
token; drafts write only private blocks (copy-on-write covers their range too).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from pagedserve.workers.kv.block import Block
from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.kv.memory import BLOCK_TABLE_ENTRY_BYTES, blocks_needed
from pagedserve.workers.kv.swap import KVSwap
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey
from pagedserve.workers.protocol.stats import KVUsage


class AllocationMode(StrEnum):
    """How a request's block table grows: `PAGED` as its tokens arrive, `RESERVE_MAX` a whole
    context (`max_model_len`) at admission, as a contiguous server would."""

    PAGED = "paged"
    RESERVE_MAX = "reserve-max"


ALLOCATION_MODES: tuple[str, ...] = tuple(mode.value for mode in AllocationMode)


class KVRequest(Protocol):
    """What the manager needs to know about a request."""

    request_id: str
    all_token_ids: Sequence[int]  # prompt + output so far (every token whose KV may be computed)
    cache_extra_keys: tuple[str, ...]  # model id, cache salt: blocks share only when these match


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A verified prefix-cache hit: blocks whose KV a new request can reuse as is."""

    blocks: tuple[Block, ...]
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int


NO_HIT = ComputedBlocks((), (), 0)


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


class KVCacheManager(KVSwap):
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

    # ---------------------------------------------------------------- lookup
    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._requests[request_id].blocks]

    def get_computed_blocks(self, request: KVRequest) -> ComputedBlocks:
        """The longest cached prefix of full blocks for a request that holds no blocks yet.

        At least one token is always left to compute, because the step must produce logits for
        the request's next token. A request that needs the logits of every prompt position
        (``skip_prefix_cache``: prompt log-probabilities) gets no hit.
        """
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        for digest, key in self.iter_prefix_keys(request):
            block = self.pool.get_cached_block(digest, key)
            if block is None:
                break
            blocks.append(block)
            hashes.append(digest)
        return ComputedBlocks(tuple(blocks), tuple(hashes), len(blocks) * self.block_size)

    def iter_prefix_keys(self, request: KVRequest) -> Iterator[tuple[BlockHash, BlockKey]]:
        """(chained hash, key) of each full block a prefix hit of `request` may cover, in
        order, computed lazily (a caller stops at its first miss). None when the request
        takes no hit at all (caching off, or ``skip_prefix_cache``)."""
        if not self.pool.enable_caching or getattr(request, "skip_prefix_cache", False):
            return
        B = self.block_size
        parent: BlockHash | None = None
        for start in range(0, len(request.all_token_ids) - 1 - B + 1, B):
            tokens = tuple(request.all_token_ids[start : start + B])
            key = BlockKey(parent, tokens, request.cache_extra_keys)
            digest = block_hash(parent, key.token_ids, key.extra_keys)
            yield digest, key
            parent = digest

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

    def _cache_full_blocks(self, request: KVRequest, state: _RequestBlocks) -> None:
        if not self.pool.enable_caching:
            return
        B = self.block_size
        tokens = request.all_token_ids
        extra = request.cache_extra_keys
        for index in range(len(state.block_hashes), state.num_tokens // B):
            parent = state.block_hashes[-1] if state.block_hashes else None
            key = BlockKey(parent, tuple(tokens[index * B : (index + 1) * B]), extra)
            digest = block_hash(parent, key.token_ids, extra)
            state.block_hashes.append(digest)
            self.pool.cache_full_block(state.blocks[index], digest, key)

    def accept_draft_slots(self, request: KVRequest, num_accepted: int) -> None:
        """Keep the first `num_accepted` draft slots of this step; release the others.

        The accepted drafts are now tokens of `request` (its `all_token_ids` holds them). Whole
        blocks past the accepted length go back to the free queue (tail first); the partial
        last block keeps its accepted slots, and its rejected ones are simply unwritten again.
        Blocks that became full of accepted tokens are hashed and cached now.

        Args:
            request: a request that holds draft slots from `allocate_slots`.
            num_accepted: how many leading draft tokens the target accepted.
        """
        state = self._requests[request.request_id]
        if not 0 <= num_accepted <= state.num_draft_slots:
            raise ValueError(
                f"request {request.request_id}: cannot accept {num_accepted} of "
                f"{state.num_draft_slots} draft slots"
            )
        total = state.num_tokens + num_accepted
        if total > len(request.all_token_ids):
            raise ValueError(
                f"request {request.request_id}: {num_accepted} drafts accepted but only "
                f"{len(request.all_token_ids) - state.num_tokens} new tokens are known"
            )
        state.num_tokens = total
        state.num_draft_slots = 0
        self._release_blocks_past(state, total)
        self._cache_full_blocks(request, state)

    def _release_blocks_past(self, state: _RequestBlocks, num_positions: int) -> None:
        """Free the blocks no position below `num_positions` uses (in `reserve-max`, the
        reservation stays). None of them is hashed: each holds only unaccepted slots."""
        keep = blocks_needed(num_positions, self.block_size)
        if self.allocation_mode is AllocationMode.RESERVE_MAX:
            keep = max(keep, blocks_needed(self.max_model_len, self.block_size))
        if len(state.blocks) <= keep:
            return
        released = state.blocks[keep:]
        del state.blocks[keep:]
        self.pool.free_blocks(reversed(released))

    def rollback_slots(self, request_id: str, num_computed_tokens: int) -> None:
        """Take a request's table back to its first `num_computed_tokens` tokens.

        For slots allocated but never computed: the scheduler allocates a sequence's slots for
        a step before it knows that a later allocation in the same step will preempt it, and
        the preempted sequence is then dropped from the forward. Two things `allocate_slots`
        did must not outlive that step:

        - `num_tokens` counted the uncomputed positions, so the next allocation after a swap
          would start past the sequence's real end;
        - a block that those positions filled was hashed and cached already, although the
          slot holding its last token is never written: a later prefix hit would read it.

        Blocks stay in the table (in `reserve-max` they are the reservation); their slots
        past `num_computed_tokens` are simply unwritten again. Draft slots are dropped, and
        the blocks only they needed go back to the free queue.

        Args:
            request_id: a request holding device blocks.
            num_computed_tokens: positions whose KV is in the pool (at most `num_tokens`).
        """
        state = self._requests[request_id]
        if not 0 <= num_computed_tokens <= state.num_tokens or state.swap_slots:
            raise ValueError(
                f"request {request_id}: cannot roll back to {num_computed_tokens} of "
                f"{state.num_tokens} tokens (swapped out: {bool(state.swap_slots)})"
            )
        num_full = num_computed_tokens // self.block_size
        for index in range(num_full, len(state.block_hashes)):
            block = state.blocks[index]
            # Only the block this request registered; a block that is another copy of the
            # same content stayed unhashed (see `BlockPool.cache_full_block`).
            if block.block_hash == state.block_hashes[index]:
                self.pool.uncache_block(block)
        del state.block_hashes[num_full:]
        if state.num_draft_slots:
            self._release_blocks_past(state, state.num_tokens)
            state.num_draft_slots = 0
        state.num_tokens = num_computed_tokens

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Take a request back to its first `num_tokens` positions and free the blocks past
        them (a draft model's pool, after the target rejected some of its tokens)."""
        self.rollback_slots(request_id, num_tokens)
        self._release_blocks_past(self._requests[request_id], num_tokens)

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

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

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
