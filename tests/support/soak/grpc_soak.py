"""The soak through the real gRPC front end: Serve's gRPC proxy, the Router replica, workers.

`python -m support.soak --front-end grpc` and `tests/integration/test_soak_grpc.py` run it. The
steady load is the in-process soak's (`driver.plan_requests`: shared prefixes, n > 1,
cancellations, deadlines, malformed inputs; here also gRPC deadlines and requests that do not
parse), sent with raw `GenerateStream` calls so that every status code, detail and trailing
metadata entry is seen as a client sees it. Faults at fixed points of the steady requests:

    burst_at        a burst past the router's max_inflight and the workers' queue bound,
                    alongside the steady load: every refusal RESOURCE_EXHAUSTED + retry-after
    dup_at          duplicate-id pairs                      } each on a quiet cluster: the
    router_kill_at  Router replica killed mid-stream        } steady requests started so far
    index_kill_at   prefix index killed and restarted       } end first (`grpc_faults`,
                                                              `grpc_router_kill`)

Then the checks: codes and details of every request (`grpc_checks`), outputs against
the request run alone, and every pool clean with the index equal to it (`checks`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.cluster.config import (
    ClusterConfig,
    FailureConfig,
    LimitsConfig,
    PlacementConfig,
    RoutingConfig,
    ScalingConfig,
)
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.protocol.sampling import SamplingParams
from support.soak.checks import check_pools_and_index, references_for
from support.soak.driver import SoakRequest, SoakSpec, plan_requests
from support.soak.grpc_app import SoakApp, serving_app
from support.soak.grpc_calls import WIRE_BAD_INPUTS, GrpcOutcome, call_stream
from support.soak.grpc_checks import REFUSED, check_outcomes
from support.soak.grpc_faults import (
    FaultRecord,
    duplicate_pair,
    index_kill,
    router_counters,
)
from support.soak.grpc_router_kill import RouterKillSpec, router_kill


@dataclass(frozen=True)
class GrpcSoakSpec:
    """The shape of one gRPC soak run.

    Attributes:
        load: the steady requests and the burst (`burst_at`, `burst_size`); its worker-kill
            and event-loss points are the in-process soak's and are not used here.
        dup_at, router_kill_at, index_kill_at: when each fault strikes, as a fraction of the
            steady requests started (None: skipped).
        dup_pairs: duplicate-id pairs sent at `dup_at`, one after the other.
        kill_victims: streams open when the router is killed; no more than the workers'
            waiting queues hold (the router-kill fault refuses more).
        victim_tokens: max_tokens of each victim (long: still decoding at the kill).
        probes: requests sent once the router is back.
        lease_s: the router's lease on the workers the run asks for (`lease_options`) and
            holds the cluster to: once it lapsed (+ `lease_margin_s`), a worker still running
            a dead router's request runs an orphan.
        lease_margin_s: slack past the lease for the abort to land (a poll, an engine step).
        restart_timeout_s: how long Serve may take to bring the router back, and Ray the index.
        resync_timeout_s: how long the index, once back, may take to hold every cached block.
    """

    load: SoakSpec = field(default_factory=lambda: SoakSpec(burst_at=0.3, burst_size=60))
    dup_at: float | None = 0.45
    router_kill_at: float | None = 0.6
    index_kill_at: float | None = 0.8
    dup_pairs: int = 3
    kill_victims: int = 12
    victim_tokens: int = 480
    probes: int = 4
    lease_s: float = 3.0
    lease_margin_s: float = 3.0
    restart_timeout_s: float = 90.0
    resync_timeout_s: float = 20.0


@dataclass
class GrpcSoakReport:
    outcomes: list[GrpcOutcome]
    faults: dict[str, list[FaultRecord]]
    duration_s: float
    router_counters: Counter[str]

    def fault_problems(self) -> list[str]:
        return [p for records in self.faults.values() for r in records for p in r.problems]


# -------------------------------------------------------------------- plan
def plan_fault_requests(spec: GrpcSoakSpec, first_index: int) -> dict[str, list[SoakRequest]]:
    """The requests the faults send: duplicate pairs, router-kill victims and probes."""
    rng = random.Random(spec.load.seed + 1)
    index = iter(range(first_index, first_index + 10_000))

    def request(kind: str, max_tokens: int, prompt_len: int = 12) -> SoakRequest:
        token_ids = [rng.randrange(1, spec.load.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return SoakRequest(next(index), kind, params, token_ids)

    return {
        "dup": [request("dup", 24) for _ in range(2 * spec.dup_pairs)],
        "victim": [request("victim", spec.victim_tokens, 8) for _ in range(spec.kill_victims)],
        "probe": [request("probe", 8) for _ in range(spec.probes)],
    }


def grpc_deadlines(steady: list[SoakRequest], deadline_s: float) -> dict[int, float]:
    """Half the `deadline` requests get a gRPC deadline instead of a worker-side timeout_s;
    a third of the `bad` ones are sent as bytes that do not parse. Returns the deadlines."""
    deadlines = {}
    wire = sorted(WIRE_BAD_INPUTS)
    for req in steady:
        if req.kind == "deadline" and req.index % 2 == 0:
            req.timeout_s = None
            deadlines[req.index] = deadline_s
        elif req.kind == "bad" and req.index % 3 == 0:
            req.bad_input = wire[req.index % len(wire)]
    return deadlines


# --------------------------------------------------------------------- run
async def run_grpc_soak(app: SoakApp, spec: GrpcSoakSpec, log: Any = None) -> GrpcSoakReport:
    """Drive the load and strike the faults; every request ends in a `GrpcOutcome`."""
    load = spec.load
    steady, burst = plan_requests(load)
    deadlines = grpc_deadlines(steady, load.deadline_s)
    extra = plan_fault_requests(spec, load.num_requests + len(burst))
    kill = RouterKillSpec(
        spec.lease_s, spec.lease_margin_s, spec.restart_timeout_s, load.hang_timeout_s
    )
    faults: dict[str, list[FaultRecord]] = {}
    counters: Counter[str] = Counter()
    strikes = {
        name: int(at * load.num_requests)
        for name, at in (
            ("burst", load.burst_at),
            ("duplicate_id", spec.dup_at),
            ("router_kill", spec.router_kill_at),
            ("index_kill", spec.index_kill_at),
        )
        if at is not None
    }
    tasks: list[asyncio.Task] = []
    gate = asyncio.Semaphore(load.concurrency)
    start = time.monotonic()
    async with grpc.aio.insecure_channel(app.grpc_address) as channel:

        def send(req: SoakRequest, gated: bool = True) -> None:
            call = call_stream(
                channel, req, load.hang_timeout_s, deadline_s=deadlines.get(req.index)
            )
            tasks.append(asyncio.create_task(_gated(gate, call) if gated else call))

        async def strike(name: str) -> list[FaultRecord]:
            if name == "burst":
                for req in burst:
                    send(req, gated=False)
                return [FaultRecord("burst", {"requests": len(burst)})]
            await asyncio.gather(*tasks)  # a quiet cluster: what the fault proves is exact
            if name == "duplicate_id":
                pairs = zip(extra["dup"][::2], extra["dup"][1::2], strict=True)
                replicas = app.config.scaling.router_replicas
                return [
                    await duplicate_pair(channel, a, b, load.hang_timeout_s, replicas)
                    for a, b in pairs
                ]
            if name == "router_kill":
                # GetStats sums every replica's counters, the killed one's (as of its last
                # report) included: the final read below holds them.
                return [await router_kill(app, channel, extra["victim"], extra["probe"], kill)]
            return [await index_kill(app, spec.restart_timeout_s, spec.resync_timeout_s)]

        for i, req in enumerate(steady):
            for name, at in strikes.items():
                if i == at:
                    faults[name] = await strike(name)
                    if log:
                        facts = [r.facts for r in faults[name]]
                        log(f"[{time.monotonic() - start:6.1f}s] request {i}: {name} {facts}")
            async with gate:  # keep the steady rate: start the next one when a slot frees
                pass
            send(req)
            await asyncio.sleep(0)
        outcomes = list(await asyncio.gather(*tasks))
        counters.update(await router_counters(app.grpc_address))
    for records in faults.values():
        for record in records:
            outcomes += record.outcomes
    return GrpcSoakReport(outcomes, faults, time.monotonic() - start, counters)


async def _gated(gate: asyncio.Semaphore, call: Any) -> GrpcOutcome:
    async with gate:
        return await call


# ------------------------------------------------------------------ checks
async def check_grpc_soak(
    app: SoakApp, report: GrpcSoakReport, settle_s: float = 30.0, log: Any = None
) -> list[str]:
    """Every check of the run: faults, each request, then pools and index (which may take
    `settle_s` to come to rest)."""
    started = time.monotonic()
    workers = await asyncio.to_thread(app.worker_handles)
    index = await asyncio.to_thread(app.index_handle)
    problems = await check_pools_and_index(
        workers, index, app.config.failure.rpc_timeout_s, settle_s
    )
    if log:
        log(f"pools and index checked: {time.monotonic() - started:.1f} s")
    requests = [_as_far_as_seen(o) for o in report.outcomes if any(o.tokens.values())]
    references = await asyncio.to_thread(references_for, app.config.engine, requests)
    problems = report.fault_problems() + check_outcomes(report.outcomes, references) + problems
    if log:
        log(f"checks: {time.monotonic() - started:.1f} s ({len(references)} references)")
    return problems


def _as_far_as_seen(outcome: GrpcOutcome) -> SoakRequest:
    """The request to run alone for `outcome`: whole when it finished; else only as many
    tokens as it streamed (greedy: a shorter run is a prefix of the longer one), which keeps
    the long router-kill victims cheap to check."""
    req = outcome.request
    if outcome.finished:
        return req
    seen = max(len(tokens) for tokens in outcome.tokens.values())
    return dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=seen))


def summarize(report: GrpcSoakReport, problems: list[str], command: str) -> dict[str, Any]:
    """The figures a note quotes: codes, faults, hung, orphans, leaks, INTERNAL, refusals."""
    codes = Counter(o.code for o in report.outcomes)
    refusals = [o for o in report.outcomes if o.code == REFUSED]
    latencies = sorted(o.latency_s * 1000 for o in refusals)
    kill = report.faults.get("router_kill", [FaultRecord("router_kill")])[0]
    return {
        "command": command,
        "requests": len(report.outcomes),
        "duration_s": round(report.duration_s, 1),
        "codes": dict(codes),
        "kinds": dict(Counter(o.request.kind for o in report.outcomes)),
        "internal": codes.get("INTERNAL", 0) + codes.get("UNKNOWN", 0),
        "hung": codes.get("HUNG", 0),
        "orphans": kill.facts.get("orphans"),
        "leaks": sum("pool not clean" in p for p in problems),
        "index_out_of_step": sum("index disagrees" in p for p in problems),
        "refusals": {
            "count": len(refusals),
            "by_router": sum("router streams its limit" in o.details for o in refusals),
            "by_worker": sum("queue is full" in o.details for o in refusals),
            "with_retry_after": sum(o.retry_after is not None for o in refusals),
            "latency_ms_median": round(statistics.median(latencies), 1) if latencies else None,
            "latency_ms_p99": round(_p99(latencies), 1) if latencies else None,
        },
        "faults": {
            name: [{**r.facts, "problems": len(r.problems)} for r in records]
            for name, records in report.faults.items()
        },
        "router_counters": {
            k: v
            for k, v in sorted(report.router_counters.items())
            if k.startswith(("mig", "ref", "pd."))
        },
        "problems": len(problems),
    }


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def lease_options(lease_s: float) -> dict[str, float]:
    """`lease_timeout_s` for the config when this `FailureConfig` has it (the worker-side lease
    that ends a dead router's requests); empty otherwise."""
    names = {f.name for f in dataclasses.fields(FailureConfig)}
    return {"lease_timeout_s": lease_s} if "lease_timeout_s" in names else {}


def grpc_soak_config(
    name: str = "pagedserve-soak-grpc",
    *,
    model: str = "tiny-llama",
    num_workers: int = 2,
    router_replicas: int = 1,
    num_kv_blocks: int = 64,
    block_size: int = 8,
    max_inflight: int = 24,
    max_waiting: int = 6,
    lease_s: float = GrpcSoakSpec.lease_s,
    prefill_workers: int = 0,
    decode_workers: int = 0,
    tiers: dict[str, Any] | None = None,
) -> ClusterConfig:
    """The cluster the gRPC soak runs: a small pool, tight limits, the lease it holds workers to.

    The model is the random tiny one, as in the core soak: what the soak proves (status codes,
    refusals, orphans, resyncs, outputs equal to the request run alone) does not depend on the
    weights, and each request's reference is run alone afterwards (with the real SmolLM2 the
    references of a 250-request run took 5 minutes).

    Sized so that every fault can show what it must (2 workers, defaults):
    - two sequences per engine step (`max_num_seqs=2`) and 6 queued per worker: a worker takes
      8 requests, the router 24, so the burst meets both limits;
    - 63 usable blocks of 8 tokens: two router-kill victims of 8 + 480 tokens cannot both fit,
      so each pair preempts and moves to the peer while the router lives; once it is dead, a
      worker left with its 6 victims (2 running, 4 queued: ~3 x 480 decode steps) would decode
      well past the lease, so an orphan cannot hide by finishing early.

    `prefill_workers` / `decode_workers` split the pool for P/D; `tiers` are the engine's KV
    tier options (`kv_host_tier_bytes`, `kv_disk_tier_dir`, `kv_disk_tier_bytes`).
    """
    return ClusterConfig(
        engine=EngineConfig(
            model=model,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            attention_backend="torch",
            max_num_seqs=2,
            preemption_mode="move",
            **(tiers or {}),
        ),
        name=name,
        scaling=ScalingConfig(
            num_workers=num_workers,
            prefill_workers=prefill_workers,
            decode_workers=decode_workers,
            router_replicas=router_replicas,
        ),
        placement=PlacementConfig(worker_num_cpus=0.5),
        # A push publishes KV events on a quiet cluster, which would let a restarted index
        # catch up by accident; the index-kill fault must see it resync with no event at all.
        routing=RoutingConfig(enable_push=False),
        failure=FailureConfig(
            fault_injection=True,  # the soak stalls workers before their kill
            stats_interval_s=0.2,
            # The router-kill fault holds the workers still while it starts its victims (on a
            # loaded machine, tens of seconds): that is not a stall to judge.
            stall_timeout_s=300.0,
            **lease_options(lease_s),
        ),
        limits=LimitsConfig(
            max_inflight=max_inflight,
            max_waiting_per_worker=max_waiting,
            retry_after_s=0.5,
        ),
    )


def soak_over_grpc(
    config: ClusterConfig, spec: GrpcSoakSpec, command: str, log: Any = None
) -> tuple[GrpcSoakReport, list[str], dict[str, Any]]:
    """Start a local Ray, Serve and the app, run the soak (`soak_app`), tear it all down."""
    with serving_app(config) as app:
        return soak_app(app, spec, command, log)


def soak_app(
    app: SoakApp, spec: GrpcSoakSpec, command: str, log: Any = None
) -> tuple[GrpcSoakReport, list[str], dict[str, Any]]:
    """Run the soak on a running app and check it.

    Returns:
        The report, every problem found (empty: the soak passed) and the summary.
    """

    async def main() -> tuple[GrpcSoakReport, list[str]]:
        report = await run_grpc_soak(app, spec, log)
        return report, await check_grpc_soak(app, report, log=log)

    report, problems = asyncio.run(main())
    return report, problems, summarize(report, problems, command)
