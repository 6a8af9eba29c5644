"""Beam search in the engine on tiny-llama: equal to HF's beam search, on shared blocks.

Forks share the prompt's blocks by reference (each beam copies only the partial last block), a
pruned beam's blocks are free at the end of the step that dropped it, the group is admitted,
preempted (recompute, swap) and aborted as one, and nothing leaks.
"""

from __future__ import annotations

import pytest
from support.beam import assert_equals_hf
from support.engine import Stepper, finish_clean

from pagedserve.workers.offline.llm import LLM
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.sampling import SamplingParams

PROMPTS = [list(range(1, 21)), list(range(40, 75))]
MAX_TOKENS = 12


def beam(width: int = 4, **fields) -> SamplingParams:
    options = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **fields}
    return SamplingParams(n=width, use_beam_search=True, **options)


def engine(loaded, **config) -> LLM:
    options = {
        "block_size": 8,
        "num_kv_blocks": 128,
        "attention_backend": "torch",
        "watermark": 0.0,
        "enable_prefix_caching": False,
        **config,
    }
    return LLM(loaded_model=loaded, **options)


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, False), (0.5, True), (2.0, "never")]
)
def test_beams_equal_hf_beam_search(tiny_llama, length_penalty, early_stopping):
    loaded, reference = tiny_llama
    llm = engine(loaded)
    params = beam(length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert_equals_hf(
            reference, prompt, output, lp=length_penalty, early_stopping=early_stopping
        )
    finish_clean(llm)


def live_tables(llm: LLM, request_id: str) -> dict[str, list[int]]:
    group = llm.engine._groups[request_id]
    return {b.request_id: llm.engine.kv.get_block_ids(b.request_id) for b in group.branches}


def test_forks_share_prompt_blocks_and_copy_only_the_partial_last_block(tiny_llama, monkeypatch):
    llm = engine(tiny_llama[0])
    copies: list[tuple[int, int]] = []
    copy_blocks = llm.engine.kv_cache.copy_blocks
    monkeypatch.setattr(
        llm.engine.kv_cache, "copy_blocks", lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    )
    llm.engine.add_request("b", PROMPTS[0], beam())  # 20 tokens: blocks 0, 1 full, 2 partial
    llm.engine.step()  # prefill; the first beam step forks 4 beams from the prompt
    tables = live_tables(llm, "b")
    assert len(tables) == 4 and len({tuple(t) for t in tables.values()}) == 1
    (prompt_blocks,) = {tuple(t) for t in tables.values()}
    assert [llm.engine.kv.pool.blocks[b].ref_cnt for b in prompt_blocks] == [4, 4, 4]
    assert not copies
    llm.engine.step()  # each beam writes position 20 into the shared partial block
    # Three copies of the partial block (the fourth beam keeps the original); no full block.
    assert len(copies) == 3 and {src for src, _ in copies} == {prompt_blocks[2]}
    for _ in range(6):
        llm.engine.step()
        tables = live_tables(llm, "b")
        assert all(t[:2] == list(prompt_blocks[:2]) for t in tables.values())
        held = {b for t in tables.values() for b in t}
        assert len(held) < sum(len(t) for t in tables.values())
        assert llm.engine.usage().used_blocks == len(held)
    llm.engine.abort("b")
    finish_clean(llm)


def test_pruned_beams_free_their_blocks_in_the_step_that_drops_them(tiny_llama):
    llm = engine(tiny_llama[0])
    llm.engine.add_request("b", PROMPTS[1], beam(max_tokens=24))
    stepper, dropped = Stepper(llm.engine), 0
    before: set[str] = set()
    while "b" not in stepper.outputs:
        stepper.step()
        if "b" in stepper.outputs:
            break
        tables = live_tables(llm, "b")
        gone = before - set(tables)
        dropped += len(gone)
        assert not any(llm.engine.kv.has_request(rid) for rid in gone)
        held = {block for table in tables.values() for block in table}
        assert llm.engine.usage().used_blocks == len(held)  # nothing held by a dropped beam
        before = set(tables)
    assert dropped > 0
    finish_clean(llm)


def test_abort_mid_search_reports_its_best_beams_and_leaks_nothing(tiny_llama):
    llm = engine(tiny_llama[0])
    other = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("b", PROMPTS[0], beam(max_tokens=30))
    llm.engine.add_request("g", PROMPTS[1], other)
    stepper = Stepper(llm.engine)
    for _ in range(4):
        stepper.step()
    stepper.add([llm.engine.abort("b")])
    aborted = stepper.outputs["b"]
    assert len(aborted.outputs) == 4
    assert {o.finish_reason for o in aborted.outputs} == {"abort"}
    assert all(len(o.token_ids) == 4 for o in aborted.outputs)
    assert not any(rid.startswith("b#") for rid in llm.engine.kv._requests)
    outputs = stepper.run_to_end()
    assert len(outputs["g"].outputs[0].token_ids) == 8
    finish_clean(llm)


def test_group_is_admitted_whole_within_max_num_seqs(tiny_llama):
    loaded, reference = tiny_llama
    llm = engine(loaded, max_num_seqs=4)
    llm.engine.add_request("first", PROMPTS[0], beam())
    llm.engine.add_request("second", PROMPTS[1], beam())
    stepper = Stepper(llm.engine)
    while llm.engine.has_unfinished_requests():
        stepper.step()
        assert len(llm.engine.scheduler.running) <= 4
    for prompt, rid in zip(PROMPTS, ("first", "second"), strict=True):
        assert_equals_hf(reference, prompt, stepper.outputs[rid])
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_groups_still_equal_hf(tiny_llama, mode):
    loaded, reference = tiny_llama
    # Both groups together hold 23 blocks at their widest (sharing); 16 cannot hold them.
    llm = engine(loaded, num_kv_blocks=16, preemption_mode=mode, max_num_seqs=8)
    params = beam(max_tokens=24)
    outputs = llm.generate(PROMPTS, params)
    counters = llm.engine.scheduler.counters
    if mode == "swap":
        assert counters.swapped_out > 0 and counters.swapped_in == counters.swapped_out
    else:
        assert counters.recomputed > 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert_equals_hf(reference, prompt, output, max_tokens=24)
    finish_clean(llm)


def test_refusals_name_the_field_and_disturb_nothing(tiny_llama):
    llm = engine(tiny_llama[0], max_beam_width=4)
    llm.engine.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0))
    with pytest.raises(RequestRejected, match=r"^n: .*max_beam_width \(4\)"):
        llm.engine.add_request("wide", PROMPTS[1], beam(width=5))
    outputs = Stepper(llm.engine).run_to_end()
    assert len(outputs["ok"].outputs[0].token_ids) == 6
    finish_clean(llm)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"n": 1}, "n"),
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"seed": 3}, "seed"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 1}, "logprobs"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_bad_beam_fields_are_refused_by_name(fields, field):
    options = {"n": 4, "use_beam_search": True, "temperature": 0.0, **fields}
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**options)


