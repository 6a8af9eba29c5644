"""The elastic worker pool end to end: scale-up under a burst, scale-down that hands the
leaving worker's cache to its peer first, a config change that replaces the workers one at a
time, and a worker killed for good that the pool replaces; no request dropped, every output
equal to the request run alone, and (the leak check) pools, index and views clean, the
retired workers gone from all of them.

No clock decides anything: the burst's streams are held unread (paused on the worker, their
blocks kept), so the KV usage the pool scales on holds until the test reads them; scale-down
is switched on by reconfiguring the pool once the test is ready for it; a drained stream
that is held unread cannot finish in any grace period.
"""

import asyncio
import dataclasses

import ray
from support.cluster import assert_cluster_clean, cluster_config, greedy, run_request, start_router
from support.wait import until

from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.followed import FollowedRevision
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.cluster.pool.pool import gone_for_good
from pagedserve.cluster.pool.spec import WorkerSpec
from pagedserve.cluster.pool.types import MemberState
from pagedserve.workers.protocol.requests import GenerateRequest

MAX_TOKENS = 32  # more than a held stream's buffers take: it pauses before its end
NEVER_S = 3600.0
PIN = 10_000_000  # router-side demand that makes a worker look full, to steer routing


def prompt(seed: int, length: int) -> list[int]:
    return [(7 * seed + 3 * j) % 250 + 1 for j in range(length)]


async def hold(core, token_ids: list[int], request_id: str):
    """A stream started and then left unread: (the generator, its first delta)."""
    request = GenerateRequest(greedy(MAX_TOKENS), prompt_token_ids=token_ids, request_id=request_id)
    stream = core.generate(request)
    return stream, await anext(stream)


async def read_rest(stream, head) -> list[int]:
    tokens = list(head.token_ids)
    async for delta in stream:
        tokens.extend(delta.token_ids)
    return tokens


async def pool_stats(core):
    return await core.membership.pool.stats.remote()


def test_scale_up_under_a_burst_then_scale_down_hands_the_cache_over(ray_cluster):
    config = cluster_config(
        "t-pool",
        num_workers=1,
        min_workers=1,
        max_workers=2,
        engine={"num_kv_blocks": 128},
        scale_up_kv_usage=0.15,  # the held burst takes ~0.2 of the pool; one request < 0.1
        scale_interval_s=0.1,
        scale_down_idle_s=NEVER_S,
        enable_pull=False,  # a hit after the scale-down can only come from the handover
        max_buffered_deltas=4,
    )
    first, second = config.actors.worker_name(0), config.actors.worker_name(1)
    burst = [prompt(i, 40) for i in range(5)]
    warm = prompt(99, 48)

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in burst]
        held = [await hold(core, p, f"b{i}") for i, p in enumerate(burst)]

        async def second_serves() -> bool:
            state = core.workers.get(second)
            return state is not None and state.routable

        await until(second_serves, "the pool to add a worker under the burst")
        warm_tokens, warm_finals = await run_request(core, warm, greedy(16))
        outputs = [await read_rest(stream, head) for stream, head in held]
        added = await pool_stats(core)

        # Scale-down on: the newest idle worker (the second) leaves, its cache first.
        idle_soon = dataclasses.replace(config.scaling, scale_down_idle_s=0.2)
        idle_soon = dataclasses.replace(config, scaling=idle_soon)
        await core.membership.pool.configure.remote(PoolConfig.of(idle_soon))

        async def second_gone():
            stats = await pool_stats(core)
            return stats.counters.workers_removed == 1 and list(core.workers) == [first] and stats

        removed = await until(second_gone, "the second worker to leave")
        receiver = await core.workers[first].handle.stats.remote()
        again_tokens, again_finals = await run_request(core, warm, greedy(16))
        await assert_cluster_clean(core)
        await core.close()
        return (
            alone,
            outputs,
            warm_tokens,
            warm_finals,
            added,
            removed,
            receiver,
            again_tokens,
            again_finals,
        )

    try:
        (
            alone,
            outputs,
            warm_tokens,
            warm_finals,
            added,
            removed,
            receiver,
            again_tokens,
            again_finals,
        ) = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert outputs == alone  # the burst: none dropped, none changed
    assert warm_finals[0].worker_id == second  # the added worker takes requests
    assert added.counters.workers_added == 2 and added.last_action == "add (load)"
    assert [m.worker_id for m in added.membership.members] == [first, second]
    # The handover: the warm prompt (48 tokens, 6 blocks), never run on the first worker,
    # hits its cache there after the second left, with the same answer ...
    assert again_finals[0].worker_id == first and again_tokens == warm_tokens
    assert again_finals[0].usage.cached_tokens >= 40
    # ... because the second pushed it there before it drained.
    assert [m.worker_id for m in removed.membership.members] == [first]
    assert removed.retired == (second,) and removed.counters.handover_blocks >= 6
    assert receiver.blocks_imported >= 6
    with_pytest_raises_value_error(lambda: ray.get_actor(second, namespace=config.namespace))


