"""What a tensor-parallel engine holds instead of `ModelRunner` and `KVCache`: the same calls,
each run by every rank of the group (rank 0 in this process, the others through `TPGroup`).

    TPRunner.execute_pooling   sends the step's batch (`Forward`), runs rank 0's shard
    GroupKVCache.copy_blocks   rank 0's pool, then the same copies on every rank
                .swap_out/in   likewise (each rank swaps its own KV heads)
                .export_blocks every rank's KV heads of the blocks, joined on the head axis:
                               the full-head layout a k = 1 worker exports
                .import_blocks the full-head blocks split on the head axis, each rank its part

So the engine above (scheduler, block manager, sampler, handoffs, tiers) runs unchanged and
once, and the pool's block ids mean the same blocks on every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from pagedserve.workers.engine.checks import EngineConfigError
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.kv.cache import KVCache, KVDtypeMismatch
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.fused_decoder import unfusable_reason
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.model.runner import _check_inputs
from pagedserve.workers.tp.collectives import Collectives, backend_for, free_port
from pagedserve.workers.tp.group import TPGroup
from pagedserve.workers.tp.protocol import (
    CopyBlocks,
    ExportBlocks,
    Forward,
    ImportBlocks,
    RankSpec,
    RankState,
    SwapIn,
    SwapOut,
)
from pagedserve.workers.tp.rank_process import build_rank_state
from pagedserve.workers.tp.shard_bytes import model_shards
from pagedserve.workers.tp.sharded_decoder import slice_shards
from pagedserve.workers.tp.shards import FLAG, check_tp_size

_log = logging.getLogger(__name__)


class TPRunner:
    """Rank 0's forward: sends each step's batch to the other ranks and runs its own shard."""

    def __init__(self, group: TPGroup, state: RankState, device: torch.device) -> None:
        self.group = group
        self.state = state
        self.device = device  # rank 0's: where its shard, its pool and the inputs live

    @torch.inference_mode()
    def execute(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """`ModelRunner.execute`, over the group."""
        return self.execute_pooling(input_ids, positions, metadata, logits_indices, None)[0]

    @torch.inference_mode()
    def execute_pooling(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        logits_indices: Tensor,
        hidden_indices: Tensor | None,
        lora: object | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`ModelRunner.execute_pooling`, over the group: logits (and pooled rows) on rank 0.
        ``lora`` is always None here: a group loads no adapter (`workers/lora/engine_loras.py`).

        Raises:
            TPGroupFailed: a rank died or a collective failed (every rank is stopped).
        """
        assert lora is None, "a tensor-parallel group serves no LoRA adapter"
        _check_inputs(input_ids, positions, metadata, logits_indices)
        cpu = torch.device("cpu")
        self.group.send(
            Forward(input_ids.to(cpu), positions.to(cpu), metadata.to(cpu), logits_indices.to(cpu))
        )
        device, decoder, kv = self.device, self.state.decoder, self.state.kv_cache
        with self.group.guard():
            hidden = decoder.hidden_states(
                input_ids.to(device),
                positions.to(device),
                metadata.to(device),
                kv.key_caches,
                kv.value_caches,
                self.state.ops,
            )
            logits = decoder.logits(hidden, logits_indices.to(device))
        pooled = None
        if hidden_indices is not None:
            pooled = decoder.normed(hidden, hidden_indices.to(device))
        return logits.float(), pooled

    @property
    def collective_seconds(self) -> float:
        """Rank 0's wall time in all-reduces and gathers so far (waiting for peers included)."""
        return self.state.decoder.collectives.seconds

    @property
    def rank_pids(self) -> tuple[int, ...]:
        """The processes of ranks 1..k-1."""
        return tuple(self.group.pids)

    def exit_process_on_failure(self) -> None:
        """Make a failed group end this whole process (a cluster worker): its ranks are
        stopped first, and Ray restarts the worker while the router replays its requests on a
        peer; nothing is answered from half a group. Watches the ranks while idle too."""
        self.group.on_failure = _exit_process
        self.group.watch()

    def close(self) -> None:
        """Stop every other rank."""
        self.group.close()


