"""The soak: a steady, chaotic load on a `RouterCore`, then checks that nothing hung, leaked or
lied. Shared by the bounded CI test (`tests/integration/test_soak.py`) and the long runs of
`pagedserve bench soak`.

The load: requests at a steady concurrency over a few shared prefixes, some with `n > 1`;
some cancelled mid-stream, some with a deadline too short to finish, some malformed. Faults, at
fixed points of the run: one worker killed (Ray restarts it; the router replays its requests),
one KV event batch lost on its way to the index, and a burst past the router's limit.

Every request must end as documented (`Outcome.status`), and the checks (`check_soak`) then ask:
outputs of finished requests equal the same request run alone (greedy), partial ones are a
prefix of it, none hung, every pool is clean, the index agrees with every pool, and the
router's counters agree with what the client saw.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

from pagedserve.cluster.router import RouterCore
from pagedserve.cluster.router_types import GenerateRequest, NoWorkerAvailable, WorkerLost
from pagedserve.workers.errors import Overloaded, RequestRejected
from pagedserve.workers.sampling_params import SamplingParams

KINDS = ("ok", "cancel", "deadline", "bad", "burst")
BAD_INPUTS = ("out_of_vocab", "empty", "too_long", "both_prompts")


@dataclass(frozen=True)
class SoakSpec:
    """The shape of one soak run.

    Attributes:
        num_requests: steady requests (the burst comes on top).
        concurrency: steady requests open at once.
        kill_at, drop_events_at, burst_at: when each fault strikes, as a fraction of the steady
            requests started (None: that fault is skipped).
        burst_size: requests sent at once by the burst.
        hang_timeout_s: a request still open after this long counts as hung.
    """

    num_requests: int = 300
    concurrency: int = 12
    seed: int = 0
    num_prefixes: int = 4
    prefix_len: int = 24
    suffix_len: tuple[int, int] = (2, 12)
    max_tokens: tuple[int, int] = (4, 16)
    multi_branch_fraction: float = 0.15
    cancel_fraction: float = 0.10
    deadline_fraction: float = 0.05
    bad_fraction: float = 0.05
    deadline_s: float = 0.05
    vocab_size: int = 256
    kill_at: float | None = 0.25
    drop_events_at: float | None = 0.5
    burst_at: float | None = 0.7
    burst_size: int = 40
    hang_timeout_s: float = 60.0


@dataclass
class SoakRequest:
    index: int
    kind: str
    params: SamplingParams
    token_ids: list[int] | None = None
    prompt: str | None = None
    bad_input: str | None = None
    timeout_s: float | None = None
    cancel_after: int | None = None  # deltas read before the client closes the stream


@dataclass
class Outcome:
    """How one request ended: `finished`, `cancelled`, `timeout` (its deadline), `rejected`
    (bad input), `refused` (backpressure), `unavailable`, `error` (a failed step) or `hung`."""

    request: SoakRequest
    status: str
    tokens: dict[int, list[int]] = field(default_factory=dict)
    error: str | None = None
    latency_s: float = 0.0


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    faults: dict[str, Any]
    duration_s: float

    def counts(self) -> dict[str, int]:
        return dict(Counter(o.status for o in self.outcomes))

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.outcomes),
            "duration_s": round(self.duration_s, 1),
            "requests_per_s": round(len(self.outcomes) / max(self.duration_s, 1e-9), 1),
            "statuses": self.counts(),
            "kinds": dict(Counter(o.request.kind for o in self.outcomes)),
            "faults": self.faults,
        }


# -------------------------------------------------------------------- plan
def plan_requests(spec: SoakSpec) -> tuple[list[SoakRequest], list[SoakRequest]]:
    """The steady requests and the burst, reproducible from `spec.seed`."""
    rng = random.Random(spec.seed)
    prefixes = [
        [rng.randrange(1, spec.vocab_size) for _ in range(spec.prefix_len)]
        for _ in range(spec.num_prefixes)
    ]

    def request(index: int, kind: str) -> SoakRequest:
        suffix = [rng.randrange(1, spec.vocab_size) for _ in range(rng.randint(*spec.suffix_len))]
        n = 2 if rng.random() < spec.multi_branch_fraction else 1
        params = SamplingParams(
            max_tokens=rng.randint(*spec.max_tokens), temperature=0.0, ignore_eos=True, n=n
        )
        req = SoakRequest(index, kind, params, rng.choice(prefixes) + suffix)
        if kind == "cancel":
            req.cancel_after = rng.randint(1, 3)
        elif kind == "deadline":
            req.timeout_s = spec.deadline_s
        elif kind == "bad":
            _make_bad(req, rng.choice(BAD_INPUTS), spec.vocab_size)
        return req

    steady = []
    for i in range(spec.num_requests):
        roll = rng.random()
        edges = (spec.cancel_fraction, spec.deadline_fraction, spec.bad_fraction)
        kind = "ok"
        for name, edge in zip(("cancel", "deadline", "bad"), edges, strict=True):
            if roll < edge:
                kind = name
                break
            roll -= edge
        steady.append(request(i, kind))
    burst = [request(spec.num_requests + i, "burst") for i in range(spec.burst_size)]
    return steady, burst


def _make_bad(req: SoakRequest, bad_input: str, vocab_size: int) -> None:
    req.bad_input = bad_input
    if bad_input == "out_of_vocab":
        req.token_ids = req.token_ids + [vocab_size * 1000]
    elif bad_input == "empty":
        req.token_ids = []
    elif bad_input == "too_long":
        req.params = SamplingParams(max_tokens=1_000_000, temperature=0.0)
    else:
        req.prompt = "both a prompt and prompt_token_ids"


# --------------------------------------------------------------------- run
async def run_one(core: RouterCore, req: SoakRequest, hang_timeout_s: float) -> Outcome:
    outcome = Outcome(req, "finished")
    start = time.monotonic()
    try:
        await asyncio.wait_for(_stream(core, req, outcome), hang_timeout_s)
    except TimeoutError:
        outcome.status = "hung"
    except Overloaded as error:
        outcome.status, outcome.error = "refused", str(error)
    except RequestRejected as error:
        outcome.status, outcome.error = "rejected", str(error)
    except (NoWorkerAvailable, WorkerLost) as error:
        outcome.status, outcome.error = "unavailable", str(error)
    except Exception as error:  # anything else is a finding, not a crash of the soak
        outcome.status, outcome.error = "error", f"{type(error).__name__}: {error}"
    outcome.latency_s = time.monotonic() - start
    return outcome


async def _stream(core: RouterCore, req: SoakRequest, outcome: Outcome) -> None:
    request = GenerateRequest(
        params=req.params,
        prompt=req.prompt,
        prompt_token_ids=req.token_ids,
        timeout_s=req.timeout_s,
        request_id=f"soak-{req.index}",
    )
    stream = core.generate(request)
    seen = 0
    try:
        async for delta in stream:
            outcome.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            seen += 1
            if delta.error:
                outcome.status, outcome.error = "error", delta.error
            elif delta.finish_reason == "timeout" and outcome.status == "finished":
                outcome.status = "timeout"
            if req.cancel_after is not None and seen >= req.cancel_after:
                outcome.status = "cancelled"
                break
    finally:
        await stream.aclose()


async def run_soak(core: RouterCore, spec: SoakSpec, log=None) -> SoakReport:
    """Drive the load with its faults; every request ends in an `Outcome` (none raise)."""
    steady, burst = plan_requests(spec)
    faults: dict[str, Any] = {}
    gate = asyncio.Semaphore(spec.concurrency)
    strikes = {
        name: int(at * spec.num_requests)
        for name, at in (
            ("kill", spec.kill_at),
            ("drop_events", spec.drop_events_at),
            ("burst", spec.burst_at),
        )
        if at is not None
    }
    tasks: list[asyncio.Task] = []

    async def gated(req: SoakRequest) -> Outcome:
        async with gate:
            return await run_one(core, req, spec.hang_timeout_s)

    start = time.monotonic()
    for i, req in enumerate(steady):
        for name, at in strikes.items():
            if i == at:
                faults[name] = await _strike(core, name, burst, tasks, spec)
                if log:
                    log(f"[{time.monotonic() - start:6.1f}s] request {i}: {name} {faults[name]}")
        while gate.locked():  # keep the steady rate: start the next one when a slot frees
            await asyncio.sleep(0.005)
        tasks.append(asyncio.create_task(gated(req)))
        await asyncio.sleep(0)
    outcomes = await asyncio.gather(*tasks)
    return SoakReport(list(outcomes), faults, time.monotonic() - start)


async def _strike(core: RouterCore, name: str, burst, tasks, spec: SoakSpec) -> Any:
    alive = sorted((w for w in core.workers.values() if w.alive), key=lambda w: -w.inflight)
    if name == "kill" and alive:
        victim = alive[0]  # the busiest: its requests must replay
        ray.kill(victim.handle, no_restart=False)
        return {"worker": victim.worker_id, "inflight": victim.inflight}
    if name == "drop_events" and alive:
        target = alive[-1]
        await asyncio.wait_for(
            target.handle.chaos_drop_next_event_batch.remote(), core.config.rpc_timeout_s
        )
        return {"worker": target.worker_id}
    if name == "burst":
        tasks.extend(asyncio.create_task(run_one(core, r, spec.hang_timeout_s)) for r in burst)
        return {"requests": len(burst)}
    return None
