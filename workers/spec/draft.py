"""The `draft` proposer: a smaller model with the target's vocabulary, on its own paged pool.

Per request the draft pool holds KV for the tokens it was fed: the request's tokens, then the
drafts it proposed last step. Before proposing again, the draft's table is truncated to the
prefix that the target kept (its accepted drafts are the request's tokens now), so the draft
pool rolls back in step with the target's:

    step s   fed   t0 … t7 d1 d2          proposes d1 d2 d3 (d3 is never fed)
    target   accepts d1, adds b:  t0 … t7 d1 b
    step s+1 truncate to t0 … t7 d1; feed b; propose from there

Each proposal is `k` forwards of the draft over the batch: one that catches every request up
(its new tokens since last step, as a chunk) and `k - 1` one-token decodes. Drafts are the
draft model's argmax (a one-hot `q` for the verifier).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels import KernelOps
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.loader import LoadedModel, load_model
from pagedserve.workers.model.runner import ModelRunner
from pagedserve.workers.spec.config import SpeculativeConfig
from pagedserve.workers.spec.proposer import DraftRequest, Proposer


@dataclass
class _DraftSeq:
    """One request as the draft pool sees it: the tokens it was fed (KV in the draft pool)."""

    request_id: str
    all_token_ids: list[int]
    num_real: int  # leading fed tokens that were the request's own (the rest were drafts)
    cache_extra_keys: tuple[str, ...] = ()


class DraftModelProposer(Proposer):
    """Owns the draft model's runner, KV pool and per-request tables.

    Args:
        draft: the loaded draft model (its vocabulary must be the target's).
        ops: the kernel ops the target uses.
        block_size: the target's block size.
        num_blocks: blocks in the draft's pool.
        max_model_len: the target's context.
    """

    method = "draft"

    def __init__(
        self,
        draft: LoadedModel,
        ops: KernelOps,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.draft = draft
        kv_cache = KVCache(
            num_layers=draft.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=draft.num_kv_heads,
            head_dim=draft.head_dim,
            dtype=draft.dtype,
            device=draft.device,
            num_swap_blocks=0,
            ops=ops,
        )
        self.kv = KVCacheManager(
            num_blocks, block_size, max_model_len, enable_prefix_caching=False, watermark=0.0
        )
        self.runner = ModelRunner(draft, kv_cache, ops)
        self._seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def from_config(
        cls,
        config: SpeculativeConfig,
        *,
        target: LoadedModel,
        device: torch.device,
        ops: KernelOps,
        **pool,
    ) -> DraftModelProposer:
        """Load the draft onto ``device`` (the engine's serving device), or reuse the target
        when they are the same model and seed and its weights are there (not a tensor-parallel
        rank 0's, released once sharded: the draft then loads whole, unsplit)."""
        same = config.draft_model == pool.pop("target_model") and config.draft_seed == pool.pop(
            "target_seed"
        )
        reusable = same and target.device == device
        draft = target if reusable else _load_draft(config, target, device)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative.draft_model {config.draft_model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens; the target's has {target.vocab_size}"
            )
        num_blocks = config.draft_num_kv_blocks or pool["num_blocks"]
        return cls(draft, ops, pool["block_size"], num_blocks, pool["max_model_len"])

    # --------------------------------------------------------------- propose
    def propose(
        self, requests: Sequence[DraftRequest], max_tokens: Sequence[int]
    ) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        chunks = {}  # request id -> tokens to feed this pass
        limits = {}
        for request, k in zip(requests, max_tokens, strict=True):
            if k <= 0:
                continue
            chunk = self._catch_up(request)
            if chunk is not None:
                chunks[request.request_id] = chunk
                limits[request.request_id] = k
        while chunks:
            for request_id, token in self._forward(chunks).items():
                drafts[request_id].append(token)
            chunks = {}
            for request_id, proposed in drafts.items():
                if len(proposed) < limits.get(request_id, 0) and self._grow(request_id, proposed):
                    chunks[request_id] = [proposed[-1]]
        return [drafts[r.request_id] for r in requests]

    def _catch_up(self, request: DraftRequest) -> list[int] | None:
        """Truncate the draft's table to what the target kept; allocate the tokens after it.

        Returns:
            The tokens to feed, or None when the draft pool has no room (nothing proposed).
        """
        tokens = list(request.all_token_ids)
        seq = self._seqs.get(request.request_id)
        if seq is None:
            seq = _DraftSeq(request.request_id, [], 0)
            self._seqs[request.request_id] = seq
        valid = seq.num_real
        while valid < min(len(seq.all_token_ids), len(tokens) - 1):
            if seq.all_token_ids[valid] != tokens[valid]:
                break
            valid += 1
        valid = min(valid, len(tokens) - 1)  # the last token is fed again for its logits
        if self.kv.has_request(request.request_id):
            self.kv.truncate(request.request_id, valid)
        seq.all_token_ids = tokens
        seq.num_real = len(tokens)
        if self.kv.allocate_slots(seq, len(tokens) - valid) is None:
            self.release(request.request_id)
            return None
        return tokens[valid:]

    def _grow(self, request_id: str, proposed: list[int]) -> bool:
        """One more slot for the newest draft; False (stop drafting) when the pool is full."""
        seq = self._seqs[request_id]
        seq.all_token_ids.append(proposed[-1])
        if self.kv.allocate_slots(seq, 1) is None:
            seq.all_token_ids.pop()
            return False
        return True

    def _forward(self, chunks: dict[str, list[int]]) -> dict[str, int]:
        """One packed forward of the draft over `chunks`; each request's argmax next token."""
        B = self.kv.block_size
        input_ids, positions, slots, tables, starts, seq_lens = [], [], [], [], [0], []
        for request_id, chunk in chunks.items():
            end = len(self._seqs[request_id].all_token_ids)
            start = end - len(chunk)
            block_ids = self.kv.get_block_ids(request_id)
            input_ids.extend(chunk)
            positions.extend(range(start, end))
            slots.extend(block_ids[p // B] * B + p % B for p in range(start, end))
            tables.append(block_ids)
            starts.append(starts[-1] + len(chunk))
            seq_lens.append(end)
        width = max(len(t) for t in tables)
        device = self.draft.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
            ),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            max_query_len=max(len(c) for c in chunks.values()),
        )
        logits = self.runner.execute(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            metadata,
            torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64, device=device),
        )
        tokens = logits.argmax(dim=-1).tolist()
        return dict(zip(chunks, tokens, strict=True))

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.kv.free(request_id)


def _load_draft(
    config: SpeculativeConfig, target: LoadedModel, device: torch.device
) -> LoadedModel:
    dtype = str(target.dtype).removeprefix("torch.")
    return load_model(config.draft_model, dtype=dtype, device=device, seed=config.draft_seed)
