"""The engine's side of speculative decoding: drafts before a step, their verification after
its forward.

Before the scheduler runs, each decoding sequence that may speculate gets up to k drafts from
the proposer (`workers/spec/proposer.py`); the scheduler gives it its last token plus the drafts as
one short chunk, and the forward yields logits at every draft position. After it, each sequence's
rows go through the same logit processing as the sampler's (token constraints and the
grammar's bitmask as it stands after each draft: drafts the grammar forbids are dropped before
verification; stop-token suppression, penalties), `workers/spec/verify.py` accepts a prefix of the
drafts plus one token of the target's own, and the tokens are appended one by one through the
engine's stop checks, so a run that stops inside the accepted drafts ends exactly where it
would have without speculation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import torch

from pagedserve.workers.engine.request import Request, RequestGroup, RequestStatus
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.sampling.sampler import (
    Sampler,
    apply_penalties,
    sampling_probs,
    suppress_stop_tokens,
)
from pagedserve.workers.spec.proposer import Proposer
from pagedserve.workers.spec.stats import SpecCounters
from pagedserve.workers.spec.verify import Verdict, verify_greedy, verify_sampled
from pagedserve.workers.structured.masking import constrain_drafts

AppendToken = Callable[[Request, int, float], None]


class SpecDecoding:
    """Drafts and verification for one engine.

    Args:
        proposer: where drafts come from.
        num_tokens: the most drafts a sequence verifies in one step (k).
        max_model_len: the engine's context (a verify chunk writes up to its last draft).
        kv: the engine's KV manager (rejected drafts' slots go back to it).
        sampler: the engine's sampler (a sampled request draws from its own generator).
        eos_token_ids: the model's end-of-sequence ids (suppressed below `min_tokens`).
        counters: the engine's speculation counters.
    """

    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        max_model_len: int,
        kv: KVCacheManager,
        sampler: Sampler,
        eos_token_ids,
        counters: SpecCounters,
        guided=None,
    ) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.kv = kv
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.counters = counters
        self.guided = guided  # `GuidedRequests`: the grammar backend of constrained sequences

    def propose(
        self, running: Iterable[Request], groups: Mapping[str, RequestGroup]
    ) -> list[Request]:
        """Ask the proposer for this step's drafts; the sequences that got some."""
        candidates = [(r, k) for r in running if (k := self.max_drafts(r, groups)) > 0]
        if not candidates:
            return []
        started = time.perf_counter()
        requests = [r for r, _ in candidates]
        proposals = self.proposer.propose(requests, [k for _, k in candidates])
        self.counters.draft_time_s += time.perf_counter() - started
        for request, drafts in zip(requests, proposals, strict=True):
            request.draft_token_ids = list(drafts)
        return [r for r in requests if r.draft_token_ids]

    def max_drafts(self, request: Request, groups: Mapping[str, RequestGroup]) -> int:
        """How many drafts a sequence may verify this step: none unless it is decoding alone
        (not one of n > 1 branches, no log-probabilities asked, not an embedding), and never
        past `max_tokens` or the context (a verify chunk writes positions up to its last draft)."""
        params = request.params
        decoding = request.num_computed_tokens == len(request.all_token_ids) - 1
        if request.status is not RequestStatus.RUNNING or request.paused or not decoding:
            return 0
        if len(groups[request.group_id].branches) > 1 or params.logprobs is not None:
            return 0
        if request.pooling is not None:  # an embedding's last prompt token: never drafted
            return 0
        return max(
            0,
            min(
                self.num_tokens,
                params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - len(request.all_token_ids),
            ),
        )

    def verify(
        self,
        requests: list[Request],
        logits: torch.Tensor,
        append_token: AppendToken,
        now: float,
    ) -> None:
        """Accept each sequence's drafts (rows of `logits`, k + 1 per sequence), append its
        tokens through `append_token` (the engine's stop checks), and release the slots of
        what was rejected."""
        offset = 0
        for request in requests:
            drafts = request.draft_token_ids
            rows = logits[offset : offset + len(drafts) + 1].clone()
            offset += len(drafts) + 1
            verdict = self.verdict(request, rows)
            emitted = 0
            for token in verdict.token_ids:
                append_token(request, token, now)
                emitted += 1
                if request.is_finished:  # a stop inside the run: the rest is dropped
                    break
            if not request.is_finished:
                self.kv.accept_draft_slots(request, verdict.num_accepted)
                request.num_computed_tokens += verdict.num_accepted
            self.counters.on_verified(len(drafts), verdict.num_accepted, emitted)
            request.timings.num_verify_steps += 1
            request.timings.num_draft_tokens += len(drafts)
            request.timings.num_accepted_tokens += verdict.num_accepted
            request.draft_token_ids = []

    def verdict(self, request: Request, rows: torch.Tensor) -> Verdict:
        """Process each row as the sampler would at that position, then verify."""
        drafts = request.draft_token_ids
        if request.params.has_token_constraints:
            backend = None if self.guided is None else self.guided.backend
            drafts = constrain_drafts(rows, request, drafts, backend)
            rows = rows[: len(drafts) + 1]
        params = [request.params] * len(rows)
        num_out = request.num_output_tokens
        suppress_stop_tokens(
            rows, params, [num_out + i for i in range(len(rows))], self.eos_token_ids
        )
        histories = [request.all_token_ids + drafts[:i] for i in range(len(rows))]
        apply_penalties(rows, params, histories, [request.prompt_len] * len(rows))
        if request.params.is_greedy:
            return verify_greedy(rows, drafts)
        generator = self.sampler.generator_of(request.generator)
        return verify_sampled(sampling_probs(rows, params), drafts, generator)
