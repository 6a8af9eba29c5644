"""The gRPC soak's router-kill fault: the Router replica dies mid-stream
(`ray.kill(..., no_restart=False)`) while victims stream through it.

What it must prove: the killed replica's streams end UNAVAILABLE (with another replica left,
the streams that one carried finish OK); no worker keeps decoding a dead router's request past
its lease (`orphans`); Serve brings a replica back and it answers SERVING; new requests
(`probes`) succeed. No victim can finish before the kill, whatever the machine's speed: each
worker takes a bounded number of steps once the victims start, then holds still until the
replica is dead (`RouterKillSpec.steps_before_kill`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.workers.protocol.stats import WorkerStats
from support.soak.driver import SoakRequest
from support.soak.grpc_app import SERVE_NAMESPACE, SoakApp
from support.soak.grpc_calls import GrpcOutcome, call_stream
from support.soak.grpc_faults import FaultRecord, router_counters, wait_until


@dataclass(frozen=True)
class RouterKillSpec:
    """Bounds of the router-kill fault.

    Attributes:
        lease_s: the router's lease on the workers (workers abort a dead router's requests
            once it lapses).
        margin_s: slack past the lease for the abort to land (a poll, an engine step).
        restart_timeout_s: how long Serve may take to bring a Router replica back.
        hang_timeout_s: the bound on the fault's own waits (a victim held by a worker, the
            workers idle after the soak's aborts) and on a probe's silence.
        queued_timeout_s: how long a victim may wait for its first delta: the victims outgrow
            the pool, so some wait in a worker's queue behind the others until the kill. Also
            how long a victim may go silent: the workers hold still until the kill.
        steps_before_kill: engine steps each worker may take once the victims start; then it
            holds still until the kill. A victim makes at most one token a step on each of
            the two workers, so fewer than half its `max_tokens`: none can finish first.
    """

    lease_s: float
    margin_s: float = 3.0
    restart_timeout_s: float = 90.0
    hang_timeout_s: float = 30.0
    queued_timeout_s: float = 300.0
    steps_before_kill: int = 160


async def router_kill(
    app: SoakApp,
    channel: grpc.aio.Channel,
    victims: list[SoakRequest],
    probes: list[SoakRequest],
    spec: RouterKillSpec,
) -> FaultRecord:
    """Kill the Router replica while `victims` stream; then orphans, restart, `probes`.

    No victim can finish before the kill, whatever the machine's speed: each worker takes
    `steps_before_kill` engine steps once the victims start, then holds still
    (`chaos_stall(after_steps)`) until the replica is dead. (Timing it by the victims'
    progress failed on a loaded machine: the victims started so slowly that all 14 had
    finished by the kill.) The kill waits until a victim streamed, so the cut is mid-stream;
    victims still queued then must end UNAVAILABLE all the same.
    """
    record = FaultRecord("router_kill", {"victims": len(victims)})
    workers = await asyncio.to_thread(app.worker_handles)
    _check_victims_fit(len(victims), len(workers), app.config.limits.max_waiting_per_worker)
    half = min(v.params.max_tokens for v in victims) // 2
    if spec.steps_before_kill >= half:
        raise ValueError(
            f"steps_before_kill ({spec.steps_before_kill}) must be under half the victims' "
            f"max_tokens ({half}), or a victim moved between the two workers could finish"
        )
    await _stall_workers(workers, True, spec.steps_before_kill)
    tasks, outcomes = await _start_victims(app, channel, victims, spec)

    async def one_streamed() -> bool:
        return any(o.num_deltas for o in outcomes)

    await wait_until(one_streamed, spec.queued_timeout_s)
    record.facts["streaming_at_kill"] = sum(
        bool(o.num_deltas) and not t.done() for o, t in zip(outcomes, tasks, strict=True)
    )
    record.facts["finished_before_kill"] = sum(t.done() for t in tasks)
    record.facts["router_counters"] = await router_counters(app.grpc_address)
    record.facts["moved_before_kill"] = record.facts["router_counters"].get("migrations.move", 0)
    replicas = await asyncio.to_thread(app.router_replicas)
    killed, survivors = replicas[:1], replicas[1:]  # one replica: the others serve on
    record.facts["killed"] = killed
    record.facts["survivors"] = survivors
    if not replicas:
        record.problems.append("router kill: no Router replica actor found to kill")
    for name in killed:
        handle = await asyncio.to_thread(ray.get_actor, name, SERVE_NAMESPACE)
        await asyncio.to_thread(ray.kill, handle, no_restart=False)
    killed_at = time.monotonic()
    await _stall_workers(workers, False)
    record.outcomes = list(await asyncio.gather(*tasks))
    codes = Counter(o.code for o in record.outcomes)
    record.facts["victim_codes"] = dict(codes)
    _check_victim_codes(codes, bool(survivors), record)
    await _check_orphans(app, victims, killed_at, spec, record)
    await _check_restart(app, channel, killed, len(replicas), killed_at, spec, record)
    probe_outcomes = await asyncio.gather(
        *(call_stream(channel, p, spec.hang_timeout_s) for p in probes)
    )
    record.outcomes += probe_outcomes
    record.facts["probe_codes"] = dict(Counter(o.code for o in probe_outcomes))
    return record


def _check_victims_fit(num_victims: int, num_workers: int, max_waiting: int | None) -> None:
    """Every victim must fit the workers' waiting queues alone: a worker holds still from
    `steps_before_kill` steps after the victims start until the kill, so a victim that reaches
    it after that waits, however many it runs (on a loaded machine, one each), and a queue
    filled then never drains. A refused victim proves nothing about the kill."""
    if max_waiting is not None and num_victims > num_workers * max_waiting:
        raise ValueError(
            f"{num_victims} router-kill victims do not fit {num_workers} workers' waiting "
            f"queues of {max_waiting}: a held-still worker would refuse some"
        )


def _check_victim_codes(codes: Counter[str], survivors: bool, record: FaultRecord) -> None:
    """The killed replica's streams end UNAVAILABLE; with another replica left, the streams it
    carried finish OK (their outputs are checked with every other request's). Each side must
    have had some victims, else the fault proved less than it claims."""
    if not codes.get("UNAVAILABLE"):
        record.problems.append(f"router kill: no victim ended UNAVAILABLE: {dict(codes)}")
    if survivors and not codes.get("OK"):
        record.problems.append(
            f"router kill: no victim streamed through the surviving replica: {dict(codes)}"
        )
    if not survivors and codes.get("OK"):
        record.problems.append(
            f"router kill: {codes['OK']} victims of the only replica ended OK: {dict(codes)}"
        )


async def _stall_workers(workers: dict[str, Any], stalled: bool, after_steps: int = 0) -> None:
    """Hold every worker's engine still after `after_steps` more steps (True), or release it."""
    await asyncio.gather(*(w.chaos_stall.remote(stalled, after_steps) for w in workers.values()))


async def _start_victims(
    app: SoakApp, channel: grpc.aio.Channel, victims: list[SoakRequest], spec: RouterKillSpec
) -> tuple[list[asyncio.Task], list[GrpcOutcome]]:
    """Start the victims one at a time, each once the workers hold every one before it (running
    or queued). Returns the calls and, for each, the outcome it fills in as its deltas arrive."""
    workers = await asyncio.to_thread(app.worker_handles)
    tasks: list[asyncio.Task] = []
    outcomes: list[GrpcOutcome] = []

    async def held() -> bool:
        stats = await asyncio.gather(*(w.stats.remote() for w in workers.values()))
        open_calls = sum(not t.done() for t in tasks)  # a refused victim is done
        return sum(s.num_streams for s in stats) >= open_calls

    for victim in victims:
        outcome = GrpcOutcome(victim)
        call = call_stream(
            channel,
            victim,
            spec.queued_timeout_s,  # silent while the workers hold still
            outcome=outcome,
            queued_timeout_s=spec.queued_timeout_s,
        )
        tasks.append(asyncio.create_task(call))
        outcomes.append(outcome)
        await wait_until(held, spec.hang_timeout_s)
    return tasks, outcomes


async def _check_orphans(
    app: SoakApp,
    victims: list[SoakRequest],
    killed_at: float,
    spec: RouterKillSpec,
    record: FaultRecord,
) -> None:
    """No worker may still run a dead router's request once its lease lapsed (+ margin).

    Nothing else is sent meanwhile, so every request a worker holds then is an orphan. Past
    the bound the soak aborts each victim by id on every worker, so that the rest of the run
    starts clean.
    """
    workers = await asyncio.to_thread(app.worker_handles)
    bound = spec.lease_s + spec.margin_s

    async def all_idle() -> bool:
        pools = await asyncio.gather(*(w.check_pool.remote() for w in workers.values()))
        return all(p.idle for p in pools)

    idle, _ = await wait_until(all_idle, max(killed_at + bound - time.monotonic(), 0.0))
    record.facts["idle_after_kill_s"] = round(time.monotonic() - killed_at, 1) if idle else None
    held = {wid: _held(await w.stats.remote()) for wid, w in workers.items()}
    record.facts["orphans"] = sum(held.values())
    if not idle:
        record.problems.append(
            f"router kill: {sum(held.values())} orphans: {bound:.0f} s after the kill (lease "
            f"{spec.lease_s} s + {spec.margin_s} s) the workers still ran the dead router's "
            f"requests: {held}"
        )
    aborted = 0
    for victim in victims:
        for worker in workers.values():
            aborted += bool(await worker.abort.remote(f"soak-{victim.index}"))
    record.facts["aborted_by_soak"] = aborted
    cleaned, _ = await wait_until(all_idle, spec.hang_timeout_s)
    if not cleaned:
        held = {wid: _held(await w.stats.remote()) for wid, w in workers.items()}
        record.problems.append(
            f"router kill: workers stayed busy after the soak aborted the victims: {held}"
        )


def _held(stats: WorkerStats) -> int:
    """Requests a worker holds: open streams, or engine requests when a stream is gone."""
    engine = stats.num_running + stats.num_waiting + stats.num_swapped
    return max(stats.num_streams, engine)


async def _check_restart(
    app: SoakApp,
    channel: grpc.aio.Channel,
    killed: list[str],
    num_replicas: int,
    killed_at: float,
    spec: RouterKillSpec,
    record: FaultRecord,
) -> None:
    """Serve brings the app back to `num_replicas` Router replicas, and it answers SERVING
    through the gRPC proxy."""
    health = health_pb2_grpc.HealthStub(channel)

    async def serving() -> bool:
        replicas = await asyncio.to_thread(app.router_replicas)
        if len(replicas) < num_replicas or set(replicas) & set(killed):
            return False
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    back, _ = await wait_until(serving, spec.restart_timeout_s)
    record.facts["restarted_after_s"] = round(time.monotonic() - killed_at, 1) if back else None
    record.facts["replicas_after"] = await asyncio.to_thread(app.router_replicas)
    if not back:
        record.problems.append(
            f"router kill: no Router replica served {spec.restart_timeout_s} s after killing "
            f"{killed}"
        )
