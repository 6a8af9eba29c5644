"""WorkerCore without Ray: streaming, cancellation, abort, snapshots and prefix transfer."""

import asyncio
import threading

import pytest
from support.engine import finish_clean
from support.wait import until

from pagedserve import LLM, SamplingParams
from pagedserve.workers.kv.block_hash import hash_full_blocks
from pagedserve.workers.protocol.errors import Draining, RequestRejected
from pagedserve.workers.protocol.stats import DrainResult, PoolCheck
from pagedserve.workers.protocol.stream import RequestMoved
from pagedserve.workers.worker.core import WorkerCore
from pagedserve.workers.worker.fault_injection import StepFaults

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GRACE_S = 3.0  # ample for a resumed 8-token request; an unread one never ends within it


def make_core(tiny_llama, worker_id="w0", sink=None, max_buffered_deltas=64, **config):
    loaded, _ = tiny_llama
    config = {"block_size": 8, "num_kv_blocks": 64, "attention_backend": "torch", **config}
    llm = LLM(loaded_model=loaded, **config)
    return llm, WorkerCore(llm.engine, worker_id, sink, max_buffered_deltas=max_buffered_deltas)


async def collect(core, request_id, prompt, params=GREEDY, **kwargs):
    deltas = [d async for d in core.generate(request_id, prompt, params, **kwargs)]
    return deltas


def test_stream_equals_offline_and_ends_with_usage(tiny_llama):
    llm, core = make_core(tiny_llama)
    prompt = list(range(3, 30))

    async def main():
        results = await asyncio.gather(*(collect(core, f"r{i}", prompt[i:]) for i in range(4)))
        await core.close()
        return results

    results = asyncio.run(main())
    for i, deltas in enumerate(results):
        tokens = [t for d in deltas for t in d.token_ids]
        (expected,) = llm.generate([prompt[i:]], GREEDY)
        assert tokens == expected.outputs[0].token_ids
        last = deltas[-1]
        assert last.finish_reason == "length" and last.usage.completion_tokens == 12
        assert last.usage.prompt_tokens == len(prompt) - i and last.worker_id == "w0"
        assert all(d.finish_reason is None for d in deltas[:-1])
    finish_clean(llm)


def test_every_step_and_the_close_run_on_the_one_engine_thread(tiny_llama):
    """One thread for all the engine's OpenMP work: a second would slow every step."""
    llm, core = make_core(tiny_llama)
    threads = []
    step, close = llm.engine.step, llm.engine.close

    def recorded(fn):
        def call():
            threads.append(threading.current_thread())
            return fn()

        return call

    llm.engine.step, llm.engine.close = recorded(step), recorded(close)

    async def main():
        await asyncio.gather(*(collect(core, f"r{i}", list(range(3, 20 + i))) for i in range(3)))
        await core.close()

    asyncio.run(main())
    assert len(threads) > 12 and len(set(threads)) == 1
    assert threads[0] is not threading.main_thread() and threads[0].name.startswith("engine")
    finish_clean(llm)


def test_each_step_runs_on_the_worker_s_share_of_the_cores(tiny_llama, tmp_path):
    """A busy peer on the board halves the cores a step runs on; an idle one gives them back,
    and a worker out of work says so (`workers/process/core_share.py`)."""
    import torch

    from pagedserve.workers.process.core_share import CoreShare

    board, before = tmp_path / "board", torch.get_num_threads()
    peer = CoreShare(board, 2)
    llm, _ = make_core(tiny_llama)
    core = WorkerCore(llm.engine, "w0", core_share=CoreShare(board, 2))
    seen: list[int] = []
    step = llm.engine.step

    def recorded():
        seen.append(torch.get_num_threads())  # on the engine thread, as the step's ops read it
        return step()

    llm.engine.step = recorded

    async def main():
        peer.threads_for_step()  # the peer is mid-step
        await collect(core, "busy-peer", list(range(3, 20)))
        busy_peer, seen[:] = list(seen), []
        peer.idle()
        await collect(core, "idle-peer", list(range(3, 20)))
        await until(lambda: peer.busy_workers() == 0, "w0 to say it has no work")
        await core.close()
        return busy_peer

    busy_peer = asyncio.run(main())
    assert len(busy_peer) > 10 and set(busy_peer) == {1} and set(seen) == {2}
    assert board.exists()  # the peer still holds its slot
    peer.close()
    assert not board.exists()
    torch.set_num_threads(before)
    finish_clean(llm)


