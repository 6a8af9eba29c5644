"""The router finds a worker's cached prefix under the keys that worker cached it with.

One `cache_key()` builds the extra keys of every block hash; this runs a prompt on a real
engine, shows the router the blocks that engine cached, and asks the router to route the same
prompt: every full block must match, for every form a cache salt arrives in.
"""

import asyncio
from types import SimpleNamespace

import pytest
from support.engine import finish_clean, load

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.kv.block_hash import cache_key

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("salt", [None, "", "tenant-a", "scope/tenant-a"])
def test_the_router_matches_every_block_the_worker_cached(salt):
    llm = LLM(
        loaded_model=load("tiny-llama"),
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        attention_backend="torch",
    )
    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 5))  # 4 full blocks and a partial one
    llm.generate([prompt], GREEDY, cache_salt=salt)
    cached = set(llm.engine.kv.pool.cached)
    finish_clean(llm)

    core = RouterCore(
        RouterConfig(),
        index=None,
        workers={"w0": None, "w1": None},
    )
    for state in core.workers.values():
        state.mark_alive(SimpleNamespace(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024))
    core.model_name = llm.engine.loaded.name
    core.workers["w0"].begin(16)  # the busier one: only its cached prefix can win it the prompt
    for block_hash in cached:
        core.view._link("w0", block_hash)
    worker, matched = asyncio.run(core.route(prompt, salt))
    assert (worker.worker_id, matched) == ("w0", 4)


def test_an_empty_salt_is_no_salt():
    assert cache_key("m", "") == cache_key("m", None) == ("m",)
    assert cache_key("m", "t") == ("m", "t")
