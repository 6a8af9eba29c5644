"""The host and disk KV tiers end to end on one engine: a prefix evicted from the device pool
is hit from host memory, from disk, and from disk again in a new engine on the same directory,
with greedy outputs unchanged and the cached part never prefilled."""

import logging

import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.kv.checks import check_tiers
from pagedserve.workers.kv.tier_disk import DiskTierError
from pagedserve.workers.protocol.events import BlockRemoved, BlockStored

BLOCK = 8
PROMPT_A = [(7 * i + 3) % 200 + 1 for i in range(36)]  # a hit covers 4 blocks, 4 tokens left
PROMPT_B = [(11 * i + 5) % 200 + 1 for i in range(60)]  # fills the whole pool: evicts A
A_BLOCKS = 4


def make_llm(tiny_llama, **config):
    loaded, _ = tiny_llama
    options = {
        "block_size": BLOCK,
        "num_kv_blocks": 8,
        "attention_backend": "torch",
        "watermark": 0.0,
    }
    return LLM(loaded_model=loaded, **{**options, **config})


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def bytes_per_block(tiny_llama) -> int:
    return make_llm(tiny_llama).engine.kv_cache.bytes_per_block


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy output of `prompt` and how many tokens were prefilled for it."""
    counters = llm.engine.scheduler.counters
    before = counters.prefill_tokens
    (output,) = llm.generate([prompt], greedy())
    return output.outputs[0].token_ids, counters.prefill_tokens - before


def assert_clean(llm: LLM) -> None:
    """No request, no block held (`finish_clean` checks the tiers too); the disk tier's
    files are exactly its entries once its writes are done."""
    finish_clean(llm)
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()
        check_tiers(llm.engine.tiers, flushed=True)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """A's and B's outputs with no tiers at all."""
    llm = make_llm(tiny_llama)
    outputs = {name: run(llm, prompt)[0] for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B))}
    _, reference = tiny_llama
    assert outputs["a"] == reference.greedy(PROMPT_A, 4)
    return outputs


def evict_a_then_rerun(llm: LLM, expected) -> int:
    """Run A, evict it from the device with B, run A again; A's prefilled tokens the second
    time."""
    assert run(llm, PROMPT_A) == (expected["a"], len(PROMPT_A))
    assert run(llm, PROMPT_B)[0] == expected["b"]
    assert not llm.engine.kv.get_computed_blocks(_probe(llm, PROMPT_A)).blocks  # evicted
    output, prefilled = run(llm, PROMPT_A)
    assert output == expected["a"]
    return prefilled


def _probe(llm: LLM, prompt: list[int]):
    class Probe:
        request_id = "probe"
        all_token_ids = prompt
        cache_extra_keys = (llm.engine.loaded.name,)

    return Probe()


def test_without_tiers_an_evicted_prefix_is_prefilled_again(tiny_llama, expected):
    llm = make_llm(tiny_llama)
    assert evict_a_then_rerun(llm, expected) == len(PROMPT_A)
    assert llm.engine.tier_stats().tiers == ()
    assert_clean(llm)


def test_a_prefix_evicted_to_host_memory_is_loaded_back_not_prefilled(tiny_llama, expected):
    llm = make_llm(tiny_llama, kv_host_tier_bytes=16 * bytes_per_block(tiny_llama))
    llm.engine.kv.pool.take_events()
    prefilled = evict_a_then_rerun(llm, expected)
    events = llm.engine.kv.pool.take_events()
    assert prefilled == len(PROMPT_A) - A_BLOCKS * BLOCK
    host = llm.engine.tier_stats().of("host")
    assert host.hit_blocks == A_BLOCKS and host.bytes_out == A_BLOCKS * host.bytes // host.blocks
    assert llm.engine.tier_stats().loaded_blocks == A_BLOCKS
    assert llm.engine.usage().prefix_hits_tokens == A_BLOCKS * BLOCK
    # Evicted blocks are re-stored with their tier, never removed: the index keeps them.
    assert any(isinstance(e, BlockStored) and e.tier == "host" for e in events)
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert_clean(llm)


def test_a_prefix_evicted_to_disk_is_hit_there_and_after_a_restart(tiny_llama, expected, tmp_path):
    size = bytes_per_block(tiny_llama)
    config = {"kv_disk_tier_dir": str(tmp_path), "kv_disk_tier_bytes": 64 * size}
    # A host tier of one block: A's blocks are demoted to disk as B's are spilled.
    llm = make_llm(tiny_llama, kv_host_tier_bytes=size, **config)
    assert evict_a_then_rerun(llm, expected) == len(PROMPT_A) - A_BLOCKS * BLOCK
    stats = llm.engine.tier_stats()
    assert stats.of("disk").hit_blocks >= A_BLOCKS - 1 and stats.of("host").evicted_blocks > 0
    assert_clean(llm)
    llm.engine.close()

    restarted = make_llm(tiny_llama, **config)  # disk only now, on the same directory
    announced = restarted.engine.kv.pool.take_events()
    disk_hashes = {e.block_hash for e in announced if e.tier == "disk"}
    assert len(disk_hashes) >= A_BLOCKS and all(isinstance(e, BlockStored) for e in announced)
    output, prefilled = run(restarted, PROMPT_A)
    assert (output, prefilled) == (expected["a"], len(PROMPT_A) - A_BLOCKS * BLOCK)
    assert restarted.engine.tier_stats().of("disk").hit_blocks == A_BLOCKS
    assert_clean(restarted)
    restarted.engine.close()


def test_a_corrupt_disk_entry_is_skipped_with_a_warning(tiny_llama, expected, tmp_path, caplog):
    size = bytes_per_block(tiny_llama)
    config = {"kv_disk_tier_dir": str(tmp_path), "kv_disk_tier_bytes": 64 * size}
    llm = make_llm(tiny_llama, **config)
    assert evict_a_then_rerun(llm, expected) == len(PROMPT_A) - A_BLOCKS * BLOCK
    assert_clean(llm)
    hashes = [h for h, _ in llm.engine.kv.iter_prefix_keys(_probe(llm, PROMPT_A))]
    llm.engine.close()
    # A's third block: its payload flipped (found at load); its fourth: truncated (at start).
    third, fourth = (tmp_path / (h.hex() + ".kvb") for h in hashes[2:4])
    data = bytearray(third.read_bytes())
    data[-1] ^= 0xFF
    third.write_bytes(bytes(data))
    fourth.write_bytes(fourth.read_bytes()[:-5])
    (tmp_path / "garbage.kvb").write_bytes(b"not a block")

    with caplog.at_level(logging.WARNING, logger="pagedserve.workers.kv.tier_disk"):
        restarted = make_llm(tiny_llama, **config)
        output, prefilled = run(restarted, PROMPT_A)
    assert output == expected["a"]
    assert prefilled == len(PROMPT_A) - 2 * BLOCK  # the two intact leading blocks only
    disk = restarted.engine.tier_stats().of("disk")
    assert disk.corrupt_skipped == 3 and disk.hit_blocks == 2
    assert sum("corrupt" in r.message or "unusable" in r.message for r in caplog.records) == 3
    assert not (tmp_path / "garbage.kvb").exists()
    assert_clean(restarted)
    restarted.engine.close()


def test_tier_settings_are_checked_with_named_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="kv_host_tier_bytes must be an integer >= 0"):
        make_llm(tiny_llama, kv_host_tier_bytes=-1)
    with pytest.raises(ValueError, match="kv_disk_tier_bytes must be > 0"):
        make_llm(tiny_llama, kv_disk_tier_dir=str(tmp_path))
    with pytest.raises(ValueError, match="kv_disk_tier_dir is not"):
        make_llm(tiny_llama, kv_disk_tier_bytes=100)
    with pytest.raises(ValueError, match="kv_host_tier_bytes 1 holds no block"):
        make_llm(tiny_llama, kv_host_tier_bytes=1)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(DiskTierError, match="is not writable"):
        make_llm(tiny_llama, kv_disk_tier_dir=str(blocked / "sub"), kv_disk_tier_bytes=1 << 20)
    first = make_llm(tiny_llama, kv_disk_tier_dir=str(tmp_path), kv_disk_tier_bytes=1 << 20)
    with pytest.raises(DiskTierError, match="in use by another engine"):
        make_llm(tiny_llama, kv_disk_tier_dir=str(tmp_path), kv_disk_tier_bytes=1 << 20)
    first.engine.close()


def test_a_step_loads_only_what_the_pool_can_take_at_once(tiny_llama):
    """Loads for the waiting queue stop where the queue's sequences no longer fit the free
    blocks together: a load for a request the step cannot admit takes blocks the admitted
    ones need, and on a full pool evicts the blocks just loaded for the request before it
    (a long queue then re-read the tiers at every step)."""
    # 18 blocks: three of the four sequences (6 blocks with their output) fit at once.
    llm = make_llm(
        tiny_llama, num_kv_blocks=18, kv_host_tier_bytes=64 * bytes_per_block(tiny_llama)
    )
    # 40 tokens: 5 blocks each, the first 4 a hit can cover (one token is always computed).
    prompts = [[(13 * i + 7 * p) % 200 + 1 for i in range(40)] for p in range(4)]
    for prompt in prompts:
        run(llm, prompt)
    run(llm, [(17 * i + 1) % 200 + 1 for i in range(136)])  # evicts them all to the host tier
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"again-{i}", prompt, greedy())
    engine.step()
    assert engine.tier_stats().loaded_blocks == 3 * A_BLOCKS  # 3 × 5 blocks fit, 4 × 5 not
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.tier_stats().of("host").hit_blocks == 4 * A_BLOCKS  # each block read once
    assert_clean(llm)