def _exit_process(reason: str) -> None:
    _log.critical("tensor-parallel group failed (%s): this worker exits", reason)
    logging.shutdown()
    os._exit(70)


class GroupKVCache:
    """The group's pool as one `KVCache`: rank 0's shard here, the others' through the group.

    Sizes (`bytes_per_block`, `device_bytes`, ...) are the whole group's, so stats and tiers
    count a block as the full-head block it is; each rank's device holds its share.
    """

    def __init__(self, local: KVCache, group: TPGroup, heads_per_rank: list[int]) -> None:
        self.local = local
        self.group = group
        self.heads_per_rank = heads_per_rank
        self.num_kv_heads = sum(heads_per_rank)
        self.num_layers = local.num_layers
        self.head_dim = local.head_dim
        self.dtype = local.dtype
        self.device = local.device
        self.ops = local.ops
        self.key_caches = local.key_caches
        self.value_caches = local.value_caches

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the same ids on every rank)."""
        return self.local.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.local.block_size

    @property
    def num_swap_blocks(self) -> int:
        """Blocks in each rank's swap area."""
        return self.local.num_swap_blocks

    @property
    def row_width(self) -> int:
        """Elements per (token, KV head) row."""
        return self.local.row_width

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V one block occupies on all ranks together."""
        return self.local.bytes_per_block // self.local.num_kv_heads * self.num_kv_heads

    @property
    def scale_bytes_per_block(self) -> int:
        """Bytes of one block's 8-bit scales on all ranks together."""
        return self.local.scale_bytes_per_block // self.local.num_kv_heads * self.num_kv_heads

    @property
    def packed_bytes_per_block(self) -> int:
        """Bytes a block exported from the group occupies (all its KV heads, scales included)."""
        return self.bytes_per_block + self.scale_bytes_per_block

    @property
    def device_bytes(self) -> int:
        """Bytes of the pool on all ranks' devices."""
        return self.num_blocks * self.packed_bytes_per_block

    @property
    def swap_bytes(self) -> int:
        """Bytes of every rank's swap area."""
        return self.num_swap_blocks * self.packed_bytes_per_block

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """`KVCache.copy_blocks` on every rank (rank 0 first: it checks the ids)."""
        self.local.copy_blocks(pairs)
        if pairs:
            self.group.send(CopyBlocks(_pairs(pairs)))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """`KVCache.swap_out` on every rank, each into its own swap area."""
        self.local.swap_out(pairs)
        if pairs:
            self.group.send(SwapOut(_pairs(pairs)))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """`KVCache.swap_in` on every rank."""
        self.local.swap_in(pairs)
        if pairs:
            self.group.send(SwapIn(_pairs(pairs)))

    def export_blocks(self, block_ids: Sequence[int]) -> Tensor:
        """``[L, 2, M, B, Hkv, row]`` on the CPU: every rank's KV heads, in rank order."""
        block_ids = tuple(int(i) for i in block_ids)
        mine = self.local.export_blocks(block_ids)
        self.group.send(ExportBlocks(block_ids))
        theirs = self.group.collect()
        return torch.cat([mine, *theirs], dim=4)

    def import_blocks(self, packed: Tensor, block_ids: Sequence[int]) -> None:
        """Write full-head blocks (from a group of any k, or a k = 1 worker): each rank its KV
        heads.

        Raises:
            KVDtypeMismatch: blocks of another KV dtype (never converted).
            ValueError: their shape is not this pool's, or a block id is bad.
        """
        if packed.dtype != self.dtype:
            raise KVDtypeMismatch(
                f"import_blocks: blocks of KV dtype {packed.dtype} cannot enter a pool of "
                f"{self.dtype}; recompute them instead"
            )
        block_ids = tuple(int(i) for i in block_ids)
        if packed.ndim != 6 or packed.shape[4] != self.num_kv_heads:
            raise ValueError(
                f"import_blocks: packed shape {tuple(packed.shape)} does not hold "
                f"{self.num_kv_heads} KV heads on axis 4"
            )
        parts = [part.contiguous() for part in packed.split(self.heads_per_rank, dim=4)]
        self.local.import_blocks(parts[0], block_ids)
        if block_ids:
            self.group.send_each([ImportBlocks(part, block_ids) for part in parts[1:]])