def with_pytest_raises_value_error(call) -> None:
    try:
        call()
    except ValueError:
        return
    raise AssertionError("the retired worker's actor still exists")


def test_a_config_change_replaces_the_workers_one_at_a_time_without_a_dropped_request(
    ray_cluster,
):
    config = cluster_config(
        "t-roll", num_workers=1, scale_interval_s=0.1, max_buffered_deltas=4, scale_down_grace_s=2.0
    )
    changed = dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_num_seqs=7))
    old, new = config.actors.worker_name(0), config.actors.worker_name(1)
    prompts = [prompt(i, 24) for i in range(3)]

    async def main():
        core = await start_router(config, config_revision=1.0)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in prompts]
        held = [await hold(core, p, f"r{i}") for i, p in enumerate(prompts)]
        # A redeploy with a changed engine config: a new Router replica configures the pool.
        redeployed = await start_router(changed, config_revision=2.0)

        async def rolled() -> bool:
            stats = await redeployed.membership.pool.stats.remote()
            return (
                [m.worker_id for m in stats.membership.members] == [new]
                and all(list(c.workers) == [new] for c in (core, redeployed))
                and gone_for_good(old, config.actors)  # the retire's last step: the actor stopped
            )

        # The held streams cannot finish on the old worker while unread: its drain hands
        # them back. Read once it is gone: the old router replays them on the new worker.
        await until(rolled, "the old worker to be replaced")
        outputs = [await read_rest(stream, head) for stream, head in held]

        # The pool restarts (Ray restarts it with its first config, the old one): it adopts
        # the new worker and follows the newest config the routers send, rolling nothing back.
        pool = redeployed.membership.pool
        before = await pool.stats.remote()
        ray.kill(pool, no_restart=False)

        async def restarted():
            try:
                stats = await pool.stats.remote()
            except ray.exceptions.RayActorError:
                return None
            version, members = stats.membership.version, stats.membership.members
            fresh = version.incarnation != before.membership.version.incarnation
            adopted = [(m.worker_id, m.state) for m in members] == [(new, MemberState.SERVING)]
            return fresh and adopted and stats.membership.config_revision == 2.0 and stats

        await until(restarted, "the pool to restart and adopt the new worker")
        after, finals = await run_request(redeployed, prompts[0], greedy(MAX_TOKENS))
        stats = await pool.stats.remote()
        await assert_cluster_clean(redeployed)
        router_stats = await core.cluster_stats()
        await core.close()
        await redeployed.close()
        return alone, outputs, after, finals, before, stats, router_stats

    try:
        alone, outputs, after, finals, before, stats, router_stats = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert outputs == alone and after[0] == alone[0]  # none dropped, none changed
    assert finals[0].worker_id == new
    (member,) = stats.membership.members
    assert member.state == MemberState.SERVING
    assert member.fingerprint == WorkerSpec.of(changed).fingerprint == stats.fingerprint
    assert before.counters.workers_replaced == 1 and before.retired == (old,)
    assert before.counters.drain_handed_off == len(prompts)
    assert router_stats.router.replays == len(prompts)
    # After the restart: the adopted worker, current, and no decision since (no roll back).
    assert (stats.counters.workers_added, stats.last_action) == (1, "")


