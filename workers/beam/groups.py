"""Beam search inside the engine, on shared blocks: a beam group's live beams as sequences.

A beam-search request (`SamplingParams.use_beam_search`, width `n`) is one `RequestGroup`
whose branches are its live beams, one `Request` each; `BeamGroup` holds them with their
cumulative log-probabilities and the `BeamScorer` (`workers/beam/search.py`) that decides.

    step s:   beam A  [p0 p1 p2 p3 | p4 a1 a2 ·]      prompt blocks shared by reference
              beam B  [p0 p1 p2 p3 | p4 b1 b2 ·]
    scorer:   keep A+x, A+y, B+z; drop B+?         → fork A (by reference: no copy), extend
    step s+1: beam A  [p0 … p3 | p4 a1 a2 x]          each beam copies only the partial last
              beam A' [p0 … p3 | p4 a1 a2 y]          block, on its first write into it
              beam B  [p0 … p3 | p4 b1 b2 z]          (copy-on-write in `allocate_slots`)

- A beam's logits wait (as log-probabilities) until every live beam of its group has its own:
  beams computed in one forward step together, but a preempted or swapped beam catches up
  later, and a beam with all its tokens computed is not scheduled (`num_tokens_to_compute`).
- A step forks the parents that keep more than one child (`KVCacheManager.fork`), frees the
  blocks of every beam that keeps none at once, then appends the chosen tokens.
- The group is one scheduling unit: admitted with room for `width` sequences
  (`Request.group_size`), preempted whole (`Request.preempted_with`); after a recompute its
  best beam alone re-enters the waiting queue and the others wait as its `pending_branches`,
  forked from it once it is recomputed so they share the common prefix again (each computes
  only its own suffix). Moving to a peer falls back to recompute: a beam group is not
  `movable`.
- Nothing is reported until the search ends: then the `width` best hypotheses, best first,
  each with its cumulative log-probability.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Collection, Sequence

import torch

from pagedserve.workers.beam.search import BeamScorer, Hypothesis
from pagedserve.workers.engine.detokenizer import IncrementalDetokenizer
from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.engine.request import Request, RequestGroup, RequestStatus
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import FinishReason, StreamDelta, Usage
from pagedserve.workers.scheduler.scheduler import Scheduler


def check_beam_request(params: SamplingParams, max_beam_width: int, speculative: bool) -> None:
    """What only the engine knows refuses a beam search: its width limit, speculation."""
    if params.n > max_beam_width:
        raise RequestRejected(
            f"n: a beam width of {params.n} exceeds this engine's max_beam_width ({max_beam_width})"
        )
    if speculative:
        raise RequestRejected("use_beam_search: not supported with speculative decoding")


class BeamGroup:
    """One beam-search request's live beams, their scores and held log-probabilities.

    Args:
        group: the request; its `branches` are kept equal to the live beams.
        scorer: decides each step (owns the finished hypotheses).
        decode: token ids → text, for the hypotheses' final text (None: no tokenizer).
    """

    def __init__(
        self,
        group: RequestGroup,
        scorer: BeamScorer,
        decode: Callable[[Sequence[int]], str] | None,
    ) -> None:
        self.group = group
        self.scorer = scorer
        self.decode = decode
        self.cumulative: dict[Request, float] = {beam: 0.0 for beam in group.branches}
        self.held: dict[Request, torch.Tensor] = {}  # next-token log-probabilities per beam
        self.done = False
        self.reported = False
        self._ids = itertools.count(1)

    @property
    def live(self) -> list[Request]:
        return self.group.branches

    @property
    def width(self) -> int:
        return self.scorer.width

    def ready(self) -> bool:
        """Whether every live beam holds its next-token log-probabilities and its KV."""
        return all(
            beam in self.held
            and beam.status is RequestStatus.RUNNING
            and beam.num_tokens_to_compute == 0
            and not beam.pending_branches
            for beam in self.live
        )

    def new_beam_id(self) -> str:
        return f"{self.group.request_id}#beam{next(self._ids)}"

    def take_delta(self, worker_id: str | None = None) -> RequestDelta:
        """Nothing until the search ends; then its best hypotheses, best first."""
        completions = []
        if self.group.finished and not self.reported:
            self.reported = True
            completions = self._final_completions(worker_id)
        group = self.group
        return RequestDelta(
            group.request_id, group.prompt, group.prompt_token_ids, completions, group.finished
        )

    def _final_completions(self, worker_id: str | None) -> list[StreamDelta]:
        live = [] if self.done else self.live
        unfinished = [(b.all_token_ids, self.cumulative[b], b.finish_reason) for b in live]
        hypotheses = self.scorer.best(unfinished)
        metrics = dataclasses.replace(
            self.group.metrics(),
            num_preemptions=self.live[0].timings.num_preemptions if self.live else 0,
        )
        prompt_len = len(self.group.prompt_token_ids)
        cached = self.group.branches[0].num_cached_tokens if self.group.branches else 0
        return [
            StreamDelta(
                self.group.request_id,
                index,
                list(h.token_ids),
                self._text(h),
                finish_reason=FinishReason(h.finish_reason),
                usage=Usage(prompt_len, len(h.token_ids), cached),
                metrics=metrics,
                worker_id=worker_id,
                cumulative_logprob=h.cumulative_logprob,
            )
            for index, h in enumerate(hypotheses)
        ]

    def _text(self, hypothesis: Hypothesis) -> str:
        return "" if self.decode is None else self.decode(hypothesis.token_ids)


class BeamSearch:
    """The engine's beam groups: takes their rows out of a step's logits and runs their steps.

    Args:
        scheduler: where forks join the running queue and dropped beams leave it.
        kv: the block tables forks share.
        decode: token ids → final text (None: no tokenizer).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        decode: Callable[[Sequence[int]], str] | None,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.decode = decode

    def start(
        self, group: RequestGroup, max_tokens: int, eos_token_ids: Collection[int]
    ) -> BeamGroup:
        """Make `group` (one branch: the prompt) a beam search; its params say how.

        Args:
            group: the request, as its one branch holds the prompt.
            max_tokens: the longest output (its `max_tokens`, within the model's context).
            eos_token_ids: the model's EOS ids (a hypothesis ends at one, or at a
                `stop_token_ids` id; `ignore_eos` leaves only the latter).
        """
        params = group.branches[0].params
        eos = () if params.ignore_eos else eos_token_ids
        scorer = BeamScorer(
            params.n,
            max_tokens,
            set(eos) | set(params.stop_token_ids),
            len(group.prompt_token_ids),
            params.length_penalty,
            params.early_stopping,
        )
        beam = BeamGroup(group, scorer, self.decode)
        group.beam = beam
        for request in group.branches:
            request.beam = beam
        return beam

    def take_rows(
        self, rows: list[Request], logits: torch.Tensor, touched: dict[str, RequestGroup]
    ) -> tuple[list[Request], torch.Tensor]:
        """Hold the beams' rows of a step's logits, step every group that has all its rows.

        Returns:
            The other rows and their logits (to be sampled as usual).
        """
        beam_rows = [i for i, request in enumerate(rows) if request.beam is not None]
        if not beam_rows:
            return rows, logits
        index = torch.tensor(beam_rows, device=logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)
        groups: dict[int, BeamGroup] = {}
        for row, i in enumerate(beam_rows):
            request = rows[i]
            request.beam.held[request] = logprobs[row]
            self._fork_followers(request)
            groups[id(request.beam)] = request.beam
        now = time.monotonic()
        for beam in groups.values():
            touched[beam.group.request_id] = beam.group
            if beam.ready():
                self.advance(beam, now)
        others = [i for i in range(len(rows)) if rows[i].beam is None]
        kept = logits[torch.tensor(others, device=logits.device)] if others else logits[:0]
        return [rows[i] for i in others], kept

    def advance(self, beam: BeamGroup, now: float) -> None:
        """One beam step: score, drop beams (their blocks freed now), fork, extend."""
        live = list(beam.live)
        cumulative = [beam.cumulative[b] for b in live]
        logprobs = torch.stack([beam.held[b] for b in live])
        beam.held.clear()
        step = beam.scorer.step([b.all_token_ids for b in live], cumulative, logprobs)
        kept = {c.parent for c in step.continuations}
        for index, request in enumerate(live):
            if index not in kept:
                self._drop(beam, request)
        if step.done:
            beam.done = True
            beam.group.branches = live  # every one finished: the group ends
            return
        # Forks first, while each parent still has only its old tokens.
        children: list[Request] = []
        reused: set[int] = set()
        for continuation in step.continuations:
            parent = live[continuation.parent]
            if continuation.parent in reused:
                children.append(self._fork(beam, parent))
            else:
                reused.add(continuation.parent)
                children.append(parent)
        beam.cumulative = {}
        for child, continuation in zip(children, step.continuations, strict=True):
            child.all_token_ids.append(continuation.token)
            beam.cumulative[child] = continuation.cumulative_logprob
        live[0].timings.on_token(now)  # one timeline for the group
        beam.group.branches = children

    def _drop(self, beam: BeamGroup, request: Request) -> None:
        self.scheduler.finish(request)  # frees its blocks now
        request.finish_reason = FinishReason.STOP

    def _fork(self, beam: BeamGroup, parent: Request) -> Request:
        child = _copy_beam(parent, beam.new_beam_id())
        self.kv.fork(parent.request_id, child.request_id)
        self.scheduler.add_running(child)
        return child

    def _fork_followers(self, leader: Request) -> None:
        """A recomputed group's leader is back: its followers share its blocks again up to
        their common prefix and compute only the rest."""
        followers, leader.pending_branches = leader.pending_branches, []
        for follower in followers:
            common = _common_prefix(leader.all_token_ids, follower.all_token_ids)
            self.kv.fork(leader.request_id, follower.request_id, num_tokens=common)
            follower.num_computed_tokens = common
            self.scheduler.add_running(follower)

    def regroup(self, preempted: Sequence[Request]) -> None:
        """After a step's plan: a beam group whose beams were sent back to the waiting
        queue (recompute) re-enters as its best waiting beam, the others pending on it."""
        groups = {id(r.beam): r.beam for r in preempted if r.beam is not None}
        for beam in groups.values():
            # Followers still pending on a leader that yielded again are in no queue.
            waiting = [b for b in beam.live if b.status is RequestStatus.WAITING]
            for request in waiting:
                beam.held.pop(request, None)
                request.pending_branches = []
            if len(waiting) < 2:
                continue
            leader, *followers = waiting
            queue = self.scheduler.waiting
            for follower in followers:
                if follower in queue:
                    queue.remove(follower)
            if leader not in queue:
                self.scheduler.add(leader)
            leader.pending_branches = followers


def _copy_beam(parent: Request, request_id: str) -> Request:
    """A running beam's twin under a new id: same tokens, progress, state and timeline."""
    return dataclasses.replace(
        parent,
        request_id=request_id,
        all_token_ids=list(parent.all_token_ids),
        pending_branches=[],
        draft_token_ids=[],
        output_logprobs=[],
        prompt_logprobs=[],
        detokenizer=None,
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decoder_for(tokenizer) -> Callable[[Sequence[int]], str] | None:
    """A hypothesis's final text, as a streamed output's detokenizer would put it together."""
    if tokenizer is None:
        return None

    def decode(token_ids: Sequence[int]) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer)
        return detokenizer.append(token_ids) + detokenizer.flush()

    return decode
