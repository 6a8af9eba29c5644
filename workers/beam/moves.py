"""Moving a beam search to a peer engine as one unit (a group of beams, never one beam).

`Engine.export_beam_group` takes a running search out of its engine between steps: its live
beams' output tokens and cumulative log-probabilities, best first, and its scorer's state (the
finished hypotheses, whether a live beam may still beat them) go into a `BeamGroupHandoff`;
every beam's blocks are freed at once. `Engine.adopt_beam_group` continues it on the peer as
a recompute preemption would: the best beam re-enters the waiting queue with the others pending
on it, and once it is recomputed they fork from it and share their common prefix again
(`workers/beam/groups.py`). The KV itself does not travel (a peer recomputes it from the tokens), so
the search goes on exactly where it stopped: every step after the move scores the same
continuations as it would have at home.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.workers.beam.groups import check_beam_request
from pagedserve.workers.beam.search import Hypothesis
from pagedserve.workers.engine.request import RequestGroup
from pagedserve.workers.kv.block_hash import cache_key
from pagedserve.workers.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class BeamGroupHandoff:
    """Everything a peer needs to continue one beam search."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    max_tokens: int  # the search's own limit (its max_tokens within the source's context)
    beams: tuple[tuple[tuple[int, ...], float], ...]  # live: output tokens, cumulative logprob
    finished: tuple[Hypothesis, ...]
    improvable: bool


class EngineBeamMoves:
    """`Engine`'s beam-group moves (see the module docstring)."""

    def export_beam_group(self, request_id: str) -> BeamGroupHandoff:
        """Take a running beam search out of this engine, between steps, for a peer.

        Raises:
            ValueError: no such search in flight, or it has ended.
        """
        group = self._groups.get(request_id)
        beam = None if group is None else group.beam
        if beam is None or beam.done or group.finished:
            raise ValueError(f"request {request_id!r} is not a beam search in flight")
        del self._groups[request_id]
        live = list(beam.live)
        prompt_len = len(group.prompt_token_ids)
        handoff = BeamGroupHandoff(
            request_id,
            group.prompt,
            tuple(group.prompt_token_ids),
            live[0].params,
            live[0].priority,
            beam.scorer.max_tokens,
            tuple((tuple(b.all_token_ids[prompt_len:]), beam.cumulative[b]) for b in live),
            tuple(beam.scorer.finished),
            beam.scorer.improvable,
        )
        for request in live:  # a follower pending on its leader is in no queue: freed alike
            request.pending_branches = []
            self.scheduler.finish(request)
        self.num_handoffs += 1
        return handoff

    def adopt_beam_group(self, handoff: BeamGroupHandoff) -> None:
        """Continue a beam search a peer handed off (its KV recomputed from the tokens)."""
        params, prompt = handoff.params, list(handoff.prompt_token_ids)
        self.intake.check_fits(len(prompt), params)
        check_beam_request(params, self.config.max_beam_width, self.proposer is not None)
        self._check_not_in_flight(handoff.request_id)
        now = time.monotonic()
        extra_keys = cache_key(self.loaded.name, None)
        beams = []
        for index, (output, _) in enumerate(handoff.beams):
            request = self.intake.new_branch(
                handoff.request_id, index, prompt + list(output), params,
                handoff.priority, extra_keys, None, now,
            )  # fmt: skip
            request.prompt_len = len(prompt)
            beams.append(request)
        group = RequestGroup(handoff.request_id, handoff.prompt, prompt, beams, now, None)
        self._groups[handoff.request_id] = group
        beam = self.beams.start(group, handoff.max_tokens, self.loaded.eos_token_ids)
        beam.scorer.finished = list(handoff.finished)
        beam.scorer.improvable = handoff.improvable
        beam.cumulative = {b: c for b, (_, c) in zip(beams, handoff.beams, strict=True)}
        leader, *followers = beams
        leader.pending_branches = followers
        self.num_adopted_recomputed += 1
        self.scheduler.add(leader)
