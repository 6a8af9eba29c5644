"""Ranks 1..k-1 of a tensor-parallel group: a process each, started by rank 0 (`group.py`).

A rank joins the group, takes the weights rank 0 sliced for it (`ShardWeights`), allocates its
slice of the pool, says `READY`, then applies rank 0's commands in order until `Stop`. It exits
when rank 0 goes away (its pipe closes) or a collective fails (a peer died): a group never
half-serves, and nothing outlives the engine that started it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import sys
from multiprocessing.connection import Client, Connection

import torch

from pagedserve.kernels import get_kernel_ops
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.cpu_linear import resolve_linear_backend
from pagedserve.workers.tp.collectives import Collectives
from pagedserve.workers.tp.protocol import READY, REPLYING, RankSpec, RankState, Stop
from pagedserve.workers.tp.sharded_decoder import ShardedDecoder, ShardWeights, layer_to

_log = logging.getLogger(__name__)


def build_rank_state(spec: RankSpec, collectives: Collectives) -> RankState:
    """The decoder and the pool slice of rank ``spec.shard.rank``."""
    device = torch.device(spec.device)
    dtype = spec.weights.embed.dtype
    backend = resolve_linear_backend(spec.linear_backend, device, dtype)
    weights = weights_to(spec.weights, device)
    decoder = ShardedDecoder(weights, collectives, backend)
    ops = get_kernel_ops(spec.attention_backend, device, split_decodes=spec.split_decodes)
    kv_cache = KVCache(
        num_layers=spec.num_layers,
        num_blocks=spec.num_blocks,
        block_size=spec.block_size,
        num_kv_heads=spec.shard.num_kv_heads,
        head_dim=spec.weights.head_dim,
        dtype=getattr(torch, spec.kv_dtype_name),
        device=device,
        num_swap_blocks=spec.num_swap_blocks,
        ops=ops,
    )
    return RankState(decoder=decoder, kv_cache=kv_cache, ops=ops)


def weights_to(weights: ShardWeights, device: torch.device) -> ShardWeights:
    """``weights`` with every tensor on ``device`` (the same object when they already are)."""
    if weights.embed.device == device:
        return weights
    layers = tuple(layer_to(layer, device) for layer in weights.layers)
    return dataclasses.replace(
        weights,
        embed=weights.embed.to(device),
        rotary=copy.deepcopy(weights.rotary).to(device),  # Module.to moves in place
        final_norm=weights.final_norm.to(device),
        lm_head=weights.lm_head.to(device),
        layers=layers,
    )


def rank_main(conn: Connection) -> None:
    """A rank process's whole life, once connected to rank 0."""
    spec: RankSpec = pickle.loads(conn.recv_bytes())
    torch.set_num_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    rank = spec.shard.rank
    collectives = Collectives(spec.backend, spec.host, spec.port, rank, spec.shard.size)
    state = build_rank_state(spec, collectives)
    del spec  # on a GPU its weights were the host copy: the rank keeps only the device's
    conn.send_bytes(pickle.dumps(READY))
    try:
        _serve(state, conn)
    except (EOFError, OSError):
        pass  # rank 0 went away: the group is over
    except Exception:  # a failed collective (a peer died) or a bad command: leave the group
        _log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    finally:
        collectives.close()


def _serve(state: RankState, conn: Connection) -> None:
    with torch.inference_mode():
        while True:
            command = pickle.loads(conn.recv_bytes())
            if isinstance(command, Stop):
                return
            result = command.apply(state)
            if isinstance(command, REPLYING):
                conn.send_bytes(pickle.dumps(result))


def main(argv: list[str]) -> None:
    """``python -m pagedserve.workers.tp.rank_process HOST PORT RANK`` (key on stdin)."""
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client((host, port), authkey=authkey)
    conn.send_bytes(pickle.dumps(rank))
    rank_main(conn)


if __name__ == "__main__":
    main(sys.argv[1:])