def test_a_restarted_pool_holds_its_workers_until_the_newest_config_reaches_it(ray_cluster):
    # Ray restarts the pool with its first (older) config, and only the older router polls:
    # the pool must not roll the workers back to it, however long the newest router takes.
    # (It holds from a control call's deadline after the restart: 10 s in test clusters.)
    config = cluster_config("t-hold", num_workers=1, scale_interval_s=0.1)
    changed = dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_num_seqs=7))
    followed = FollowedRevision(config.actors.pool_name, config.namespace)
    new = config.actors.worker_name(1)

    async def main():
        core = await start_router(config, config_revision=1.0)
        redeployed = await start_router(changed, config_revision=2.0)
        pool = core.membership.pool

        async def rolled() -> bool:
            stats = await pool.stats.remote()
            members = [m.worker_id for m in stats.membership.members]
            return members == [new] and gone_for_good(config.actors.worker_name(0), config.actors)

        await until(rolled, "the old worker to be replaced")
        await redeployed.close()  # the newest router is late: only the older one polls
        before = await pool.stats.remote()
        recorded = followed.stored()
        ray.kill(pool, no_restart=False)

        async def holding():
            try:
                stats = await pool.stats.remote()
            except ray.exceptions.RayActorError:
                return None
            fresh = stats.membership.version.incarnation != before.membership.version.incarnation
            return fresh and stats.counters.rounds_held >= 3 and stats

        held = await until(holding, "the restarted pool to hold for the newest config")
        late = await start_router(changed, config_revision=2.0)  # its poll arrives at last
        tokens, finals = await run_request(late, prompt(0, 24), greedy(MAX_TOKENS))
        after = await pool.stats.remote()
        await assert_cluster_clean(late)
        await core.close()
        await late.close()
        return recorded, held, tokens, finals, after

    try:
        recorded, held, tokens, finals, after = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert recorded == 2.0 and followed.stored() == 0.0  # kept in the GCS; gone with the app
    # Held: configured by the older router only, the adopted worker kept, nothing decided.
    assert held.membership.config_revision == 1.0
    assert [(m.worker_id, m.state) for m in held.membership.members] == [(new, MemberState.SERVING)]
    assert (held.counters.workers_added, held.last_action) == (1, "")
    # Then the newest config reached it: the same worker serves, nothing was rolled back.
    assert after.membership.config_revision == 2.0 and finals[0].worker_id == new
    assert len(tokens[0]) == MAX_TOKENS
    assert (after.counters.workers_added, after.last_action) == (1, "")
    assert after.fingerprint == WorkerSpec.of(changed).fingerprint


def test_a_worker_killed_for_good_is_replaced_and_its_requests_replay_on_a_peer(ray_cluster):
    config = cluster_config("t-lost", num_workers=2, scale_interval_s=0.1, max_buffered_deltas=4)
    replacement = config.actors.worker_name(2)
    prompts = [prompt(i, 24) for i in range(4)]

    async def main():
        core = await start_router(config)
        alone = [(await run_request(core, p, greedy(MAX_TOKENS)))[0][0] for p in prompts]
        held = [await hold(core, p, f"l{i}") for i, p in enumerate(prompts)]
        victim = core.workers[held[0][1].worker_id]  # at least this stream runs on it
        on_victim = sum(head.worker_id == victim.worker_id for _, head in held)
        (survivor,) = set(core.workers) - {victim.worker_id}
        ray.kill(victim.handle, no_restart=True)  # dead for good: Ray will not restart it

        async def replaced():
            stats = await pool_stats(core)
            serving = stats.membership.in_state(MemberState.SERVING)
            state = core.workers.get(replacement)
            routed = state is not None and state.routable and victim.worker_id not in core.workers
            return sorted(serving) == sorted([survivor, replacement]) and routed and stats

        stats = await until(replaced, "the pool to replace the killed worker")
        # Read only now: the victim's streams replay on a peer from the tokens they had.
        outputs = [await read_rest(stream, head) for stream, head in held]
        core.workers[survivor].begin(PIN)  # the replacement looks the one with room
        try:
            served, finals = await run_request(core, prompts[1], greedy(MAX_TOKENS))
        finally:
            core.workers[survivor].end(PIN)
        await assert_cluster_clean(core)
        replays = core.counters.replays
        await core.close()
        return alone, outputs, on_victim, victim.worker_id, stats, served, finals, replays

    try:
        alone, outputs, on_victim, victim_id, stats, served, finals, replays = asyncio.run(main())
    finally:
        stop_worker_group(config)
    assert outputs == alone and served[0] == alone[1]  # none dropped, none changed
    assert replays == on_victim >= 1
    assert finals[0].worker_id == replacement  # the replacement serves
    assert stats.counters.workers_lost == 1 and stats.retired == (victim_id,)
    assert stats.counters.workers_added == 3 and stats.last_action == "add (target)"
    assert stats.target == 2
