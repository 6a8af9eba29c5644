"""Pack one step's scheduled sequences into the flat tensors the model runner takes.

seq 0: prefill chunk t0 t1 t2 | seq 1: decode t9 | seq 2: decode t4
input_ids       [t0 t1 t2 t9 t4]           (no padding)
query_start_loc [0, 3, 4, 5]
seq_lens        [3, 10, 5]                  context after this step
logits_indices  rows whose last token's logits are sampled, then (prompt log-probabilities only)
                every prompt position of the chunks that score the prompt, then (speculative
                decoding) every position of each verify chunk: last token + its k drafts
hidden_indices  rows whose final hidden state an embedding request pools
(`workers/engine/pooling.py`):
                its last prompt token, or every prompt position (mean pooling)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.workers.engine.request import Request
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.sampling.logprobs import prompt_logprob_positions


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Request]  # sequences whose next token this step produces, in logits order
    # After the sampled rows: (request, prompt positions) whose logits score the prompt.
    prompt_rows: list[tuple[Request, range]] = field(default_factory=list)
    # Last: sequences verifying drafts, each with len(draft_token_ids) + 1 rows of logits.
    verified: list[Request] = field(default_factory=list)
    # Embedding requests: (request, the prompt positions its rows of `hidden_indices` hold).
    pooled: list[tuple[Request, range]] = field(default_factory=list)
    hidden_indices: torch.Tensor | None = None  # None: no request pools this step

    @property
    def num_verify_rows(self) -> int:
        return sum(len(r.draft_token_ids) + 1 for r in self.verified)


def build_batch(scheduled: dict[Request, int], kv: KVCacheManager, device: torch.device) -> Batch:
    """Flatten `{sequence: tokens this step}` into a packed batch with its paged metadata."""
    B = kv.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    starts = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    prompt_rows: list[tuple[Request, range]] = []
    prompt_indices: list[int] = []
    verified: list[Request] = []
    verify_indices: list[int] = []
    pooled: list[tuple[Request, range]] = []
    hidden_indices: list[int] = []
    for request, num_new in scheduled.items():
        start = request.num_computed_tokens
        end = start + num_new
        drafts = request.draft_token_ids
        block_ids = kv.get_block_ids(request.request_id)
        input_ids.extend(request.all_token_ids[start : end - len(drafts)])
        input_ids.extend(drafts)
        positions.extend(range(start, end))
        tables.append(block_ids)
        starts.append(starts[-1] + num_new)
        seq_lens.append(end)
        if request.pooling is not None:  # never sampled: its hidden states instead
            positions_pooled = request.pooling.positions_to_pool(start, end, request.prompt_len)
            pooled.append((request, positions_pooled))
            first_row = starts[-2] - start
            hidden_indices.extend(first_row + p for p in positions_pooled)
        elif drafts:
            verified.append(request)
            verify_indices.extend(range(starts[-1] - len(drafts) - 1, starts[-1]))
        elif end == len(request.all_token_ids):
            logits_indices.append(starts[-1] - 1)
            sampled.append(request)
        if request.wants_prompt_logprobs:
            scored = prompt_logprob_positions(
                start, num_new, request.prompt_len, len(request.prompt_logprobs)
            )
            if scored:
                prompt_rows.append((request, scored))
                first_row = starts[-2] + scored.start - start
                prompt_indices.extend(range(first_row, first_row + len(scored)))
    width = max(len(table) for table in tables)
    padded = [table + [0] * (width - len(table)) for table in tables]
    block_tables = torch.tensor(padded, dtype=torch.int32)
    position_ids = torch.tensor(positions, dtype=torch.int64)
    slot_mapping = _slot_mapping(block_tables, position_ids, list(scheduled.values()), B)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(scheduled.values()),
    )
    return Batch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=position_ids.to(device),
        metadata=metadata,
        logits_indices=torch.tensor(
            logits_indices + prompt_indices + verify_indices, dtype=torch.int64, device=device
        ),
        sampled=sampled,
        prompt_rows=prompt_rows,
        verified=verified,
        pooled=pooled,
        hidden_indices=torch.tensor(hidden_indices, dtype=torch.int64, device=device)
        if pooled
        else None,
    )


def _slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, num_new: list[int], block_size: int
) -> torch.Tensor:
    """The pool slot of each new token, `block_tables[seq, pos // B] * B + pos % B`, in one
    gather for the whole batch (no Python per token)."""
    rows = torch.repeat_interleave(torch.arange(len(num_new)), torch.tensor(num_new))
    blocks = block_tables[rows, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size
