"""One sequence the engine generates: its tokens, progress, sampling state and timings, and
what it has not yet reported in a delta.

A user request with `n > 1` becomes `n` sequences (branches) that share the prompt's blocks;
`RequestGroup` holds them together with what the request reports as a whole.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pagedserve.workers.engine.detokenizer import IncrementalDetokenizer
from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.engine.pooling import PoolingState
from pagedserve.workers.kv.block_hash import lora_key_of
from pagedserve.workers.protocol.sampling import Pooling, SamplingParams
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMetrics,
    StreamDelta,
    TokenLogprob,
    Usage,
)
from pagedserve.workers.sampling.logprobs import branch_logprobs, prompt_logprobs_of

if TYPE_CHECKING:
    import torch


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SequenceTimings:
    """Monotonic timestamps (seconds) of one sequence's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    # Speculative decoding: verify steps, draft tokens they checked and how many were kept.
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token_latencies.append(now - self.last_token)
        self.last_token = now


@dataclass(eq=False)
class Request:
    """One sequence: prompt, output so far, KV progress and the state its sampler needs.

    `all_token_ids` is prompt + output; `num_computed_tokens` of them have KV in the pool.
    """

    request_id: str
    group_id: str
    branch_index: int
    prompt_len: int
    all_token_ids: list[int]
    params: SamplingParams
    cache_extra_keys: tuple[str, ...]
    priority: int = 0
    tenant: str = ""  # who sent it: the scheduler shares the engine fairly among tenants
    arrival_order: int = 0
    deadline: float | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    timings: SequenceTimings = field(default_factory=lambda: SequenceTimings(time.monotonic()))
    # Branches that will fork from this one once its prompt is computed (n > 1).
    pending_branches: list[Request] = field(default_factory=list)
    # Whether preemption may hand this sequence to a peer (single-branch requests only).
    movable: bool = False
    # P/D: a fresh sequence on a prefill worker leaves for a decode worker once its first
    # token went out (`Engine._hand_off_prefilled`).
    hand_off_after_prefill: bool = False
    # Paused while its stream's reader lags: never scheduled, keeps its blocks, preemptible.
    paused: bool = False
    # This step's draft tokens (speculative decoding): verified after the forward, then cleared.
    draft_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: its grammar's matcher (`params.guided`; set once compiled), and its
    # `bad_words` as token ids (`structured/masking.py`).
    matcher: Any = None
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # What the engine has not yet put in a delta (`Engine._branch_delta` takes it).
    num_reported_tokens: int = 0  # output tokens already reported
    unreported_text: str = ""  # final text produced since the last delta
    reported_finish: bool = False  # the branch's last delta went out
    reported_any: bool = False  # a delta of this branch went out (prompt logprobs ride the first)
    # Log-probabilities, when `params.logprobs` / `params.prompt_logprobs` ask for them: one per
    # output token sampled here, and one per prompt token from the second on (collected by the
    # branch that computes the prompt).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # An embedding request (`params.pooling`): what it pooled so far (`workers/engine/pooling.py`).
    pooling: PoolingState | None = None
    # A beam of a beam search (`params.use_beam_search`): its `BeamGroup`
    # (`workers/beam/groups.py`).
    beam: Any = None

    @functools.cached_property
    def lora_key(self) -> str | None:
        """Its LoRA adapter's key (`workers/lora/`), carried in its cache keys; None: base."""
        return lora_key_of(self.cache_extra_keys)

    def __post_init__(self) -> None:
        if self.params.pooling is not None and self.pooling is None:
            self.pooling = PoolingState(self.params.pooling)

    @property
    def output_token_ids(self) -> list[int]:
        """The output so far (a copy: not for every step)."""
        return self.all_token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.prompt_len

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.all_token_ids) - 1

    @property
    def group_size(self) -> int:
        """Sequences this one runs as once admitted: itself and the branches that fork from
        it, or a beam search's width."""
        size = 1 + len(self.pending_branches)
        return size if self.beam is None else max(size, self.beam.width)

    def preempted_with(self) -> list[Request]:
        """The sequences that yield together with this one: a beam search's live beams go as
        one (this one first)."""
        if self.beam is None:
            return [self]
        return [self, *(beam for beam in self.beam.live if beam is not self)]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ends_unreported(self) -> bool:
        """It ended, and its last delta has not gone out yet."""
        return self.finish_reason is not None and not self.reported_finish

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not all collected yet (by branch 0, which
        computes the prompt; the other branches fork its blocks)."""
        wanted = self.params.prompt_logprobs is not None and self.branch_index == 0
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def skip_prefix_cache(self) -> bool:
        """A cached prompt position is never computed, so it would have no logits to score,
        nor a hidden state to mean-pool."""
        mean_pooled = self.pooling is not None and self.pooling.kind is Pooling.MEAN
        return self.wants_prompt_logprobs or mean_pooled

    def take_delta(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        metrics: RequestMetrics | None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        worker_id: str | None = None,
    ) -> StreamDelta | None:
        """The new tokens and text since the last delta (and, once, how the sequence ended),
        now counted as reported; None when there is nothing to report. `prompt_logprobs` (the
        request's, when asked for) ride on the branch's first delta. Built once, here: the
        worker and the router pass this object on as it is."""
        start = self.num_reported_tokens
        new_ids = self.all_token_ids[self.prompt_len + start :]
        text, ends = self.unreported_text, self.ends_unreported
        if not new_ids and not text and not ends:
            return None
        self.num_reported_tokens += len(new_ids)
        self.unreported_text = ""
        first = not self.reported_any
        self.reported_any = True
        logprobs = branch_logprobs(self, start, self.num_reported_tokens)
        prompt_logprobs = prompt_logprobs if first else None
        if not ends:
            return StreamDelta(
                self.group_id,
                self.branch_index,
                new_ids,
                text,
                worker_id=worker_id,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        self.reported_finish = True
        return StreamDelta(
            self.group_id,
            self.branch_index,
            new_ids,
            text,
            finish_reason=self.finish_reason,
            stop_reason=self.detokenizer.stopped_by if self.detokenizer else None,
            usage=Usage(prompt_tokens, self.num_output_tokens, cached_tokens),
            metrics=metrics,
            worker_id=worker_id,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            embedding=None if self.pooling is None else self.pooling.embedding,
        )


@dataclass
class RequestGroup:
    """One user request: its branches (one `Request` each), prompt, arrival and deadline."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    branches: list[Request]
    arrival: float
    deadline: float | None
    # Branch index → its `RequestHandoff`, once a preemption (or, on a prefill worker, the
    # end of its prefill) moved that branch to a peer.
    handoffs: dict[int, Any] = field(default_factory=dict)
    # A beam search's `BeamGroup` (`workers/beam/groups.py`): `branches` are its live beams.
    beam: Any = None

    @property
    def finished(self) -> bool:
        return all(branch.is_finished for branch in self.branches)

    def take_delta(self, worker_id: str | None = None) -> RequestDelta:
        """Every branch's news since the last delta (see `Request.take_delta`), its deltas
        naming `worker_id`; a beam search reports its best hypotheses once it ends
        (`BeamGroup.take_delta`)."""
        if self.beam is not None:
            return self.beam.take_delta(worker_id)
        # Measured only when a branch ends: never a per-step copy of the latencies.
        ending = any(branch.ends_unreported for branch in self.branches)
        metrics = self.metrics() if ending else None
        prompt_tokens = len(self.prompt_token_ids)
        cached = self.branches[0].num_cached_tokens
        # Prompt log-probabilities go out once per branch, on its first delta.
        unreported = any(not branch.reported_any for branch in self.branches)
        scored = prompt_logprobs_of(self.branches[0]) if unreported else None
        completions = [
            delta
            for branch in self.branches
            if (delta := branch.take_delta(prompt_tokens, cached, metrics, scored, worker_id))
            is not None
        ]
        return RequestDelta(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            dict(self.handoffs),
        )

    def metrics(self) -> RequestMetrics:
        """The request's latencies so far, from its first branch (e2e once all finished)."""
        first = self.branches[0].timings
        queue_time = ttft = tpot = e2e = None
        gaps: tuple[float, ...] = ()
        if first.first_scheduled is not None:
            queue_time = first.first_scheduled - self.arrival
        if first.first_token is not None:
            ttft = first.first_token - self.arrival
            gaps = tuple(first.inter_token_latencies)
            if gaps:
                tpot = sum(gaps) / len(gaps)
        finished = [b.timings.finished for b in self.branches if b.timings.finished is not None]
        if self.finished and finished:
            e2e = max(finished) - self.arrival
        return RequestMetrics(
            queue_time=queue_time,
            ttft=ttft,
            tpot=tpot,
            e2e=e2e,
            inter_token_latencies=gaps,
            num_preemptions=sum(b.timings.num_preemptions for b in self.branches),
            num_verify_steps=sum(b.timings.num_verify_steps for b in self.branches),
            num_draft_tokens=sum(b.timings.num_draft_tokens for b in self.branches),
            num_accepted_tokens=sum(b.timings.num_accepted_tokens for b in self.branches),
        )
