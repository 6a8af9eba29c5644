"""The router's view of LoRA adapters: keys from the workers' stats, the same block hashes as
the worker that cached a prompt under an adapter (and none of the base's), a 404 naming an
unknown adapter, and a replay that keeps the adapter and its output."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from support.engine import Stepper, finish_clean, load

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.api.errors import ErrorCode, to_api_error
from pagedserve.cluster.client_cli import format_status
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.metrics import _WorkerCollector
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.kv.block_hash import cache_key, hash_full_blocks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.errors import UnknownLora
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.stats import KVUsage, LoraLoadResult, WorkerStats

BLOCK_SIZE = 4
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama_loaded():
    return load("tiny-llama")


@pytest.fixture
def engine(tiny_llama_loaded, lora_adapters):
    llm = LLM(
        loaded_model=tiny_llama_loaded,
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        attention_backend="torch",
        lora_modules=[f"{a.name}={a.path}" for a in lora_adapters.values()],
    )
    yield llm
    finish_clean(llm)


def _router(llm: LLM) -> RouterCore:
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={"w0": None, "w1": None},
    )
    for state in core.workers.values():
        state.mark_alive(SimpleNamespace(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024))
        state.stats = SimpleNamespace(
            lora_adapters=tuple(llm.engine.lora_adapters().items()), resident_loras=()
        )
    core.model_name = llm.engine.loaded.name
    core.block_size = BLOCK_SIZE
    return core


def test_the_router_matches_the_blocks_a_worker_cached_under_an_adapter(engine):
    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 1))  # 4 full blocks and a partial one
    engine.engine.add_request("r", prompt, PARAMS, lora="all2")
    Stepper(engine.engine).run_to_end()
    core = _router(engine)
    low, high = core.lora_key("all2"), core.lora_key("mlp8")
    for state in core.workers.values():
        state.stats = None  # routing reads load from real stats; none here, as in test_cache_key
    core.workers["w0"].begin(16)  # the busier one: only a prefix match can win it the prompt
    for block_hash in engine.engine.kv.pool.cached:
        core.view._link("w0", block_hash)
    on_adapter = asyncio.run(core.route(prompt, None, lora_key=low))
    assert (on_adapter[0].worker_id, on_adapter[1]) == ("w0", 4)
    on_other = asyncio.run(core.route(prompt, None, lora_key=high))
    on_base = asyncio.run(core.route(prompt, None))
    assert on_other[1] == on_base[1] == 0


def test_an_unknown_adapter_is_a_404_naming_it(engine):
    core = _router(engine)
    with pytest.raises(UnknownLora) as raised:
        core.lora_key("nope")
    error = to_api_error(raised.value)
    assert error.code is ErrorCode.NOT_FOUND and "'nope'" in str(error)
    assert core.lora_key(None) is None
    assert core.lora_adapters() == engine.engine.lora_adapters()


def test_a_replayed_request_keeps_its_adapter_and_output(engine, tiny_llama_loaded, lora_adapters):
    """A replay (the router's handoff without KV, keys from `cache_key`) continues on a peer
    with the adapter: the same tokens as running it there whole."""
    prompt = list(range(40, 52))
    expected = lora_adapters["mlp8"].reference.greedy(prompt, PARAMS.max_tokens)
    core = _router(engine)
    handoff = RequestHandoff.replay(
        "r",
        prompt,
        expected[:2],  # the lost worker streamed two tokens
        0,
        PARAMS,
        priority=0,
        cache_extra_keys=cache_key(core.model_name, None, core.lora_key("mlp8")),
        block_size=BLOCK_SIZE,
        deadline_remaining_s=None,
    )
    engine.engine.adopt(handoff)
    outputs = Stepper(engine.engine).run_to_end()
    assert expected[:2] + outputs["r"].outputs[0].token_ids == expected


def _stats(worker_id: str, adapters: dict[str, str], resident: tuple[str, ...]) -> WorkerStats:
    fields = {name: 0 for name in KVUsage.__dataclass_fields__}
    kv = KVUsage(**{**fields, "block_size": BLOCK_SIZE, "total_blocks": 64, "free_blocks": 64})
    return WorkerStats(
        worker_id, "e", kv, lora_adapters=tuple(adapters.items()), resident_loras=resident
    )


def _two_workers(adapters: dict[str, str], resident: dict[str, tuple[str, ...]]) -> RouterCore:
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={"w0": None, "w1": None},
    )
    for worker_id, state in core.workers.items():
        state.mark_alive(SimpleNamespace(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024))
        state.stats = _stats(worker_id, adapters, resident[worker_id])
    core.model_name = "m"
    core.block_size = BLOCK_SIZE
    return core


def test_routing_prefers_the_adapter_resident_but_a_cached_prefix_more():
    adapters = {"a": "a@1", "b": "b@1"}
    prompt = list(range(1, 4 * BLOCK_SIZE + 1))
    core = _two_workers(adapters, {"w0": (), "w1": ("a",)})
    worker, _ = asyncio.run(core.route(prompt, None, lora_key="a@1"))
    assert worker.worker_id == "w1"  # equal loads, no prefix: the one with "a" in a slot
    for block_hash in hash_full_blocks(prompt, BLOCK_SIZE, cache_key("m", None, "a@1")):
        core.view._link("w0", block_hash)
    worker, matched = asyncio.run(core.route(prompt, None, lora_key="a@1"))
    assert (worker.worker_id, matched) == ("w0", 4)  # its 4 cached blocks outweigh a load


def test_a_worker_without_the_adapter_is_never_chosen():
    core = _two_workers({"a": "a@1"}, {"w0": (), "w1": ()})
    core.workers["w1"].stats = _stats("w1", {}, ())
    core.workers["w0"].begin(16)  # busier, but the only one with the adapter
    worker, _ = asyncio.run(core.route(list(range(1, 9)), None, lora_key="a@1"))
    assert worker.worker_id == "w0"
    core.workers["w0"].stats = _stats("w0", {"a": "a@2"}, ())  # reloaded with other weights
    with pytest.raises(UnknownLora, match="'a' is on no worker"):
        asyncio.run(core.route(list(range(1, 9)), None, lora_key="a@1"))


def test_a_worker_not_polled_yet_gets_an_adapter_only_when_no_polled_one_has_it():
    core = _two_workers({"a": "a@1"}, {"w0": (), "w1": ()})
    core.workers["w1"].stats = None  # just joined: its adapters are not known yet
    core.workers["w0"].begin(16)  # busier, but known to have the adapter
    worker, _ = asyncio.run(core.route(list(range(1, 9)), None, lora_key="a@1"))
    assert worker.worker_id == "w0"
    core.workers["w0"].stats = _stats("w0", {}, ())
    worker, _ = asyncio.run(core.route(list(range(1, 9)), None, lora_key="a@1"))
    assert worker.worker_id == "w1"


def test_metrics_and_status_show_each_workers_adapters():
    stats = WorkerStats(
        "w0",
        "e1",
        KVCacheManager(4, 2, 8).usage(),
        lora_adapters=(("a", "a@1"), ("b", "b@1")),
        resident_loras=("b",),
        lora_requests=(("b", 3),),
    )
    families = {f.name: f for f in _WorkerCollector(lambda: {"w0": (True, stats)}).collect()}
    adapters = {
        (s.labels["adapter"], s.labels["state"])
        for s in families["pagedserve_lora_adapter"].samples
    }
    assert adapters == {("a", "loaded"), ("b", "loaded"), ("b", "resident")}
    requests = {
        (s.labels["adapter"], s.value) for s in families["pagedserve_lora_requests"].samples
    }
    assert requests == {("b", 3)}
    message = pb.GetStatsResponse(
        workers=[pb.WorkerStats(worker_id="w0", lora_adapters=["a", "b"], resident_loras=["b"])]
    )
    assert "LoRA adapters: w0: a, b (resident)" in format_status(message)


# ------------------------------------------------- a worker that joins later (follow_loras)
class _Call:
    """An actor method's stand-in: ``.remote(*args)`` is an awaitable of ``fn(*args)``."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            result = self.fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return call()


class _FakeWorker:
    """A worker's adapters as `Worker` keeps them: name -> (key, path); ``files``: the key of
    the adapter each path holds (shared by every worker, as one filesystem)."""

    def __init__(self, worker_id: str, files: dict[str, str], epoch: str = "e1") -> None:
        self.worker_id, self.files, self.epoch = worker_id, files, epoch
        self.adapters: dict[str, tuple[str, str]] = {}
        self.loads: list[str] = []
        self.gate: asyncio.Event | None = None  # set: a load waits for it
        self.stats = _Call(self._stats)
        self.ready = _Call(lambda: _info(self.epoch))
        self.load_lora = _Call(self._load)
        self.unload_lora = _Call(lambda name: self.adapters.pop(name, None) is not None)

    def _stats(self, owner_id: str) -> WorkerStats:
        stats = _stats(self.worker_id, {n: k for n, (k, _) in self.adapters.items()}, ())
        paths = tuple((n, p) for n, (_, p) in self.adapters.items())
        return dataclasses.replace(stats, epoch=self.epoch, lora_paths=paths)

    async def _load(self, name: str, path: str) -> LoraLoadResult:
        self.loads.append(name)
        if self.gate is not None:
            await self.gate.wait()
        if path not in self.files:
            return LoraLoadResult(name, None, f"adapter {name!r}: no adapter_config.json")
        self.adapters[name] = (self.files[path], path)
        return LoraLoadResult(name, self.files[path])


def _info(epoch: str) -> SimpleNamespace:
    return SimpleNamespace(epoch=epoch, num_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024)


def _cluster(*fakes: _FakeWorker) -> RouterCore:
    """A router over ``fakes``, each polled once and followed in order (the after-poll hook
    off: `follow_loras` is driven by hand)."""
    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={},
    )
    core.liveness.on_polled = None
    for fake in fakes:
        core.workers[fake.worker_id] = state = WorkerState(fake.worker_id, fake)
        state.mark_alive(_info(fake.epoch))
    asyncio.run(core.liveness.poll_all())
    return core


