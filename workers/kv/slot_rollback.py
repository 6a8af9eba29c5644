"""Taking slots back: draft slots accepted or rejected, a dropped step's slots rolled back.

`KVSlotRollback` is a part of `KVCacheManager` (it reads the manager's block tables and pool);
it lives here so that workers/kv/manager.py keeps to allocation. `allocate_slots` hands out
slots ahead of the KV written into them; two things may then take them back:

- a step that drops a request it scheduled (preempted by a later allocation of the same
  step): `rollback_slots` takes its positions and the hashes of blocks those positions filled
  back, so no prefix hit can read a block whose last slot is never written;
- speculative decoding, which allocates slots for draft tokens past a request's known tokens
  (`num_draft_tokens`); they are written by the verify forward but never hashed. Once the
  target has verified them, `accept_draft_slots` keeps the accepted ones and releases the rest:

    before verify   t0 … t6 t7 | d1 d2 d3 ·  |             num_tokens = 8, draft slots = 3
    accept 1        t0 … t6 t7 | d1 ·  ·  ·  |             num_tokens = 9; the partial block
                                                           keeps only accepted slots
    (k = 5: a block holding only d4 d5 goes back to the free queue, unhashed)

A block is hashed only once every token in it is accepted, so no lookup can hit a rejected
token; drafts write only private blocks (copy-on-write covers their range too). A draft
model's own pool is cut back to what the target kept with `truncate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.workers.kv.block_pool import BlockPool
from pagedserve.workers.kv.memory import AllocationMode, blocks_needed

if TYPE_CHECKING:
    from pagedserve.workers.kv.manager import KVRequest, _RequestBlocks


class KVSlotRollback:
    """`KVCacheManager`'s methods that take slots back (see the module docstring)."""

    block_size: int
    max_model_len: int
    allocation_mode: AllocationMode
    pool: BlockPool
    _requests: dict[str, _RequestBlocks]

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
