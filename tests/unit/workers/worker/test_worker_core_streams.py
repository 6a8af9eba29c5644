"""WorkerCore's two guards, without Ray: owner leases (the table's rules; an expired owner's
requests aborted, driven by an injected clock and `check_leases`, so no test waits on time) and
bounded stream buffers (an unread stream pauses its request; reading resumes it unchanged)."""

from __future__ import annotations

import asyncio

import pytest
from support.clock import ManualClock
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.stats import PoolCheck
from pagedserve.workers.worker.core import WorkerCore
from pagedserve.workers.worker.lease import LeaseTable

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
# Long enough that the housekeeping task never runs a check of its own during a test.
TIMEOUT_S = 1000.0
DEADLINE_S = 60.0


def test_lease_table_rules():
    clock = ManualClock()
    leases = LeaseTable(10.0, clock)
    leases.attach("a", "r1")
    leases.attach("b", "r2")
    leases.attach("free", None)  # no owner: no lease
    clock.now = 8.0
    leases.renew("r2")
    clock.now = 10.0
    assert leases.expired() == []  # exactly at the timeout: still alive
    clock.now = 10.5
    assert leases.expired() == ["a"]
    assert leases.expired() == []  # reported once
    clock.now = 30.0
    assert leases.expired() == ["b"]
    assert leases.num_expired == 2
    leases.detach("a")
    leases.detach("b")
    leases.detach("free")
    assert leases.num_owners == 0


def test_attach_starts_the_lease_and_bad_timeouts_are_refused():
    clock = ManualClock()
    leases = LeaseTable(10.0, clock)
    leases.renew("r1")
    clock.now = 100.0
    leases.attach("late", "r1")  # the owner just called: its lease starts now
    assert leases.expired() == []
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            LeaseTable(bad)


def make_core(tiny_llama, clock, **options):
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    core = WorkerCore(llm.engine, "w0", lease_timeout_s=TIMEOUT_S, clock=clock, **options)
    return llm, core


async def read_all(stream) -> list:
    return [delta async for delta in stream]


def test_an_owner_that_stops_renewing_loses_its_requests_the_others_go_on(tiny_llama):
    clock = ManualClock()
    llm, core = make_core(tiny_llama, clock, max_buffered_deltas=4)

    async def main():
        dead = core.generate("dead", list(range(20)), LONG, owner_id="router-a")
        alive = core.generate("alive", list(range(30, 50)), LONG, owner_id="router-b")
        offline = core.generate("offline", list(range(60, 80)), LONG)
        for stream in (dead, alive, offline):
            assert (await anext(stream)).finish_reason is None
        # Nobody reads on, so all three pause and are certainly in flight for the check.
        await wait_for(lambda: llm.engine.stats().num_paused == 3, "three paused requests")
        clock.now = 0.75 * TIMEOUT_S
        core.renew_lease("router-b")
        clock.now = 1.5 * TIMEOUT_S  # router-a: 1.5 leases since admission; router-b: 0.75
        assert await core.check_leases() == 1
        assert core.stats().lease_expired == 1
        results = [await within(read_all(s), DEADLINE_S) for s in (dead, alive, offline)]
        await core.close()
        return results, await core.check_pool()

    (dead, alive, offline), pool_check = asyncio.run(main())
    assert dead[-1].finish_reason == "abort"
    assert alive[-1].finish_reason == offline[-1].finish_reason == "length"
    assert core.stats().lease_owners == 0
    assert pool_check == PoolCheck(ok=True, idle=True)
    finish_clean(llm)


def test_the_housekeeping_task_aborts_an_orphan_while_the_engine_is_idle(tiny_llama):
    """An orphan nobody reads is paused (the engine idles) and still ends by its lease."""
    clock = ManualClock()
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    # A short lease so the housekeeping task ticks often; the fake clock decides expiry.
    core = WorkerCore(llm.engine, "w0", lease_timeout_s=0.2, clock=clock, max_buffered_deltas=2)

    async def main():
        stream = core.generate("orphan", list(range(20)), LONG, owner_id="gone")
        await anext(stream)
        await wait_for(lambda: llm.engine.stats().num_paused == 1, "the orphan to pause")
        assert not llm.engine.has_runnable_requests()
        clock.now = 1.0  # past the lease: the next housekeeping tick aborts it
        await wait_for(lambda: core.stats().lease_expired == 1, "the lease to expire")
        rest = await within(read_all(stream), DEADLINE_S)
        await core.close()
        return rest

    rest = asyncio.run(main())
    assert rest[-1].finish_reason == "abort"
    finish_clean(llm)


async def wait_for(condition, what: str) -> None:
    """Poll an observable condition; fail (never pass) when the deadline runs out."""
    end = asyncio.get_running_loop().time() + DEADLINE_S
    while not condition():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("n", [1, 2])
def test_an_unread_stream_pauses_at_its_bound_and_resumes_unchanged(tiny_llama, n):
    clock = ManualClock()
    llm, core = make_core(tiny_llama, clock, max_buffered_deltas=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=n)
    prompt = list(range(20))

    async def main():
        stream = core.generate("r", prompt, params)
        deltas = [await anext(stream)]
        await wait_for(lambda: llm.engine.stats().num_paused == 1, "the request to pause")
        buffered = core.buffered_deltas("r")
        (group,) = llm.engine._groups.values()
        generated = [b.num_output_tokens for b in group.branches]
        # One delta per branch per step, the reader took one: decoding stopped at the bound.
        assert buffered <= 4 + n - 1 and generated[0] == (buffered + 1) // n
        assert not llm.engine.has_runnable_requests()
        deltas += await within(read_all(stream), DEADLINE_S)
        await core.close()
        return deltas

    deltas = asyncio.run(main())
    (expected,) = llm.generate([prompt], params)
    for branch in range(n):
        tokens = [t for d in deltas if d.index == branch for t in d.token_ids]
        assert tokens == expected.outputs[branch].token_ids
    assert llm.engine.stats().num_paused == 0
    finish_clean(llm)
