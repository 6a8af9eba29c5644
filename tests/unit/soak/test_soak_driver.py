"""The soak's client: a steady request refused by backpressure is sent again after the
refusal's hint until it is served or its client gives up; the burst never retries."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from support.soak.driver import SoakRequest, run_one

from pagedserve.workers.protocol.errors import Overloaded
from pagedserve.workers.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class Delta:
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    usage: None = None
    error: str | None = None


class RefusingCore:
    """Refuses the first `refusals` calls, after a token each time (a refusal met mid-way),
    then streams `tokens`."""

    def __init__(self, refusals: int, tokens: list[int]) -> None:
        self.refusals, self.tokens, self.calls = refusals, tokens, 0

    def generate(self, request):
        self.calls += 1
        return self._stream(refuse=self.calls <= self.refusals)

    async def _stream(self, refuse: bool):
        yield Delta(0, [99])
        if refuse:
            raise Overloaded("the router is full", retry_after_s=0.0)
        yield Delta(0, self.tokens[1:], finish_reason="length")


def request() -> SoakRequest:
    return SoakRequest(0, "ok", SamplingParams(max_tokens=3, temperature=0.0), token_ids=[1, 2])


def test_a_refused_request_is_sent_again_until_it_is_served():
    core = RefusingCore(refusals=2, tokens=[99, 7, 8])
    outcome = asyncio.run(run_one(core, request(), hang_timeout_s=30, retry_refused_s=30))
    assert (outcome.status, outcome.refusals, core.calls) == ("finished", 2, 3)
    assert outcome.tokens == {0: [99, 7, 8]}  # only the served try's tokens
    assert outcome.error is None


def test_without_retries_a_refusal_ends_the_request():
    core = RefusingCore(refusals=1, tokens=[99, 7, 8])
    outcome = asyncio.run(run_one(core, request(), hang_timeout_s=30))
    assert (outcome.status, outcome.refusals, core.calls) == ("refused", 1, 1)
    assert "the router is full" in outcome.error


def test_a_client_gives_up_once_its_retry_time_is_spent():
    core = RefusingCore(refusals=10**6, tokens=[99])

    async def main():
        # Each refusal hints 0 s, so only the give-up time bounds the tries.
        return await run_one(core, request(), hang_timeout_s=30, retry_refused_s=0.05)

    outcome = asyncio.run(main())
    assert outcome.status == "refused" and outcome.refusals == core.calls >= 1
