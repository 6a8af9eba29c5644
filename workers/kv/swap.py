"""The swap area's side of `KVCacheManager`: CPU swap slots for preempted requests.

`KVSwap` is a part of `KVCacheManager` (it reads the manager's block tables and pool); it lives
here so that workers/kv/manager.py keeps to allocation. Requests swap out and in as a group (a
beam search's live beams; a group of one otherwise): a block the group's members share goes to
one swap slot and comes back as one block they share again, so a group's swap costs its
distinct blocks, never a copy per member.

    swap out   beam A [b3 b5 b8]   beam B [b3 b5 b9]   → slots {b3: 0, b5: 1, b8: 2, b9: 3}
               A's slots [0 1 2], B's [0 1 3]; slots 0 and 1 have two owners
    swap in    slots 0 1 2 3 → blocks b1 b4 b6 b7;  A [b1 b4 b6], B [b1 b4 b7] (b1, b4 shared)

A slot goes back to the free list when its last owner leaves (swapped in, or freed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.workers.kv.manager import KVRequest


class KVSwap:
    """`KVCacheManager`'s swap methods (see the module docstring)."""

    _free_swap_slots: list[int]
    _swap_slot_owners: Counter[int]

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._free_swap_slots)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move one request's blocks to CPU swap slots (see `swap_out_group`)."""
        return self.swap_out_group([request_id])

    def swap_out_group(self, request_ids: Sequence[str]) -> list[tuple[int, int]] | None:
        """Move the blocks of `request_ids` to CPU swap slots, one slot per distinct block;
        returns the (device, swap) copies to perform, or None (changing nothing) when the
        swap area cannot hold them all. The device blocks are released (cached full blocks
        stay evictable in the pool)."""
        states = [self._requests[request_id] for request_id in request_ids]
        for request_id, state in zip(request_ids, states, strict=True):
            if state.swap_slots:
                raise ValueError(f"request {request_id} is already swapped out")
            if state.num_draft_slots:
                raise ValueError(f"request {request_id} holds draft slots; roll them back first")
        distinct = list(dict.fromkeys(block.block_id for s in states for block in s.blocks))
        if len(distinct) > len(self._free_swap_slots):
            return None
        slot_of = {block_id: self._free_swap_slots.pop() for block_id in distinct}
        for state in states:
            state.swap_slots = [slot_of[block.block_id] for block in state.blocks]
            self._swap_slot_owners.update(state.swap_slots)
            self.pool.free_blocks(reversed(state.blocks))
            state.blocks = []
        return list(slot_of.items())

    def swap_in(self, request: KVRequest) -> list[tuple[int, int]] | None:
        """Bring one swapped-out request back (see `swap_in_group`)."""
        return self.swap_in_group([request])

    def swap_in_group(self, requests: Sequence[KVRequest]) -> list[tuple[int, int]] | None:
        """Bring swapped-out requests back, sharing again the blocks they shared; returns the
        (swap, device) copies, or None (changing nothing) if the pool has no room."""
        states = [self._requests[request.request_id] for request in requests]
        distinct = list(dict.fromkeys(slot for state in states for slot in state.swap_slots))
        if len(distinct) > self.pool.num_free_blocks - self.reserve_blocks:
            return None
        block_of = dict(zip(distinct, self.pool.get_new_blocks(len(distinct)), strict=True))
        owned: set[int] = set()
        for request, state in zip(requests, states, strict=True):
            state.blocks = [block_of[slot] for slot in state.swap_slots]
            # Each block came with one owner: every further member holding it adds one.
            self.pool.touch(block_of[slot] for slot in state.swap_slots if slot in owned)
            owned.update(state.swap_slots)
            self._release_swap_slots(state.swap_slots)
            state.swap_slots = []
            # Re-register the full blocks: their KV is back, others may share it again.
            state.block_hashes = []
            self._cache_full_blocks(request, state)
        return [(slot, block.block_id) for slot, block in block_of.items()]

    def _release_swap_slots(self, slots: Sequence[int]) -> None:
        """Drop one owner from each slot; a slot left without owners is free again."""
        for slot in reversed(slots):
            self._swap_slot_owners[slot] -= 1
            if self._swap_slot_owners[slot] == 0:
                del self._swap_slot_owners[slot]
                self._free_swap_slots.append(slot)

    def num_swapped_blocks(self, request_id: str) -> int:
        """Swap slots a swapped-out request holds (0 if it is not swapped out)."""
        state = self._requests.get(request_id)
        return 0 if state is None else len(state.swap_slots)

    def is_swapped_out(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and bool(state.swap_slots)