def _follow(core: RouterCore, *worker_ids: str) -> None:
    for worker_id in worker_ids:
        asyncio.run(core.follow_loras(core.workers[worker_id]))


FILES = {"/a": "a@1", "/b": "b@1"}


def test_a_worker_that_joins_later_gets_the_run_time_adapters_once():
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", FILES)
    old.adapters = {"a": ("a@1", "/a"), "b": ("b@1", "/b")}  # loaded at run time on w0 only
    new.adapters = {"b": ("b@1", "/b")}  # its lora_modules
    core = _cluster(old, new)
    _follow(core, "w0", "w1")
    assert new.loads == ["a"]  # only what it lacked, from the path w0 reports
    assert dict(core.workers["w1"].stats.lora_adapters) == {"a": "a@1", "b": "b@1"}  # re-polled
    worker, _ = asyncio.run(core.route(list(range(1, 9)), None, lora_key="a@1", exclude={"w0"}))
    assert worker.worker_id == "w1"
    assert (core.counters.lora_healed, core.counters.lora_heal_failures) == (1, 0)
    _follow(core, "w0", "w1")  # seen: nothing more
    assert old.loads == [] and new.loads == ["a"]


def test_the_adapters_outlive_every_worker_that_had_them():
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", FILES)
    old.adapters = {"a": ("a@1", "/a")}
    core = _cluster(old)
    _follow(core, "w0")
    del core.workers["w0"]  # lost for good; its replacement joins
    core.workers["w1"] = state = WorkerState("w1", new)
    state.mark_alive(_info(new.epoch))
    asyncio.run(core.liveness.poll(state))
    with pytest.raises(UnknownLora):  # until the replacement has it
        core.lora_key("a")
    _follow(core, "w1")
    assert new.adapters == {"a": ("a@1", "/a")} and core.lora_key("a") == "a@1"
    assert list(core.lora_seen) == ["w1"]  # the lost worker's notes are forgotten


