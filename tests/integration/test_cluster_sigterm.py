"""SIGTERM to a worker's process drains it before it exits; `drain_worker_group` (what
`stop_worker_group` runs before it kills anything) drains every worker the same way.

As in test_cluster_drain.py, no clock decides who finishes: every stream is held unread (its
request paused on the worker, see `max_buffered_deltas`) until the worker is draining; then
the ones meant to finish are read to their end, and the one meant to be handed back stays
unread, so it cannot finish within any grace period (nor end there at all: its process exits
past the grace, and the router replays it from what it had read).

Without the drain, SIGTERM ends the process at once: every stream on it would be replayed on
the peer (three replays, the finals from the peer), not finished where it ran.

Own module so that the module-scoped Ray cluster is fresh: every worker slot is free.
"""

import asyncio
import os
import signal

from support.cluster import cluster_config, greedy, run_request, start_router
from support.wait import until

from pagedserve.cluster.pool.group import drain_worker_group, stop_worker_group
from pagedserve.workers.process.pid_files import process_start_time
from pagedserve.workers.protocol.requests import GenerateRequest

PIN = 10_000_000  # router-side demand that makes a worker look full, to steer routing
MAX_TOKENS = 40  # more than a held stream's buffers take: it pauses before its end
HELD_AFTER_STEPS = 4  # a stream's prefill and first tokens, then its worker holds still
GRACE_S = 10.0  # ample for a resumed stream's last ~30 tokens; the held one never ends in it


async def read_rest(stream, head) -> tuple[list[int], str]:
    """The stream's tokens to its end, and the worker its last delta came from (a replayed
    stream's from the worker that took it over)."""
    tokens, last = list(head.token_ids), head
    async for delta in stream:
        tokens.extend(delta.token_ids)
        last = delta
    return tokens, last.worker_id


async def open_held(core, prompts, prefix: str) -> tuple[list, list]:
    """One stream per prompt, each read up to its first delta and then left unread."""
    streams, heads = [], []
    for i, p in enumerate(prompts):
        request = GenerateRequest(greedy(MAX_TOKENS), prompt_token_ids=p, request_id=f"{prefix}{i}")
        streams.append(core.generate(request))
        heads.append(await anext(streams[-1]))
    return streams, heads


def test_sigterm_drains_the_worker_process_then_it_exits(ray_cluster):
    config = cluster_config(
        "t-sigterm",
        num_workers=2,
        enable_push=False,
        enable_pull=False,
        max_buffered_deltas=4,
        drain_grace_s=GRACE_S,
    )
    prompts = [[(13 * i + j) % 200 + 1 for j in range(10)] for i in range(3)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in prompts]
        victim, peer = core.workers.values()
        pid = victim.info.pid  # the worker's own process (`Worker.describe`)
        peer.begin(PIN)  # every stream starts on the victim
        streams, heads = await open_held(core, prompts, "s")
        peer.end(PIN)

        async def all_paused() -> bool:
            return (await victim.handle.stats.remote()).num_paused == len(prompts)

        await until(all_paused, "every unread stream to pause")
        os.kill(pid, signal.SIGTERM)
        # The router learns it from the worker's report and routes nothing new there.
        await until(lambda: victim.draining, "the router to see the victim draining")
        _, during = await run_request(core, prompts[0], greedy(4))
        # Two are read to their end within the grace period; the third stays unread.
        finished = await asyncio.gather(*(read_rest(streams[i], heads[i]) for i in range(2)))

        # The held stream cannot end there: its reader (this test) reads nothing, so Ray
        # holds its generator at a `yield`. Once the grace is over the process exits all the
        # same (`drain_signal.EXIT_DEADLINE_S`), and the stream replays on another worker.
        await until(lambda: process_start_time(pid) is None, "the victim's process to exit")
        handed_back = await read_rest(streams[2], heads[2])
        # Ray restarted the actor, and the router took the new incarnation back.
        await until(
            lambda: victim.alive and victim.info.pid != pid and not victim.draining,
            "the victim's new incarnation to be back in routing",
        )
        stats = await core.cluster_stats()
        await core.close()
        return alone, [*finished, handed_back], during, stats, victim.worker_id, peer.worker_id

    try:
        alone, outputs, during, stats, victim, peer = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert [tokens for tokens, _ in outputs] == alone  # none dropped, none changed
    # The two read to their end finished where they ran; only the held one was replayed (on
    # the peer, or on the victim's new incarnation once that was up).
    assert [worker for _, worker in outputs[:2]] == [victim, victim]
    assert stats.router.replays == 1
    assert during[0].worker_id == peer and stats.router.refused_draining == 0
    assert stats.router.workers_restarted == 1


def test_drain_worker_group_finishes_open_streams(ray_cluster):
    """What `stop_worker_group` (and `pagedserve serve`'s Ctrl-C) does before it kills the
    workers: every worker drains at once, and a stream open on each finishes."""
    config = cluster_config(
        "t-drain-group", num_workers=2, enable_push=False, enable_pull=False, max_buffered_deltas=4
    )
    prompts = [[(7 * i + j) % 200 + 1 for j in range(10)] for i in range(2)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in prompts]
        first, second = core.workers.values()
        # Each worker holds still a few steps into its stream, until both drain: the streams
        # are open when the drain starts however slow the router's pause request is (on a
        # loaded machine a 40-token stream could end before its pause arrived).
        handles = [w.handle for w in (first, second)]
        await asyncio.gather(*(h.chaos_stall.remote(True, HELD_AFTER_STEPS) for h in handles))
        first.begin(PIN)  # one stream on each worker
        streams, heads = await open_held(core, prompts[:1], "g")
        first.end(PIN)
        second.begin(PIN)
        more, more_heads = await open_held(core, prompts[1:], "h")
        second.end(PIN)
        streams, heads = streams + more, heads + more_heads
        drain = asyncio.create_task(asyncio.to_thread(drain_worker_group, config, GRACE_S))

        async def both_draining() -> bool:
            reports = [await w.handle.stats.remote() for w in (first, second)]
            return all(r.draining for r in reports)

        await until(both_draining, "both workers to drain")
        await asyncio.gather(*(h.chaos_stall.remote(False) for h in handles))
        outputs = await asyncio.gather(
            *(read_rest(s, h) for s, h in zip(streams, heads, strict=True))
        )
        results = await drain
        await core.close()
        return alone, outputs, results, [head.worker_id for head in heads]

    try:
        alone, outputs, results, workers = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert [tokens for tokens, _ in outputs] == alone
    assert len(set(workers)) == 2  # one stream on each worker ...
    assert [worker for _, worker in outputs] == workers  # ... finished where it ran
    assert {w: (r.finished, r.handed_off) for w, r in results.items()} == {
        w: (1, 0) for w in workers
    }
