"""What rank 0 sends ranks 1..k-1 over each rank's pipe: frozen commands, each applied to a
rank's `RankState` by its own `apply` (no dispatch on names).

One command per engine operation that touches the model or the pool, sent in the order rank 0
runs it, so every rank's pool goes through the same writes as rank 0's:

    Forward        a step's packed batch; every rank runs its shard (all-reduces inside)
    CopyBlocks     copy-on-write copies
    SwapOut/SwapIn swaps between the pool and the rank's own CPU swap area
    ExportBlocks   the rank's KV heads of some blocks, sent back to rank 0
    ImportBlocks   the rank's KV heads of some blocks, written into its pool
    Stop           leave the group and exit
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.tp.sharded_decoder import ShardWeights
from pagedserve.workers.tp.shards import TPShard

if TYPE_CHECKING:
    from pagedserve.kernels import KernelOps
    from pagedserve.workers.kv.cache import KVCache
    from pagedserve.workers.tp.sharded_decoder import ShardedDecoder


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank builds itself from: its weights, its slice of the pool, the group."""

    weights: ShardWeights
    num_layers: int
    device: str
    linear_backend: str
    attention_backend: str
    split_decodes: bool
    num_blocks: int
    block_size: int
    num_swap_blocks: int
    kv_dtype_name: str
    backend: str
    host: str
    port: int
    num_threads: int

    @property
    def shard(self) -> TPShard:
        """Which rank this is, and what it owns."""
        return self.weights.shard


@dataclass
class RankState:
    """A rank's model shard and pool shard (the rank process's only state)."""

    decoder: ShardedDecoder
    kv_cache: KVCache
    ops: KernelOps


@dataclass(frozen=True)
class Forward:
    input_ids: Tensor
    positions: Tensor
    metadata: AttentionMetadata
    logits_indices: Tensor

    def apply(self, state: RankState) -> None:
        device = state.kv_cache.device
        hidden = state.decoder.hidden_states(
            self.input_ids.to(device),
            self.positions.to(device),
            self.metadata.to(device),
            state.kv_cache.key_caches,
            state.kv_cache.value_caches,
            state.ops,
        )
        state.decoder.logits(hidden, self.logits_indices.to(device))


@dataclass(frozen=True)
class CopyBlocks:
    pairs: tuple[tuple[int, int], ...]

    def apply(self, state: RankState) -> None:
        state.kv_cache.copy_blocks(self.pairs)


@dataclass(frozen=True)
class SwapOut:
    pairs: tuple[tuple[int, int], ...]

    def apply(self, state: RankState) -> None:
        state.kv_cache.swap_out(self.pairs)


@dataclass(frozen=True)
class SwapIn:
    pairs: tuple[tuple[int, int], ...]

    def apply(self, state: RankState) -> None:
        state.kv_cache.swap_in(self.pairs)


@dataclass(frozen=True)
class ExportBlocks:
    block_ids: tuple[int, ...]

    def apply(self, state: RankState) -> Tensor:
        return state.kv_cache.export_blocks(self.block_ids)


@dataclass(frozen=True)
class ImportBlocks:
    packed: Tensor
    block_ids: tuple[int, ...]

    def apply(self, state: RankState) -> None:
        state.kv_cache.import_blocks(self.packed, self.block_ids)


@dataclass(frozen=True)
class Stop:
    def apply(self, state: RankState) -> None:
        return None


RankCommand = Forward | CopyBlocks | SwapOut | SwapIn | ExportBlocks | ImportBlocks | Stop
# Commands whose result goes back to rank 0.
REPLYING = (ExportBlocks,)
# Sent once a rank has built its shards, before it takes commands.
READY = "ready"