@pytest.mark.parametrize("fields", [{"length_penalty": 0.5}, {"early_stopping": True}])
def test_beam_fields_without_beam_search_are_refused(fields):
    with pytest.raises(ValueError, match=f"^{next(iter(fields))} is only used"):
        SamplingParams(**fields)


def test_speculative_engine_refuses_beam_search(tiny_llama):
    llm = engine(tiny_llama[0], speculative={"method": "ngram", "num_tokens": 2})
    with pytest.raises(RequestRejected, match="^use_beam_search"):
        llm.engine.add_request("b", PROMPTS[0], beam())
    finish_clean(llm)


@pytest.mark.parametrize("steps_before", [1, 5, 13])
def test_a_group_moved_to_another_engine_still_equals_hf(tiny_llama, steps_before):
    """The whole group leaves its engine between steps (its blocks freed at once) and a peer
    engine continues it; some moves fall after hypotheses have finished (the scorer's state
    travels with the beams)."""
    loaded, reference = tiny_llama
    source, peer = engine(loaded), engine(loaded, block_size=8, num_kv_blocks=64)
    params = beam(max_tokens=24)
    source.engine.add_request("b", PROMPTS[1], params)
    for _ in range(steps_before):
        source.engine.step()
    handoff = source.engine.export_beam_group("b")
    assert len(handoff.beams) == 4 and source.engine.usage().used_blocks == 0
    finish_clean(source)
    peer.engine.adopt_beam_group(handoff)
    outputs = Stepper(peer.engine).run_to_end()
    assert_equals_hf(reference, PROMPTS[1], outputs["b"], max_tokens=24)
    finish_clean(peer)


def test_a_group_too_wide_for_the_whole_pool_ends_with_an_error_not_a_livelock(tiny_llama):
    # 4 beams of 20 + 40 tokens outgrow 12 blocks of 8 even alone: recomputing the group would
    # only bring it back to the same wall, forever. It ends (finish reason `error`), and a
    # plain request beside it runs to its end.
    loaded, _ = tiny_llama
    llm = engine(loaded, num_kv_blocks=12)
    llm.engine.add_request("wide", PROMPTS[0], beam(max_tokens=40))
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("plain", PROMPTS[1][:10], plain)
    stepper = Stepper(llm.engine)
    for _ in range(500):  # a livelock never ends; the bound only turns it into a failure
        if not llm.engine.has_unfinished_requests():
            break
        stepper.step()
    outputs = stepper.outputs
    # The beams still growing end with `error`; a finished hypothesis keeps its own reason.
    reasons = [c.finish_reason for c in outputs["wide"].outputs]
    assert "error" in reasons and set(reasons) <= {"error", "stop", "length"}
    assert outputs["plain"].outputs[0].finish_reason == "length"
    assert len(outputs["plain"].outputs[0].token_ids) == 6
    assert llm.engine.scheduler.counters.recomputed == 0
    finish_clean(llm)