def test_cancelled_stream_frees_blocks(tiny_llama):
    llm, core = make_core(tiny_llama)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        async def consume():
            async for _ in core.generate("c", list(range(20)), long):
                pass

        task = asyncio.create_task(consume())
        await until(lambda: llm.engine.usage().used_blocks, "the request to take blocks")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort runs shielded after the cancelled reader is gone: wait for it, not a while.
        await until(lambda: not llm.engine.has_unfinished_requests(), "the abort")
        await core.close()

    asyncio.run(main())
    finish_clean(llm)


def test_abort_ends_the_stream_and_rejections_raise(tiny_llama):
    llm, core = make_core(tiny_llama)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        stream = core.generate("a", list(range(20)), long)
        first = await anext(stream)
        assert await core.abort("a")
        rest = [d async for d in stream]
        assert not await core.abort("a")
        with pytest.raises(RequestRejected, match="prompt_token_ids is empty"):
            await collect(core, "bad", [])
        await core.close()
        return first, rest

    first, rest = asyncio.run(main())
    assert first.finish_reason is None and rest[-1].finish_reason == "abort"
    finish_clean(llm)


def test_events_published_and_snapshot_agrees(tiny_llama):
    batches = []
    llm, core = make_core(tiny_llama, sink=lambda w, e, ev: batches.append((w, e, ev)))

    async def main():
        await collect(core, "x", list(range(40)))
        await core.close()
        return await core.kv_snapshot()

    snapshot = asyncio.run(main())
    events = [event for _, _, batch in batches for event in batch]
    assert [e.seq for e in events] == list(range(len(events)))
    assert snapshot.next_seq == len(events) and snapshot.epoch == core.epoch
    assert set(snapshot.block_hashes) == {e.block_hash for e in events}
    finish_clean(llm)


def test_pool_reads_wait_for_the_step_in_flight(tiny_llama):
    """A snapshot, a pool check and push candidates asked for while a step runs are read after
    it, on the loop thread: the step thread changes the pool and appends to its event list,
    and a read beside it could see a half-changed pool or hand off an event list the step is
    still appending to (a lost event: the index sees a gap and resyncs)."""
    batches = []
    llm, core = make_core(tiny_llama, sink=lambda w, e, ev: batches.append(ev))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        started = core.steps_started
        core.faults = faults = StepFaults()
        faults.stall(True, after_steps=2)  # the third step is held in flight
        reader = asyncio.ensure_future(collect(core, "x", list(range(40)), long))
        # A stall holds the step thread before the engine step: the third, launched once
        # the second ended (`_stepping` alone could be the second's end, then no read waits).
        await until(lambda: core.steps_started == started + 3 and core._stepping, "a held step")
        reads = (core.kv_snapshot(), core.check_pool(), core.push_candidates(4))
        reads = [asyncio.ensure_future(read) for read in reads]
        for _ in range(3):  # a read that did not wait would be done after its first turn
            await asyncio.sleep(0)
        waited = [not read.done() for read in reads]
        faults.stall(False)
        snapshot, check, _ = await asyncio.gather(*reads)
        await reader
        await core.close()
        return waited, snapshot, check, await core.kv_snapshot()

    waited, snapshot, check, final = asyncio.run(main())
    assert waited == [True, True, True]
    assert check.ok and not check.idle  # read while the stream was open
    events = [event for batch in batches for event in batch]
    assert [e.seq for e in events] == list(range(len(events)))  # none lost or repeated
    assert 0 < snapshot.next_seq <= final.next_seq == len(events)
    finish_clean(llm)


