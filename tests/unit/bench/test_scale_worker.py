"""The simulated worker of `bench scale`: its blocks and KV events are a real pool's, and no
request leaves anything behind (no Ray: the core alone)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagedserve.bench.scale_worker import SIM_MODEL, SimWorkerConfig, SimWorkerCore, fake_token
from pagedserve.cluster.index.state import PrefixIndexState
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.events import KVSnapshot
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.sampling import SamplingParams

CONFIG = SimWorkerConfig(num_blocks=16, block_size=4, max_model_len=64, step_s=0.0)
SHARED = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks both prompts start with
PROMPT_A = SHARED + [9, 10]
PROMPT_B = SHARED + [11, 12, 13]
MAX_TOKENS = 3


@dataclass
class _Req:
    request_id: str
    all_token_ids: list[int]
    cache_extra_keys: tuple[str, ...] = (SIM_MODEL,)


def _reference() -> tuple[KVCacheManager, dict[str, list[int]], list]:
    """The same two requests driven by hand through a real `KVCacheManager`, as a scheduler
    would: A prefills at step 1, B (hitting A's two shared blocks) at step 2, one token per
    step each, three tokens each; returns the manager, block tables seen, and its events."""
    kv = KVCacheManager(CONFIG.num_blocks, CONFIG.block_size, CONFIG.max_model_len)
    tables: dict[str, list[int]] = {}
    a, b = _Req("a", list(PROMPT_A)), _Req("b", list(PROMPT_B))
    kv.allocate_slots(a, len(a.all_token_ids), kv.get_computed_blocks(a))
    a.all_token_ids.append(fake_token(len(a.all_token_ids)))
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == len(SHARED)
    kv.allocate_slots(b, len(b.all_token_ids) - hit.num_tokens, hit)
    for request in (a, b):
        if request is a:
            kv.allocate_slots(a, 1)
        request.all_token_ids.append(fake_token(len(request.all_token_ids)))
    tables["a"], tables["b"] = kv.get_block_ids("a"), kv.get_block_ids("b")
    kv.allocate_slots(a, 1)  # step 3: A's last token, B's second
    a.all_token_ids.append(fake_token(len(a.all_token_ids)))
    kv.free("a")
    kv.allocate_slots(b, 1)
    b.all_token_ids.append(fake_token(len(b.all_token_ids)))
    kv.allocate_slots(b, 1)  # step 4: B's last token
    b.all_token_ids.append(fake_token(len(b.all_token_ids)))
    kv.free("b")
    return kv, tables, kv.pool.take_events()


def test_steps_match_a_real_manager_run_and_events_mirror_the_pool():
    published = []
    core = SimWorkerCore("w0", CONFIG, lambda *batch: published.append(batch))
    empty = core.kv_snapshot()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out: dict[str, list] = {"a": [], "b": []}
    tables = {}
    core.submit(WorkerRequest.fresh("a", PROMPT_A, params))
    for step in range(4):
        if step == 1:  # B arrives once A has prefilled: it hits A's shared blocks
            core.submit(WorkerRequest.fresh("b", PROMPT_B, params))
        for request, delta in core.step():
            out[request.request_id].append(delta)
        if step == 1:
            tables = {rid: core.kv.get_block_ids(rid) for rid in ("a", "b")}
        core.publish_events()
    assert not core.running and not core.waiting
    ref_kv, ref_tables, ref_events = _reference()
    assert tables == ref_tables
    events = [e for _, _, batch, _ in published for e in batch]
    assert events == ref_events
    assert [e.seq for e in events] == list(range(core.kv.pool.next_event_seq))
    assert published[-1][3] == core.kv.pool.next_event_seq
    for rid in ("a", "b"):
        deltas = out[rid]
        assert sum(len(d.token_ids) for d in deltas) == MAX_TOKENS
        assert deltas[-1].finish_reason == "length"
    assert out["a"][-1].usage.cached_tokens == 0
    assert out["b"][-1].usage.cached_tokens == len(SHARED)
    assert_no_leaks(core.kv)
    assert core.check_pool().clean
    # The index a worker feeds from its empty snapshot on ends equal to its pool.
    index = PrefixIndexState()
    assert index.apply_snapshot(empty)
    for worker_id, epoch, batch, next_seq in published:
        assert not index.publish(worker_id, epoch, batch, next_seq).needs_resync
    final = core.kv_snapshot()
    assert isinstance(final, KVSnapshot)
    assert index.hashes_of("w0") == set(final.block_hashes) == set(ref_kv.pool.cached)


def test_a_reader_leaving_or_an_abort_frees_every_block():
    async def scenario() -> None:
        core = SimWorkerCore("w0", CONFIG)
        core.start()
        params = SamplingParams(max_tokens=50)
        left = core.generate(WorkerRequest.fresh("left", PROMPT_A, params))
        first = await anext(left)
        assert first.token_ids and core.kv.has_request("left")
        await left.aclose()  # the router cancelled the stream
        aborted = core.generate(WorkerRequest.fresh("aborted", PROMPT_B, params))
        await anext(aborted)
        assert core.abort("aborted")
        rest = [d async for d in aborted]
        assert rest[-1].finish_reason == "abort"
        done = core.generate(WorkerRequest.fresh("done", PROMPT_A, SamplingParams(max_tokens=2)))
        deltas = [d async for d in done]
        assert deltas[-1].usage.cached_tokens == len(SHARED)  # the left request's blocks
        await core.close()
        assert not core.abort("done")
        assert_no_leaks(core.kv)
        assert core.check_pool().clean

    asyncio.run(scenario())
