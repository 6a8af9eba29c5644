"""The router's view of LoRA adapters: keys from the workers' stats, the same block hashes as
the worker that cached a prompt under an adapter (and none of the base's), a 404 naming an
unknown adapter, and a replay that keeps the adapter and its output."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from support.engine import Stepper, finish_clean, load

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.api_errors import ErrorCode, to_api_error
from pagedserve.cluster.client_cli import format_status
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.metrics import _WorkerCollector
from pagedserve.cluster.router import RouterCore
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.block_hash import cache_key, hash_full_blocks
from pagedserve.workers.errors import UnknownLora
from pagedserve.workers.handoff import RequestHandoff
from pagedserve.workers.kv_cache_manager import KVCacheManager, KVUsage
from pagedserve.workers.worker_types import WorkerStats

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
    core = RouterCore(ClusterConfig(num_workers=2), index=None, workers={"w0": None, "w1": None})
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
    core = RouterCore(ClusterConfig(num_workers=2), index=None, workers={"w0": None, "w1": None})
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
