"""KV moving between workers: a preempted request moves to a peer with its KV, a worker pulls a
prefix a peer holds, and a worker under eviction pressure pushes cached prefixes to the emptiest
peer. Outputs never change, and the KV that moved is used, not silently computed again: the
receiver's scheduler counts the tokens it prefilled (`WorkerStats.scheduler.prefill_tokens`)."""

import asyncio
import copy
import dataclasses
import pickle
import random
import threading
from dataclasses import dataclass

import pytest
import ray
import torch
from support.cluster import (
    PIN,
    cluster_config,
    greedy,
    run_request,
    start_router,
    until_view_mirrors,
)
from support.wait import until

from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stats import WorkerStats
from pagedserve.workers.protocol.stream import RequestMoved
from pagedserve.workers.transfer import handoff_ref

pytestmark = pytest.mark.usefixtures("ray_cluster")


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


async def worker_stats(core) -> dict[str, WorkerStats]:
    return {wid: await w.handle.stats.remote() for wid, w in core.workers.items()}


@dataclass
class Run:
    """A batch of requests run at once: their results, every worker's stats before and after,
    and how many moves the router followed meanwhile."""

    results: list
    before: dict[str, WorkerStats]
    after: dict[str, WorkerStats]
    moves: int

    def grew(self, counter: str) -> dict[str, int]:
        """Per worker, how much a scheduler counter grew during the run."""
        return {
            wid: getattr(self.after[wid].scheduler, counter)
            - getattr(self.before[wid].scheduler, counter)
            for wid in self.after
        }

    def outputs(self) -> list[list[int]]:
        return [tokens[0] for tokens, _ in self.results]

    def last_workers(self) -> set[str]:
        """The workers the requests ended on."""
        return {final[0].worker_id for _, final in self.results}


def test_preempted_request_moves_with_its_kv_and_output_is_unchanged(hf_reference):
    config = cluster_config(
        "t-move",
        num_workers=2,
        enable_push=False,
        enable_pull=False,
        engine={
            "num_kv_blocks": 20,
            "preemption_mode": "move",
            "watermark": 0.0,
            "enable_prefix_caching": False,
        },
    )
    # Two requests of 30 + 100 tokens need 17 blocks each: both cannot stay in a pool of 20,
    # one alone always fits, so exactly one moves, and the receiver has room for its KV.
    pair = [prompt(300 + i, 30) for i in range(2)]
    # Five of 30 + 30 tokens: moves back and forth, some adopted without room (recomputed).
    prompts = [prompt(100 + i, 30) for i in range(5)]

    async def run_pinned(core, batch, max_tokens):
        """Every request of `batch` at once on the first worker (the second looks full)."""
        _, target = core.workers.values()
        before, moves = await worker_stats(core), core.counters.moves
        target.begin(PIN)
        try:
            results = await asyncio.gather(
                *(run_request(core, p, greedy(max_tokens)) for p in batch)
            )
        finally:
            target.end(PIN)
        return Run(results, before, await worker_stats(core), core.counters.moves - moves)

    moved: list[tuple[int, int, object]] = []  # what the router got: pickled size, KV bytes, type

    def watch_moves(core):
        """Record each `RequestMoved` the router receives, as it receives it."""
        stream = core._stream

        async def watched(worker, request, demand):
            async for delta in stream(worker, request, demand):
                if isinstance(delta, RequestMoved):
                    kv = delta.handoff.packed_kv
                    kv_bytes = (await kv).nbytes if isinstance(kv, ray.ObjectRef) else 0
                    moved.append((len(pickle.dumps(delta)), kv_bytes, type(kv)))
                yield delta

        core._stream = watched

    async def main():
        core = await start_router(config)
        watch_moves(core)
        pair_alone = [(await run_request(core, p, greedy(100)))[0][0] for p in pair]
        alone = [(await run_request(core, p, greedy(30)))[0][0] for p in prompts]
        pair_run = await run_pinned(core, pair, 100)
        run = await run_pinned(core, prompts, 30)
        busy, target = core.workers
        return busy, target, pair_alone, pair_run, alone, run

    try:
        busy, target, pair_alone, pair_run, alone, run = asyncio.run(main())
    finally:
        stop_worker_group(config)
    # The pair: one move, its KV imported by the receiver, which prefilled nothing.
    assert pair_run.moves == 1 and pair_run.grew("moved") == {busy: 1, target: 0}
    assert pair_run.grew("prefill_tokens")[target] == 0, "the moved KV was computed again"
    assert pair_run.after[target].num_steps > pair_run.before[target].num_steps  # it decoded
    assert pair_run.outputs() == pair_alone and pair_run.last_workers() == {busy, target}
    # The five: every move an engine made was followed by the router; outputs unchanged.
    assert run.moves >= 1 and sum(run.grew("moved").values()) == run.moves
    assert run.outputs() == alone and run.last_workers() == {busy, target}
    assert pair_alone == [hf_reference.greedy(p, 100) for p in pair]
    # The KV went source -> target: the router held a ref and small metadata, never the bytes
    # (the test alone resolved the ref, to weigh what the message would have carried).
    assert moved and all(kind is ray.ObjectRef for _, _, kind in moved)
    assert all(size < 4096 < kv_bytes for size, kv_bytes, _ in moved), moved
    assert alone == [hf_reference.greedy(p, 30) for p in prompts]


