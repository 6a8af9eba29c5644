"""Per-step attention metadata: where a packed batch's KV lives in the paged pool.

A step packs S sequences' new tokens into one flat batch of T tokens (no padding):

    tokens          | a0 a1 a2 | b0 | c0 c1 |        T = 6
    query_start_loc   0          3    4      6      [S+1]
    seq_lens          past_a+3   past_b+1 past_c+2  [S]   (context incl. the new tokens)
    slot_mapping      block_id * block_size + offset of each new token's K/V   [T]
    block_tables      row s: the physical blocks of sequence s, in logical order  [S, max_blocks]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """What one forward step's attention needs to find its KV in the paged pool."""

    slot_mapping: (
        Tensor  # [T] int64, pool slot (block_id*B + offset) of each new token; -1 = don't store
    )
    block_tables: Tensor  # [S, max_blocks] int32
    query_start_loc: Tensor  # [S+1] int32
    seq_lens: Tensor  # [S] int32, context length of each sequence INCLUDING this step's new tokens
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        """Number of sequences S in the batch."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of new tokens T in the packed batch."""
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one new token (the decode kernel applies)."""
        return self.max_query_len == 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionMetadata:
        """A copy with every tensor on ``device`` (``self`` if they already are)."""
        device = torch.device(device)
        tensors = (self.slot_mapping, self.block_tables, self.query_start_loc, self.seq_lens)
        if all(t.device == device for t in tensors):
            return self
        slot_mapping, block_tables, query_start_loc, seq_lens = (
            t.to(device, non_blocking=non_blocking) for t in tensors
        )
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            max_query_len=self.max_query_len,
        )

    def validate(self) -> None:
        """Check shapes and dtypes (cheap: no device sync).

        Raises:
            ValueError: naming the first field that is wrong.
        """
        expected = (
            ("slot_mapping", self.slot_mapping, 1, torch.int64),
            ("block_tables", self.block_tables, 2, torch.int32),
            ("query_start_loc", self.query_start_loc, 1, torch.int32),
            ("seq_lens", self.seq_lens, 1, torch.int32),
        )
        for name, tensor, ndim, dtype in expected:
            if tensor.ndim != ndim or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {ndim}-d {dtype}, got {tensor.ndim}-d {tensor.dtype}"
                )
        num_seqs = self.num_seqs
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"block_tables has {self.block_tables.shape[0]} rows for {num_seqs} seqs"
            )
        if self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.shape[0]} entries for {num_seqs} seqs"
            )
        if self.max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {self.max_query_len}")
        if self.is_decode_only and self.num_tokens != num_seqs:
            raise ValueError(f"decode-only batch has {self.num_tokens} tokens for {num_seqs} seqs")