def test_prefix_transfer_gives_hits_and_same_output(tiny_llama):
    llm_a, core_a = make_core(tiny_llama, "a")
    llm_b, core_b = make_core(tiny_llama, "b")
    prompt = list(range(50, 90))
    hashes = hash_full_blocks(prompt, 8, (llm_a.engine.loaded.name,))

    async def main():
        reference = await collect(core_a, "r", prompt)
        keys, packed = await core_a.export_prefix(hashes)
        assert len(keys) == 5
        assert await core_b.import_prefix(keys, packed) == 5
        assert await core_b.import_prefix(keys, packed) == 0  # already held
        pulled = await collect(core_b, "p", prompt)
        await core_a.close()
        await core_b.close()
        return reference, pulled

    reference, pulled = asyncio.run(main())
    assert [t for d in pulled for t in d.token_ids] == [t for d in reference for t in d.token_ids]
    assert pulled[-1].usage.cached_tokens == 32  # 4 full blocks; the last is recomputed
    finish_clean(llm_a)
    finish_clean(llm_b)


def move_cores(loaded):
    """A pool too small for a batch of four, in move mode ("a"), and a roomy peer ("b")."""
    from pagedserve.workers.engine.config import EngineConfig
    from pagedserve.workers.engine.engine import Engine

    small = EngineConfig(
        block_size=8,
        num_kv_blocks=14,
        attention_backend="torch",
        preemption_mode="move",
        watermark=0.0,
        enable_prefix_caching=False,
    )
    roomy = EngineConfig(block_size=8, num_kv_blocks=64, attention_backend="torch")
    return WorkerCore(Engine(small, loaded=loaded), "a"), WorkerCore(
        Engine(roomy, loaded=loaded), "b"
    )


async def follow_moves(core_a, core_b, request_id, prompt, params):
    """Stream a request as the router does, following it to the peer when it moves.

    Returns:
        Its tokens, its text, its last delta, and the handoffs it went through.
    """
    tokens, text, handoffs = [], [], []
    stream = core_a.generate(request_id, prompt, params)
    while True:
        async for delta in stream:
            if isinstance(delta, RequestMoved):
                handoffs.append(delta.handoff)
                stream = core_b.adopt(delta.handoff)
                break
            tokens.extend(delta.token_ids)
            text.append(delta.text)
        else:
            return tokens, "".join(text), delta, handoffs


def run_moves(tiny_llama, prompts, params):
    loaded, _ = tiny_llama
    core_a, core_b = move_cores(loaded)

    async def main():
        follows = (follow_moves(core_a, core_b, f"r{i}", p, params) for i, p in enumerate(prompts))
        results = await asyncio.gather(*follows)
        await core_a.close()
        await core_b.close()
        return results, await core_a.check_pool(), await core_b.check_pool()

    results, check_a, check_b = asyncio.run(main())
    assert core_a.engine.num_handoffs >= 1
    assert check_a == check_b == PoolCheck(ok=True, idle=True)
    return results


