"""Which slice of the model each rank of a tensor-parallel group owns.

Attention is split by KV head: rank r owns a contiguous run of KV heads and the query heads
that read them (GQA keeps each query head with its KV head). The KV heads are split as evenly
as the count allows, so a model with 3 KV heads (SmolLM2-135M) runs with k = 2 as [2, 1]
heads; the MLP's intermediate rows and the LM head's vocabulary rows are split the same way.

    KV heads     | 0 1 | 2 |          k = 2, 3 KV heads, 9 query heads (3 per KV head)
    query heads  | 0-5 | 6-8 |
    intermediate | 0..767 | 768..1535 |
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.workers.engine.checks import EngineConfigError

FLAG = "tensor_parallel_size"


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: the half-open ranges of the model it owns."""

    rank: int
    size: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @property
    def num_kv_heads(self) -> int:
        """KV heads in this rank's slice of the pool."""
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_q_heads(self) -> int:
        """Query heads this rank attends with."""
        return self.q_heads[1] - self.q_heads[0]


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, the first ones one longer when
    ``total`` does not divide (``split_evenly(3, 2) == [(0, 2), (2, 3)]``)."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for part in range(parts):
        length = base + (1 if part < extra else 0)
        ranges.append((start, start + length))
        start += length
    return ranges


def check_tp_size(size: int, num_heads: int, num_kv_heads: int, model_name: str) -> None:
    """Refuse a group size the model cannot be split into.

    Raises:
        EngineConfigError: (field `tensor_parallel_size`) size < 1, or more ranks than KV heads
            (a rank would own no KV head), or query heads that are not a whole number per KV
            head.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngineConfigError(FLAG, f"{FLAG} must be an integer >= 1, got {size!r}")
    if num_heads % num_kv_heads:
        raise EngineConfigError(
            FLAG,
            f"{FLAG} {size}: {model_name} has {num_heads} attention heads for {num_kv_heads} KV "
            "heads, not a whole number per KV head",
        )
    if size > num_kv_heads:
        raise EngineConfigError(
            FLAG,
            f"{FLAG} {size} is more than {model_name}'s {num_kv_heads} KV heads: each rank "
            f"must own at least one (use {FLAG} <= {num_kv_heads})",
        )


def plan_shards(
    size: int, *, num_heads: int, num_kv_heads: int, intermediate: int, vocab: int
) -> list[TPShard]:
    """Every rank's `TPShard` (call `check_tp_size` first)."""
    group = num_heads // num_kv_heads
    kv_ranges = split_evenly(num_kv_heads, size)
    mlp_ranges = split_evenly(intermediate, size)
    vocab_ranges = split_evenly(vocab, size)
    return [
        TPShard(
            rank=rank,
            size=size,
            kv_heads=kv_ranges[rank],
            q_heads=(kv_ranges[rank][0] * group, kv_ranges[rank][1] * group),
            intermediate=mlp_ranges[rank],
            vocab=vocab_ranges[rank],
        )
        for rank in range(size)
    ]
