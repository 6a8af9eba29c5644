"""Embeddings: a prefill-only request that returns its prompt's pooled final hidden state.

A request whose `SamplingParams.pooling` is set goes through the same admission, routing,
scheduler, prefix cache and packed batches as generation; it is never sampled and never
decodes. Each step the batch asks the model runner for the rows it pools (`Batch.pooled`), taken
after the final norm (what the LM head reads); the engine adds them here, and when the prompt's
last chunk ran it finishes the request (finish reason `stop`, no output token) with its
embedding, freeing its blocks in that step. The full blocks stay in the prefix cache.

    Pooling.LAST  the last prompt position's state (vLLM's default for decoder models)
    Pooling.MEAN  the mean over every prompt position
    then L2-normalised, in float32

The prefix cache: a cached block's positions are never computed here, so they have no hidden
state. The prompt's last token is always computed (`KVCacheManager` never matches it), so LAST
pooling shares cached prefixes and gets the same vector as without them (its KV is the same);
MEAN pooling needs every position, so such a request never takes a hit (`skip_prefix_cache`),
as prompt log-probabilities do. Chunked prefill sums the rows chunk by chunk; a request
preempted by recompute does not add the positions it summed already (`num_positions`).

Torch is not imported here (the router imports `workers/engine/request.py`): tensors come in and
only their methods are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.workers.protocol.sampling import Pooling

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class PoolingState:
    """What one embedding request pooled so far: for MEAN the float32 sum of its positions
    `0 .. num_positions - 1`; at the end its embedding."""

    kind: Pooling
    total: Tensor | None = None
    num_positions: int = 0
    embedding: list[float] | None = None

    def positions_to_pool(self, start: int, end: int, prompt_len: int) -> range:
        """The prompt positions among `start .. end - 1` (this step's chunk) whose hidden
        states this request adds."""
        if self.kind is Pooling.LAST:
            return range(end - 1, end) if end == prompt_len else range(0)
        return range(max(start, self.num_positions), end)

    def add(self, rows: Tensor, positions: range, prompt_len: int) -> bool:
        """Add this step's rows (`[len(positions), hidden]`, after the final norm) of
        `positions`; True once the prompt is done and `embedding` is set."""
        if len(positions):
            summed = rows.float().sum(dim=0)
            self.total = summed if self.total is None else self.total + summed
            self.num_positions = positions.stop
        if self.num_positions < prompt_len:
            return False
        pooled = self.total if self.kind is Pooling.LAST else self.total / prompt_len
        # F.normalize's arithmetic: x / max(||x||, eps).
        self.embedding = (pooled / pooled.norm(p=2).clamp_min(1e-12)).tolist()
        self.total = None
        return True