def test_moved_request_continues_on_a_peer_without_gap_or_repeat(tiny_llama):
    _, reference = tiny_llama
    prompts = [list(range(i * 7, i * 7 + 20)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = run_moves(tiny_llama, prompts, params)
    assert sum(len(handoffs) for *_, handoffs in results) >= 1
    for prompt, (tokens, _, last, _) in zip(prompts, results, strict=True):
        assert tokens == reference.greedy(prompt, 24)
        assert last.usage.completion_tokens == 24  # counted over both workers


def test_moved_request_streams_the_text_held_back_at_the_move_once(tiny_llama):
    """Text the source held back (a possible stop string, a split character) when the request
    moved is streamed by the peer, and nothing the source streamed is streamed again."""
    loaded, _ = tiny_llama
    prompts = [list(range(i * 7, i * 7 + 20)) for i in range(4)]
    # Random bytes decode to runs of U+FFFD: any such tail may still grow into this stop.
    stop = "\ufffd" * 6 + "Z"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    results = run_moves(tiny_llama, prompts, params)
    offline = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    expected = offline.generate(prompts, params)
    held_at_move = 0
    for want, (tokens, text, _, handoffs) in zip(expected, results, strict=True):
        assert (tokens, text) == (want.outputs[0].token_ids, want.outputs[0].text)
        for handoff in handoffs:
            whole = loaded.tokenizer.decode(handoff.output_token_ids)
            held_at_move += len(whole) > handoff.emitted_text_chars
    assert held_at_move >= 1, "no move happened while text was held back"
    finish_clean(offline)


def test_offline_llm_refuses_move_mode(tiny_llama):
    loaded, _ = tiny_llama
    with pytest.raises(ValueError, match="needs a cluster"):
        LLM(loaded_model=loaded, preemption_mode="move")


def test_drain_refuses_new_requests_finishes_short_ones_and_cuts_off_the_rest(tiny_llama):
    # No clock decides who finishes: both streams are held unread (their requests paused)
    # until the worker drains; then "short" is read to its end within the grace period, and
    # "long" stays unread, so it cannot end before the grace period does.
    llm, core = make_core(tiny_llama, max_buffered_deltas=2)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        finishing = core.generate("short", list(range(5, 15)), short)
        cut_off = core.generate("long", list(range(20, 30)), long)
        heads = [await anext(finishing), await anext(cut_off)]
        await until(lambda: llm.engine.stats().num_paused == 2, "both requests to pause")
        drain = asyncio.create_task(core.drain(grace_s=GRACE_S))
        await until(lambda: core.draining, "the drain to start")
        with pytest.raises(Draining, match="is draining"):
            await collect(core, "late", [1, 2, 3], short)
        deltas = [heads[0]] + [d async for d in finishing]
        result = await drain
        with pytest.raises(Draining, match="drained before this request ended"):
            async for _ in cut_off:
                pass
        stats = core.stats()
        await core.close()
        return result, deltas, stats

    result, deltas, stats = asyncio.run(main())
    assert result == DrainResult(finished=1, handed_off=1)
    assert deltas[-1].finish_reason == "length" and stats.draining
    assert sum(len(d.token_ids) for d in deltas) == 8
    finish_clean(llm)


def test_close_writes_the_disk_tier_out_for_the_next_worker(tiny_llama, tmp_path):
    """The shutdown path (`Worker.close` → `WorkerCore.close` → `Engine.close`) finishes the
    disk tier's queued writes and frees its directory: a worker started again on it finds
    every block the first one spilled there, with its file."""
    config = {
        "num_kv_blocks": 8,
        "watermark": 0.0,
        "kv_disk_tier_dir": str(tmp_path),
        "kv_disk_tier_bytes": 1 << 24,
    }
    llm, core = make_core(tiny_llama, **config)
    prompt_a, prompt_b = list(range(3, 39)), list(range(100, 148))  # B evicts A to disk

    async def main():
        await collect(core, "a", prompt_a)
        await collect(core, "b", prompt_b)
        spilled = {h for h, _, tier in llm.engine.kv.pool.lower.held_blocks() if tier == "disk"}
        await core.close()
        return spilled

    spilled = asyncio.run(main())
    assert len(spilled) >= 4  # A's four full blocks at least
    assert {path.stem for path in tmp_path.glob("*.kvb")} == {h.hex() for h in spilled}
    again, _ = make_core(tiny_llama, "w0-again", **config)  # the lock was released
    found = {h for h, _, tier in again.engine.kv.pool.lower.held_blocks() if tier == "disk"}
    assert found == spilled
    again.engine.close()
