"""`bench scale`'s routing decision alone: `RouterCore.route` in this process, no Ray.

The cluster run measures a decision inside a router process that shares the machine with
everything else; this measures the same code on its own, so the two together say how much of
a decision is the routing code and how much is the machine. The view is filled the real way:
simulated workers (`SimWorkerCore`) serve the workload's requests (system prompt k on worker
k mod N), their KV events go into a real `PrefixIndexState`, and the router's `PrefixView`
applies the state's feed dump. Each worker's `WorkerStats` is its real one.

After each decision the chosen worker counts the request as `RouterCore._stream` does
(`WorkerState.begin`), and the oldest of `inflight` requests ends (`end`), so loads change
between decisions as they do in a router: a router that keeps per-worker state current pays
for those changes inside the next decision, which is what is timed. `begin` + `end` themselves
are timed apart (`bookkeeping_p50_us`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from pagedserve.bench.scale_report import percentile
from pagedserve.bench.scale_worker import SIM_MODEL, SimWorkerConfig, SimWorkerCore
from pagedserve.cluster.index.state import PrefixIndexState
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.kv.block_hash import hash_full_blocks
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class RouteCost:
    """CPU time of one decision (`time.thread_time`), of hashing the prompt alone, and per KV
    event of the index state's `publish` and of a view's `apply` (the two per-event costs
    that grow with the cluster, whatever the replica count)."""

    num_workers: int
    num_decisions: int
    p50_ms: float
    p99_ms: float
    hash_p50_ms: float
    index_us_per_event: float
    view_us_per_entry: float
    bookkeeping_p50_us: float = 0.0  # `begin` of the routed request + `end` of the oldest


@dataclass
class _TimedIndex:
    """A real `PrefixIndexState` whose `publish` CPU time and event count are kept."""

    state: PrefixIndexState
    cpu_s: float = 0.0
    events: int = 0

    def publish(self, worker_id, epoch, events, next_seq) -> None:
        start = time.thread_time()
        self.state.publish(worker_id, epoch, events, next_seq)
        self.cpu_s += time.thread_time() - start
        self.events += len(events)


def filled_router(config, num_workers: int, prompts: list[tuple[int, tuple[int, ...]]]):
    """A `RouterCore` whose view and worker stats come from simulated workers that served
    `prompts` ((system prompt k, tokens) each), and the timed index they fed."""
    from pagedserve.bench.scale import cluster_config

    sim = SimWorkerConfig(config.num_blocks, config.block_size, step_s=0.0)
    index = _TimedIndex(PrefixIndexState())
    state = index.state
    cores = [SimWorkerCore(f"sim-{i}", sim, index.publish) for i in range(num_workers)]
    for core in cores:
        state.apply_snapshot(core.kv_snapshot())
    params = SamplingParams(max_tokens=config.max_tokens)
    for i, (k, tokens) in enumerate(prompts):
        cores[k % num_workers].submit(WorkerRequest.fresh(f"fill-{i}", tokens, params))
    for core in cores:
        while core.waiting or core.running:
            core.step()
            core.publish_events()
    router = RouterCore(cluster_config(config), None, {c.worker_id: None for c in cores})
    for core, worker in zip(cores, router.workers.values(), strict=True):
        worker.mark_alive(core.info())
        worker.stats = core.stats()
    router.model_name = SIM_MODEL
    router.view.apply(state.feed.read(None, 0))
    return router, index


def view_us_per_entry(state: PrefixIndexState) -> float:
    """CPU µs per feed entry for a fresh view that follows the feed from its first entry
    (an empty dump at offset 0, then every entry), as a replica up from the start would."""
    from pagedserve.cluster.index.feed import FeedBatch
    from pagedserve.cluster.index.view import PrefixView

    feed = state.feed
    batch = feed.read(feed.epoch, feed.first_offset)
    view = PrefixView()
    view.apply(FeedBatch(feed.epoch, feed.first_offset, dump={}))
    start = time.thread_time()
    view.apply(batch)
    return 1e6 * (time.thread_time() - start) / max(1, len(batch.entries))


def route_cost(config, num_workers: int, num_decisions: int = 2000) -> RouteCost:
    """Time `num_decisions` routing decisions over the workload's prompts, with two requests
    per worker in flight (each routed one begins on its worker, the oldest ends)."""
    from pagedserve.bench.scale import workload

    planned, _ = workload(config, rate=max(1.0, num_decisions / config.duration_s))
    prompts = [(p.system_prompt, p.token_ids) for p in planned]
    router, index = filled_router(config, num_workers, prompts)
    decisions, hashing, bookkeeping = [], [], []
    inflight: deque = deque()  # (worker, demand) of the requests "streaming"

    async def decide() -> None:
        for _, tokens in prompts:
            start = time.thread_time()
            worker, matched = await router.route(list(tokens), None)
            decisions.append(time.thread_time() - start)
            start = time.thread_time()
            demand = len(tokens) - matched * config.block_size + config.max_tokens  # as _attempt
            worker.begin(demand)
            inflight.append((worker, demand))
            if len(inflight) > 2 * num_workers:
                done, done_demand = inflight.popleft()
                done.end(done_demand)
            bookkeeping.append(time.thread_time() - start)
            start = time.thread_time()
            hash_full_blocks(tokens, config.block_size, (SIM_MODEL,))
            hashing.append(time.thread_time() - start)

    asyncio.run(decide())
    return RouteCost(
        num_workers,
        len(decisions),
        1e3 * percentile(decisions, 0.5),
        1e3 * percentile(decisions, 0.99),
        1e3 * percentile(hashing, 0.5),
        1e6 * index.cpu_s / max(1, index.events),
        view_us_per_entry(index.state),
        1e6 * percentile(bookkeeping, 0.5),
    )


def format_route_cost(cost: RouteCost) -> str:
    return (
        f"routing alone (RouterCore.route in process, {cost.num_workers} workers, "
        f"{cost.num_decisions} decisions): CPU p50 {cost.p50_ms:.3f} ms, "
        f"p99 {cost.p99_ms:.3f} ms; hashing the prompt alone p50 {cost.hash_p50_ms:.3f} ms; "
        f"begin + end per request p50 {cost.bookkeeping_p50_us:.1f} us; "
        f"index state {cost.index_us_per_event:.1f} us/event, "
        f"a view {cost.view_us_per_entry:.1f} us/feed entry"
    )