def test_a_moved_kv_whose_source_died_is_recomputed_not_fatal():
    """The source owns the KV object: once it is dead the ref cannot be resolved, and the
    target adopts the handoff without KV (recomputing from its tokens) instead of failing."""

    @ray.remote(num_cpus=0)
    class Source:
        def put(self):
            return [ray.put(torch.ones(2, 2, 1, 4, 1, 8)) for _ in range(2)]  # refs, not values

        def hang(self):
            threading.Event().wait()  # returns only by the actor's death

    source = Source.remote()
    first, _ = ray.get(source.put.remote())
    handoff = RequestHandoff.replay(
        "moved-1",
        list(range(4)),
        [],
        0,
        SamplingParams(max_tokens=4),
        priority=0,
        cache_extra_keys=("tiny-llama",),
        block_size=4,
        deadline_remaining_s=None,
    )
    handoff = dataclasses.replace(handoff, packed_kv=first, num_computed_tokens=4)
    alive = asyncio.run(handoff_ref.resolved(handoff))
    assert torch.equal(alive.packed_kv, torch.ones(2, 2, 1, 4, 1, 8))
    assert alive.num_computed_tokens == 4
    hanging = source.hang.remote()
    ray.kill(source)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(hanging)  # the source is dead now
    # The KV the dead source was still to produce: a ref no one can resolve any more, for
    # certain (a `ray.put` object of a dead owner may still be read while Ray has not yet
    # learnt of the death, so the first version of this test failed now and then).
    handoff = dataclasses.replace(handoff, packed_kv=hanging)
    lost = asyncio.run(handoff_ref.resolved(handoff))
    assert lost.packed_kv is None and lost.num_computed_tokens == 0
    assert lost.all_token_ids == handoff.all_token_ids


def test_a_pulled_prefix_is_imported_not_recomputed_and_gives_the_same_output(hf_reference):
    config = cluster_config("t-pull", num_workers=2, pull_min_blocks=1, enable_push=False)
    system, suffix = prompt(3, 80), prompt(4, 6)  # 10 full blocks of 8, and 6 tokens more

    async def main():
        core = await start_router(config)
        tokens_here, final = await run_request(core, system + suffix, greedy(10))
        holder = core.workers[final[0].worker_id]
        await until_view_mirrors(core, holder.worker_id)  # the pull is decided on the view
        other = next(w for w in core.workers.values() if w is not holder)
        before = (await worker_stats(core))[other.worker_id]
        holder.begin(PIN)  # the holder looks busy: the router picks the other, which pulls
        try:
            tokens_there, final2 = await run_request(core, system + suffix, greedy(10))
        finally:
            holder.end(PIN)
        after = (await worker_stats(core))[other.worker_id]
        return tokens_here, tokens_there, final2[0], other.worker_id, before, after, core.counters

    try:
        here, there, final2, other_id, before, after, counters = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert final2.worker_id == other_id and there == here
    assert here[0] == hf_reference.greedy(system + suffix, 10)
    assert (counters.pulls, counters.pull_blocks) == (1, 10)
    assert after.blocks_imported - before.blocks_imported == 10
    # The 10 pulled blocks were hits; the receiver prefilled only the 6 tokens past them.
    assert final2.usage.cached_tokens == 80
    assert after.scheduler.prefill_tokens - before.scheduler.prefill_tokens == 6


def test_pressure_pushes_cached_prefixes_that_later_hit_on_the_receiver(hf_reference):
    config = cluster_config(
        "t-push",
        num_workers=2,
        enable_pull=False,
        push_free_fraction=0.5,
        push_max_chains=8,
        engine={"num_kv_blocks": 32, "watermark": 0.0},
    )
    prefixes = [prompt(200 + i, 48) for i in range(4)]

    async def main():
        core = await start_router(config)
        source, receiver = core.workers.values()
        receiver.begin(PIN)
        try:
            for p in prefixes:  # all on `source`: its pool fills with cached prefixes
                await run_request(core, p + [1, 2, 3], greedy(2))
            # The poll loop pushes while `source` is short of blocks.
            await until(lambda: core.counters.pushes, "a push")
        finally:
            receiver.end(PIN)
        # Hits on the receiver are routed by the view: wait until it lists the pushed blocks.
        await until_view_mirrors(core, receiver.worker_id)
        source.begin(PIN)
        try:
            hit_runs = [await run_request(core, p + [4, 5, 6], greedy(8)) for p in prefixes]
        finally:
            source.end(PIN)
        held = await core.index.snapshot_of.remote(receiver.worker_id)
        return copy.deepcopy(core.counters), hit_runs, held, receiver.worker_id

    try:
        counters, hit_runs, held, receiver_id = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert counters.pushes >= 1 and held
    hits = [final[0] for _, final in hit_runs]
    pushed_hits = [d for d in hits if d.worker_id == receiver_id and d.usage.cached_tokens >= 40]
    assert pushed_hits, [(d.worker_id, d.usage) for d in hits]
    # Decoding over pushed KV gives what HF computes with its own cache.
    outputs = [tokens[0] for tokens, _ in hit_runs]
    assert outputs == [hf_reference.greedy(p + [4, 5, 6], 8) for p in prefixes]