def test_only_a_new_incarnation_is_healed_so_an_unload_is_never_undone():
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", FILES)
    old.adapters = {"a": ("a@1", "/a")}
    new.adapters = {"a": ("a@1", "/a")}
    core = _cluster(old, new)
    _follow(core, "w0", "w1")
    new.adapters.clear()  # another replica's unload reached w1 first; w0 still has "a"
    asyncio.run(core.liveness.poll(core.workers["w1"]))
    _follow(core, "w1")
    assert new.loads == [] and "a" not in core.lora_known  # an unload, not a lost adapter
    old.adapters.clear()
    new.epoch = "e2"  # Ray restarted it: a new engine, with lora_modules only
    asyncio.run(core.liveness.poll_all())
    _follow(core, "w0", "w1")
    assert new.loads == [] and core.lora_adapters() == {}


def test_a_restarted_worker_is_healed():
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", FILES)
    old.adapters = {"a": ("a@1", "/a")}
    new.adapters = {"a": ("a@1", "/a")}
    core = _cluster(old, new)
    _follow(core, "w0", "w1")
    new.adapters, new.epoch = {}, "e2"  # Ray restarted it: lora_modules only
    asyncio.run(core.liveness.poll(core.workers["w1"]))
    _follow(core, "w1")
    assert new.loads == ["a"] and "a" in new.adapters


def test_a_failed_heal_is_counted_not_raised_and_the_others_still_load():
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", {"/b": "b@1", "/a": "a@2"})
    old.adapters = {"a": ("a@1", "/a"), "b": ("b@1", "/b"), "c": ("c@1", "/gone")}
    core = _cluster(old, new)
    _follow(core, "w0", "w1")
    # "c": its directory is gone; "a": other files at its path now (unloaded again, all or
    # nothing: w1 never serves "a" under a key the others do not).
    assert new.adapters == {"b": ("b@1", "/b")}
    assert dict(core.workers["w1"].stats.lora_adapters) == {"b": "b@1"}
    assert (core.counters.lora_healed, core.counters.lora_heal_failures) == (1, 2)
    assert core.counters.as_dict()["lora.heal_failures"] == 2


def test_an_unload_that_ran_during_the_heal_is_not_undone():
    """The heal polls the others again after the load: w0 no longer reports "a"."""
    old, new = _FakeWorker("w0", FILES), _FakeWorker("w1", FILES)
    old.adapters = {"a": ("a@1", "/a")}
    new.gate = asyncio.Event()
    core = _cluster(old, new)
    _follow(core, "w0")

    async def heal_while_unloading() -> None:
        heal = asyncio.create_task(core.follow_loras(core.workers["w1"]))
        while not new.loads:  # the load is on its way to w1
            await asyncio.sleep(0)
        # Another replica unloads "a": gone from w0, and nothing to unload on w1 yet.
        assert old.unload_lora.fn("a") and not new.unload_lora.fn("a")
        new.gate.set()
        await heal

    asyncio.run(heal_while_unloading())
    assert new.adapters == {} and core.lora_adapters() == {} and core.lora_known == {}
