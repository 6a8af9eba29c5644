"""The loads `bench serve-compare` runs its arms at, their workloads, and the order of runs.

A load is a `LoadPoint`: seeded Poisson arrivals at one rate (each of ``--rates``, or the one
``--request-rate``), or ``--closed-loop C``: C clients, each sending its next request when its
last one ended. Every load gets the same prompts (the seed fixes them; only the arrival times
scale with the rate) and every run a fresh server. At each load the arms take turns, forward
on even repeats and backward on odd ones (ours, vllm, vllm, ours, ...), so that a drift in
the machine's load falls on every arm; the loads run one after another in the order given.
Nothing here starts a process, so it is testable alone.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.bench.serve_workload import PlannedRequest


@dataclass(frozen=True)
class LoadPoint:
    """One load: Poisson arrivals at `rate` req/s (inf: all at t = 0), or `concurrency`
    closed-loop clients; exactly one of the two."""

    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("a load is a rate or a closed loop's concurrency, exactly one")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"a rate must be > 0 req/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"a closed loop needs >= 1 client, got {self.concurrency}")

    @property
    def label(self) -> str:
        """How reports name it: ``1 req/s``, ``all at t=0``, ``closed loop x8``."""
        if self.concurrency is not None:
            return f"closed loop x{self.concurrency}"
        assert self.rate is not None
        return "all at t=0" if math.isinf(self.rate) else f"{self.rate:g} req/s"

    @property
    def key(self) -> str:
        """Its name in JSON: ``rate=1``, ``rate=inf``, ``closed=8``."""
        if self.concurrency is not None:
            return f"closed={self.concurrency}"
        return f"rate={self.rate:g}"


def parse_rates(text: str) -> tuple[float, ...]:
    """argparse type of ``--rates``: ``0.5,1,2,4`` → (0.5, 1.0, 2.0, 4.0); each > 0 (``inf``:
    every request at t = 0), none twice."""
    parts = [p.strip() for p in text.split(",")]
    try:
        rates = tuple(float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected rates in req/s separated by commas (like 0.5,1,2,4), got {text!r}"
        ) from None
    bad = [p for p, r in zip(parts, rates, strict=True) if not r > 0]  # nan is not > 0 either
    if bad:
        raise argparse.ArgumentTypeError(f"every rate must be > 0 req/s, got {', '.join(bad)}")
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"a rate is given twice in {text!r}")
    return rates


def load_points(rates: Sequence[float], closed_loop: int | None) -> list[LoadPoint]:
    """The loads in the order they run: each rate, then the closed loop if any."""
    points = [LoadPoint(rate=rate) for rate in rates]
    if closed_loop is not None:
        points.append(LoadPoint(concurrency=closed_loop))
    return points


@dataclass(frozen=True)
class PlannedRun:
    """One timed run to make: `arm` at `point`, its `repeat`-th run there (from 0)."""

    point: LoadPoint
    repeat: int
    arm: str


def plan_runs(arms: Sequence[str], points: Sequence[LoadPoint], repeats: int) -> list[PlannedRun]:
    """Every run in the order it is made: load by load, each repeat with the arms in turn,
    forward on even repeats, backward on odd ones."""
    return [
        PlannedRun(point, repeat, arm)
        for point in points
        for repeat in range(repeats)
        for arm in (arms if repeat % 2 == 0 else list(reversed(arms)))
    ]


def make_prompts(
    tokenizer, num: int, min_len: int, max_len: int, seed: int
) -> list[tuple[int, ...]]:
    """Real text as token ids (`compare_workload`), or random ids without a tokenizer."""
    from pagedserve.bench.compare_workload import random_prompts, text_prompts

    if tokenizer is not None:
        prompts = text_prompts(tokenizer.encode, num, min_len, max_len, seed)
    else:
        prompts = random_prompts(num, min_len, max_len, range(3, 256), seed)
    return [tuple(p) for p in prompts]


def with_arrivals(
    prompts: Sequence[tuple[int, ...]], max_tokens: int, rate: float, seed: int
) -> list[PlannedRequest]:
    """The prompts at seeded Poisson arrivals at `rate` (one draw per seed, scaled by 1/rate:
    every rate gets the same pattern, faster or slower), each asking for `max_tokens`."""
    from pagedserve.bench.serve_workload import PlannedRequest, arrival_times

    arrivals = arrival_times(len(prompts), rate, 1.0, random.Random(f"serve-compare/{seed}"))
    return [
        PlannedRequest(i, arrival, prompt, max_tokens)
        for i, (arrival, prompt) in enumerate(zip(arrivals, prompts, strict=True))
    ]


def workload_at(
    point: LoadPoint, prompts: Sequence[tuple[int, ...]], max_tokens: int, seed: int
) -> list[PlannedRequest]:
    """The workload of one load (a closed loop's arrivals are unused: all at t = 0)."""
    return with_arrivals(prompts, max_tokens, point.rate or math.inf, seed)
