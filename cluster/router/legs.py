"""A request's legs on the router: what one leg serves (`Attempt`: a fresh start, a moved
continuation or a replay of one branch), what the client already has of each branch
(`Emitted`), a continuing leg's refusal (`LegRefused`), and the replay legs that continue a
lost worker's unfinished branches on a peer (`replay_plan`). The path that runs them is
`cluster/router/requests.py`.
"""

from __future__ import annotations

import dataclasses

from pagedserve.workers.protocol.errors import Overloaded
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import StreamDelta


@dataclasses.dataclass
class Attempt:
    """One leg of a request: a fresh start, a replay of one branch, or a moved continuation."""

    branch: int | None  # the client's branch index this leg serves (None: all of them)
    prompt: list[int] | None = None
    params: SamplingParams | None = None
    handoff: RequestHandoff | None = None
    source: str | None = None
    refused_by: frozenset[str] = frozenset()  # workers that refused this leg (Overloaded)
    # A replay: `handoff` (no KV) goes to the worker routed for `prompt`, which continues the
    # branch's output and its text exactly where the client's stream stopped.
    replay: bool = False

    @property
    def continues(self) -> bool:
        """A replay or a moved continuation: the client already has part of the answer, so a
        refusal tries the next worker instead of ending the request."""
        return self.branch is not None or self.handoff is not None


@dataclasses.dataclass
class Emitted:
    """What the client has of one branch: its token ids and how much of its text."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_chars: int = 0

    def add(self, delta: StreamDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        self.num_chars += len(delta.text)


class LegRefused(Exception):
    """A worker refused a continuing leg before streaming anything (`Overloaded`)."""

    def __init__(self, worker_id: str, error: Overloaded) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.error = error


def params_left(handoff) -> int:
    return handoff.params.max_tokens - len(handoff.output_token_ids)


def replay_plan(
    request: GenerateRequest,
    request_id: str,
    token_ids: list[int],
    emitted: dict[int, Emitted],
    finished: set[int],
    cache_extra_keys: tuple[str, ...],
    block_size: int,
) -> list[Attempt]:
    """One replay leg per unfinished branch: a handoff without KV, so the peer continues
    from the branch's tokens (recomputing their KV, or hitting its prefix cache) with the
    detokenizer resumed where the client's text stopped: a character split across the
    failure point, or a stop string spanning it, comes out exactly as without it."""
    plan = []
    for j in sorted(set(emitted) - finished):
        done = emitted[j]
        # Prompt log-probabilities went out with the branch's first delta.
        params = dataclasses.replace(request.params.for_branch(j), prompt_logprobs=None)
        handoff = RequestHandoff.replay(
            request_id,
            token_ids,
            done.token_ids,
            done.num_chars,
            params,
            priority=request.priority,
            tenant=request.tenant,
            cache_extra_keys=cache_extra_keys,
            block_size=block_size,
            deadline_remaining_s=request.timeout_s,
        )
        plan.append(Attempt(j, token_ids + done.token_ids, handoff=handoff, replay=True))
    return plan