def _pairs(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in pairs)


def check_tp_config(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
    """Refuse a `tensor_parallel_size` this model or machine cannot run (rank 0 serving on
    ``device``), naming the flag.

    Raises:
        EngineConfigError: (field `tensor_parallel_size`).
    """
    size = config.tensor_parallel_size
    check_tp_size(size, loaded.num_heads, loaded.num_kv_heads, loaded.name)
    reason = unfusable_reason(loaded.model)
    if reason is not None:
        raise EngineConfigError(FLAG, f"{FLAG} {size}: {loaded.name} cannot be split: {reason}")
    if device.type == "cuda":
        devices = torch.cuda.device_count()
        if size > devices:
            raise EngineConfigError(FLAG, f"{FLAG} {size} needs {size} GPUs; {devices} visible")
    elif size > (os.cpu_count() or 1):
        raise EngineConfigError(
            FLAG, f"{FLAG} {size} needs a CPU core per rank; {os.cpu_count()} here"
        )


def build_tp_executor(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    *,
    num_blocks: int,
    num_swap_blocks: int,
    kv_dtype: torch.dtype,
    release_model: bool = False,
) -> tuple[GroupKVCache, TPRunner]:
    """Start ranks 1..k-1 and build rank 0's shard on ``device`` (``cuda:0`` or the CPU); the
    group's pool and runner.

    Every rank's shard is sliced from ``loaded``'s model wherever it is (the host, when the
    engine loaded it), layer by layer, as copies that share no storage with it: rank 0's go
    to ``device``, the others' through the CPU to their ranks. With ``release_model`` each
    layer's weights are dropped once sliced (`slice_shards`), so the host holds about the
    model once, not twice; the caller then marks it released (`model.loader.release_weights`).
    On the CPU each rank (this process included) runs this process's torch threads // k.
    """
    check_tp_config(config, loaded, device)
    size = config.tensor_parallel_size
    shards = model_shards(loaded, size)
    backend = backend_for(device)
    host, port = "127.0.0.1", free_port()
    threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else 1
    # Ranks 1..k-1 get theirs through the CPU (and move them to their own device).
    places = [device] + [torch.device("cpu")] * (size - 1)
    shard_weights = slice_shards(
        loaded.model, shards, loaded.head_dim, to=places, release=release_model
    )
    specs = [
        RankSpec(
            weights=weights,
            num_layers=loaded.num_layers,
            device=f"cuda:{weights.shard.rank}" if device.type == "cuda" else "cpu",
            linear_backend=config.linear_backend,
            attention_backend=config.attention_backend,
            split_decodes=config.split_decodes,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_swap_blocks=num_swap_blocks,
            kv_dtype_name=str(kv_dtype).removeprefix("torch."),
            backend=backend,
            host=host,
            port=port,
            num_threads=threads,
        )
        for weights in shard_weights
    ]
    del shard_weights  # the specs hold them until the group is up
    group = TPGroup(specs[1:])
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads)
        collectives = Collectives(backend, host, port, 0, size)
        state = build_rank_state(specs[0], collectives)
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    kv = GroupKVCache(state.kv_cache, group, [shard.num_kv_heads for shard in shards])
    _log.info("tensor-parallel group of %d ranks up (pids %s)", size, group.pids)
    return kv, TPRunner(group, state, device)
