"""The soak: a steady, chaotic load on a `RouterCore`, then checks that nothing hung, leaked or
lied. Shared by the bounded CI test (`tests/integration/test_soak.py`) and the long runs of
`python -m support.soak`.

The load: requests at a steady concurrency over a few shared prefixes, from several tenants
(each with a prefix cache of its own, as auth gives them), some with `n > 1`; some cancelled
mid-stream, some with a deadline too short to finish, some malformed, some read slowly (their
streams pause). Faults, at fixed points of the run: one worker killed (Ray restarts it; the
router replays its requests), one worker stalled (alive, but its engine takes no step: the
router must end its streams and replay them), one KV event batch lost on its way to the
index, and a burst past the router's limit.

Every request must end as documented (`Outcome.status`), and the checks (`check_soak`) then ask:
outputs of finished requests equal the same request run alone (greedy), partial ones are a
prefix of it, none hung, no request hit another tenant's cached prefix, every pool is clean,
the index agrees with every pool, and the router's counters agree with what the client saw.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray

from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import (
    NoWorkerAvailable,
    Overloaded,
    RequestRejected,
    WorkerLost,
)
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams

KINDS = ("ok", "cancel", "deadline", "bad", "slow", "burst")
BAD_INPUTS = ("out_of_vocab", "empty", "too_long", "both_prompts")


@dataclass(frozen=True)
class SoakSpec:
    """The shape of one soak run.

    Attributes:
        num_requests: steady requests (the burst comes on top).
        concurrency: steady requests open at once.
        kill_at, stall_at, drop_events_at, burst_at: when each fault strikes, as a fraction
            of the steady requests started (None: that fault is skipped). The stall needs a
            cluster with a short `stall_timeout_s`: it lasts until the router judged it.
        num_tenants: tenants the requests come from, each with its own cache scope.
        slow_fraction, slow_read_s: requests whose client waits this long after each delta.
        burst_size: requests sent at once by the burst.
        hang_timeout_s: a request still open after this long counts as hung.
        retry_refused_s: how long a steady client keeps sending a refused request again,
            waiting the refusal's `retry_after_s` between tries, as a client honouring the
            hint does (0: never). The burst never retries: it is there to meet the limits.
            Without retries, how many steady requests a burst's backlog turns away depends
            on the machine's speed (a loaded one refused 121 of 340, a quiet one 28).
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
    slow_fraction: float = 0.05
    slow_read_s: float = 0.2
    num_tenants: int = 2
    deadline_s: float = 0.05
    vocab_size: int = 256
    kill_at: float | None = 0.25
    stall_at: float | None = None  # opt-in: see bench/README.md
    drop_events_at: float | None = 0.5
    burst_at: float | None = 0.7
    burst_size: int = 40
    # Output lengths of the burst's requests (None: `max_tokens`). Longer ones stay in flight
    # while the rest of the burst arrives, so the burst meets the limits even where the
    # front end admits calls slowly (Serve's proxy choosing among several Router replicas).
    burst_max_tokens: tuple[int, int] | None = None
    hang_timeout_s: float = 60.0
    retry_refused_s: float = 60.0


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
    tenant: str = ""
    prefix: int = 0  # which shared prefix its prompt starts with
    read_delay_s: float = 0.0  # a slow reader waits this long after each delta


