"""`pagedserve bench fairness`'s arithmetic and its flood's end, without a server: A's tokens per
second over windows come from every request's chunk times, and stopping the flood lets the
requests in flight end (a cancelled one would leave no record and its window no tokens)."""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from pagedserve.bench import fairness
from pagedserve.bench.fairness import ArmResult, Prompts, flood, rate, sequential, tokens_in
from pagedserve.bench.openai_load import RequestRecord


def record(chunks: tuple[float, ...], tokens: int | None) -> RequestRecord:
    return RequestRecord(0, 0.0, 4, tokens or 8, 0.0, chunks[-1], chunks, tokens, "length", 200)


def test_tokens_are_counted_where_their_chunks_arrived():
    one_a_chunk = record((1.0, 2.0, 3.0, 4.0), 4)
    two_a_chunk = record((1.5, 3.5), 4)  # a server may send several tokens in one chunk
    records = [one_a_chunk, two_a_chunk]
    assert tokens_in(records, 1.0, 2.0) == 2 + 2
    assert tokens_in(records, 2.5, 4.0) == 2 + 2
    assert rate(records, [(1.0, 2.0), (2.5, 4.0)]) == pytest.approx(8 / 2.5)


def test_ratios():
    result = ArmResult("fair", 100.0, 250.0, 400.0, 380.0, 0)
    assert result.ttft_ratio == 2.5 and result.tok_s_ratio == pytest.approx(0.95)


class HeldDriver:
    """Each request streams until the test releases it; the flood is stopped while every
    client has one in flight."""

    def __init__(self, clients: int) -> None:
        self.records: list[int] = []
        self.in_flight = 0
        self.clients = clients
        self.all_in_flight = asyncio.Event()
        self.release = asyncio.Event()

    async def send(self, request) -> None:
        self.in_flight += 1
        if self.in_flight == self.clients:
            self.all_in_flight.set()
        await self.release.wait()
        self.in_flight -= 1
        self.records.append(request.index)


def test_stopping_the_flood_lets_every_request_in_flight_end():
    args = argparse.Namespace(flood=5, prompt_tokens=4, flood_tokens=8)

    async def run() -> HeldDriver:
        driver, stop = HeldDriver(args.flood), asyncio.Event()
        task = asyncio.create_task(flood(driver, args, Prompts(4), random.Random(0), stop))
        await driver.all_in_flight.wait()
        stop.set()
        driver.release.set()
        await task
        return driver

    driver = asyncio.run(run())
    assert driver.in_flight == 0 and len(driver.records) >= 5  # each client's last one kept


def test_prompts_are_windows_of_the_text_or_random_ids_without_a_tokenizer():
    rng = random.Random(0)
    text = Prompts(3, tuple(range(100, 120)))
    for _ in range(20):
        window = text.draw(rng)
        assert len(window) == 3 and window == tuple(range(window[0], window[0] + 3))
    ids = Prompts(5).draw(rng)
    assert len(ids) == 5 and all(1 <= i < 256 for i in ids)


class CountingDriver:
    """Records each request's output length; every client's request ends once each client has
    sent one more (a barrier: no client runs ahead), and the flood stops once every client sent
    two."""

    def __init__(self, clients: int, stop: asyncio.Event) -> None:
        self.sent: dict[int, list[int]] = {}
        self.clients = clients
        self.stop = stop
        self.round_sent = asyncio.Barrier(clients)

    async def send(self, request) -> None:
        self.sent.setdefault(request.index // 1_000_000, []).append(request.max_tokens)
        if sum(len(lengths) >= 2 for lengths in self.sent.values()) == self.clients:
            self.stop.set()
        await self.round_sent.wait()


def test_the_flood_s_first_requests_end_at_spread_out_times_and_the_rest_ask_for_all():
    """A flood whose requests all start together with one length would end and be admitted
    together, in waves; a random share of the length for each client's first request spreads
    them as a flood that has run for a while."""
    args = argparse.Namespace(flood=40, prompt_tokens=4, flood_tokens=256)

    async def run() -> dict[int, list[int]]:
        stop = asyncio.Event()
        driver = CountingDriver(args.flood, stop)
        await flood(driver, args, Prompts(4), random.Random(0), stop)
        return driver.sent

    sent = asyncio.run(run())
    firsts = [lengths[0] for lengths in sent.values()]
    assert all(1 <= n <= 256 for n in firsts) and len(set(firsts)) > 30
    assert min(firsts) < 64 and max(firsts) > 192
    assert all(n == 256 for lengths in sent.values() for n in lengths[1:])


class PromptDriver:
    """Keeps each request's prompt; answers at once."""

    t0 = 0.0

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []

    async def send(self, request) -> None:
        self.prompts.append(request.token_ids)


def test_b_pauses_a_random_share_of_its_bound_before_each_request_and_sends_the_same_prompts(
    monkeypatch,
):
    """B's requests, sent back to back, arrive just after a flood step began (the one after the
    step that ended the last request) and wait out nearly all of it; a random pause before each
    sends them at times unrelated to the engine's steps. The pauses come from their own
    generator: the prompts are those of a run without them."""
    asked: list[float] = []

    async def no_wait(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(fairness.asyncio, "sleep", no_wait)

    def run(pause_ms: float) -> list[tuple[int, ...]]:
        driver, args = PromptDriver(), argparse.Namespace(short_tokens=8, short_pause_ms=pause_ms)
        asyncio.run(
            sequential(
                driver, 20, args, Prompts(3, tuple(range(100))), random.Random(0), random.Random(1)
            )
        )
        return driver.prompts

    unpaused = run(0.0)
    assert asked == [0.0] * 20
    asked.clear()
    assert run(1000.0) == unpaused
    assert len(asked) == 20 and all(0.0 <= s <= 1.0 for s in asked)
    assert len(set(asked)) == 20 and max(asked) - min(asked) > 0.5