@dataclass
class Outcome:
    """How one request ended: `finished`, `cancelled`, `timeout` (its deadline), `rejected`
    (bad input), `refused` (backpressure, still refused when its client stopped retrying),
    `unavailable`, `error` (a failed step) or `hung`. `refusals` counts every refusal it met,
    the retried ones included."""

    request: SoakRequest
    status: str
    tokens: dict[int, list[int]] = field(default_factory=dict)
    error: str | None = None
    latency_s: float = 0.0
    started: float = 0.0  # monotonic
    ended: float = 0.0
    cached_tokens: int | None = None  # from the final usage, when it finished
    refusals: int = 0


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    faults: dict[str, Any]
    duration_s: float

    def counts(self) -> dict[str, int]:
        return dict(Counter(o.status for o in self.outcomes))

    @property
    def refusals(self) -> int:
        """Every refusal the clients met, the retried ones included."""
        return sum(o.refusals for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.outcomes),
            "duration_s": round(self.duration_s, 1),
            "requests_per_s": round(len(self.outcomes) / max(self.duration_s, 1e-9), 1),
            "statuses": self.counts(),
            "refusals": self.refusals,
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
        lengths = spec.burst_max_tokens if kind == "burst" and spec.burst_max_tokens else None
        params = SamplingParams(
            max_tokens=rng.randint(*(lengths or spec.max_tokens)),
            temperature=0.0,
            ignore_eos=True,
            n=n,
        )
        prefix = rng.randrange(len(prefixes))
        req = SoakRequest(index, kind, params, prefixes[prefix] + suffix, prefix=prefix)
        req.tenant = f"tenant-{rng.randrange(spec.num_tenants)}"
        if kind == "cancel":
            req.cancel_after = rng.randint(1, 3)
        elif kind == "deadline":
            req.timeout_s = spec.deadline_s
        elif kind == "bad":
            _make_bad(req, rng.choice(BAD_INPUTS), spec.vocab_size)
        elif kind == "slow":
            req.read_delay_s = spec.slow_read_s
        return req

    steady = []
    for i in range(spec.num_requests):
        roll = rng.random()
        edges = (spec.cancel_fraction, spec.deadline_fraction, spec.bad_fraction)
        edges += (spec.slow_fraction,)
        kind = "ok"
        for name, edge in zip(("cancel", "deadline", "bad", "slow"), edges, strict=True):
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
async def run_one(
    core: RouterCore, req: SoakRequest, hang_timeout_s: float, retry_refused_s: float = 0.0
) -> Outcome:
    """Send one request (again after each refusal, for up to `retry_refused_s`) and read it to
    its end; every way it can end is an `Outcome`, none raises."""
    outcome = Outcome(req, "finished")
    start = outcome.started = time.monotonic()
    while (retry_after_s := await _attempt(core, req, outcome, hang_timeout_s)) is not None:
        if time.monotonic() + retry_after_s > start + retry_refused_s:
            break
        await asyncio.sleep(retry_after_s)  # the refusal's own hint, as a client honours it
    outcome.ended = time.monotonic()
    outcome.latency_s = outcome.ended - start
    return outcome


async def _attempt(
    core: RouterCore, req: SoakRequest, outcome: Outcome, hang_timeout_s: float
) -> float | None:
    """One try at the request, recorded in `outcome`: the refusal's retry hint (seconds) when
    it was refused, else None."""
    outcome.status, outcome.error = "finished", None
    outcome.tokens, outcome.cached_tokens = {}, None  # a refused try's tokens are not kept
    try:
        await within(_stream(core, req, outcome), hang_timeout_s)
    except TimeoutError:
        outcome.status = "hung"
    except Overloaded as error:
        outcome.status, outcome.error = "refused", str(error)
        outcome.refusals += 1
        return error.retry_after_s
    except RequestRejected as error:
        outcome.status, outcome.error = "rejected", str(error)
    except (NoWorkerAvailable, WorkerLost) as error:
        outcome.status, outcome.error = "unavailable", str(error)
    except Exception as error:  # anything else is a finding, not a crash of the soak
        outcome.status, outcome.error = "error", f"{type(error).__name__}: {error}"
    return None


async def _stream(core: RouterCore, req: SoakRequest, outcome: Outcome) -> None:
    request = GenerateRequest(
        params=req.params,
        prompt=req.prompt,
        prompt_token_ids=req.token_ids,
        timeout_s=req.timeout_s,
        request_id=f"soak-{req.index}",
        tenant=req.tenant,
        cache_scope=f"tenant:{req.tenant}" if req.tenant else "",
    )
    stream = core.generate(request)
    seen = 0
    try:
        async for delta in stream:
            outcome.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            seen += 1
            if delta.usage is not None:
                outcome.cached_tokens = delta.usage.cached_tokens
            if delta.error:
                outcome.status, outcome.error = "error", delta.error
            elif delta.finish_reason == "timeout" and outcome.status == "finished":
                outcome.status = "timeout"
            if req.cancel_after is not None and seen >= req.cancel_after:
                outcome.status = "cancelled"
                break
            if req.read_delay_s:
                await asyncio.sleep(req.read_delay_s)  # a slow client: its stream pauses
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
            ("stall", spec.stall_at),
            ("drop_events", spec.drop_events_at),
            ("burst", spec.burst_at),
        )
        if at is not None
    }
    tasks: list[asyncio.Task] = []

    async def gated(req: SoakRequest) -> Outcome:
        async with gate:
            return await run_one(core, req, spec.hang_timeout_s, spec.retry_refused_s)

    start = time.monotonic()
    stall: asyncio.Task | None = None
    for i, req in enumerate(steady):
        for name, at in strikes.items():
            if i == at and name == "stall":  # it lasts a while: the load must go on meanwhile
                stall = asyncio.create_task(_stall(core, spec.hang_timeout_s))
            elif i == at:
                if stall is not None:  # one fault at a time: a peer must take the stalled work
                    await asyncio.shield(stall)
                faults[name] = await _strike(core, name, burst, tasks, spec)
                if log:
                    log(f"[{time.monotonic() - start:6.1f}s] request {i}: {name} {faults[name]}")
        while gate.locked():  # keep the steady rate: start the next one when a slot frees
            await asyncio.sleep(0.005)
        tasks.append(asyncio.create_task(gated(req)))
        await asyncio.sleep(0)
    outcomes = await asyncio.gather(*tasks)
    if stall is not None:
        faults["stall"] = await stall
        if log:
            log(f"[{time.monotonic() - start:6.1f}s] stall {faults['stall']}")
    return SoakReport(list(outcomes), faults, time.monotonic() - start)


async def _strike(core: RouterCore, name: str, burst, tasks, spec: SoakSpec) -> Any:
    alive = sorted((w for w in core.workers.values() if w.alive), key=lambda w: -w.inflight)
    if name == "kill" and alive:
        victim = alive[0]  # the busiest: its requests must replay
        ray.kill(victim.handle, no_restart=False)
        return {"worker": victim.worker_id, "inflight": victim.inflight}
    if name == "drop_events" and alive:
        target = alive[-1]
        await within(
            target.handle.chaos_drop_next_event_batch.remote(), core.config.failure.rpc_timeout_s
        )
        return {"worker": target.worker_id}
    if name == "burst":
        tasks.extend(asyncio.create_task(run_one(core, r, spec.hang_timeout_s)) for r in burst)
        return {"requests": len(burst)}
    return None


async def _stall(core: RouterCore, deadline_s: float) -> dict[str, Any]:
    """Hang the busiest worker's engine until the router has judged it stalled (its streams
    then end as lost and replay on peers), then let it step again. Strikes once a worker has
    work to hang and a peer is there to take it."""
    end = time.monotonic() + deadline_s

    def ready() -> bool:  # a peer to take the work, and a worker with work to hang
        alive = [w for w in core.workers.values() if w.alive]
        return len(alive) >= 2 and any(w.inflight for w in alive)

    while not ready() and time.monotonic() < end:
        await asyncio.sleep(0.05)
    victim = max(core.workers.values(), key=lambda w: (w.alive, w.inflight))
    inflight = victim.inflight
    await within(victim.handle.chaos_stall.remote(True), core.config.failure.rpc_timeout_s)
    try:
        while not victim.stalled and victim.alive and time.monotonic() < end:
            await asyncio.sleep(0.05)
        judged = victim.stalled
    finally:
        await within(victim.handle.chaos_stall.remote(False), core.config.failure.rpc_timeout_s)
    return {"worker": victim.worker_id, "inflight": inflight, "judged_stalled": judged}
