"""A grammar-constrained request inside one engine: exact under speculation, preemption, a
replay on a peer and the P/D hand-off; the other token constraints; bad input and compiles
that fail or take too long. tiny-llama's random weights never follow a grammar on their own,
so every constrained output below is the grammar's doing."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.protocol.errors import Overloaded, RequestRejected
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.spec import decoding as spec_decoding
from pagedserve.workers.structured.compiler import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "tags", "name"],
}
JSON = GuidedSpec.json_schema(SCHEMA)
PROMPT = list(b"The record as JSON: ")


def make_llm(tiny_llama, **config) -> LLM:
    loaded, _ = tiny_llama
    config = {"block_size": 8, "num_kv_blocks": 128, "attention_backend": "torch", **config}
    return LLM(loaded_model=loaded, **config)


def run(llm: LLM, prompts, params):
    outputs = llm.generate(prompts, params)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return outputs


def valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def test_n_branches_each_get_their_own_matcher(tiny_llama):
    llm = make_llm(tiny_llama)
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=96, guided=JSON)
    result = run(llm, [PROMPT], params)[0]
    assert len({b.text for b in result.outputs}) > 1
    assert all(b.finish_reason == "stop" and valid(b.text) for b in result.outputs)
    finish_clean(llm)


@pytest.fixture
def record_drafts(monkeypatch):
    """Every (drafts proposed, drafts the grammar let through) of the verify steps."""
    seen = []
    original = spec_decoding.constrain_drafts

    def recording(logits, request, drafts, backend):
        kept = original(logits, request, drafts, backend)
        seen.append((list(drafts), kept))
        return kept

    monkeypatch.setattr(spec_decoding, "constrain_drafts", recording)
    return seen


def test_ngram_drafts_the_grammar_forbids_are_never_accepted(tiny_llama, record_drafts):
    """The prompt repeats "xabc", so after "xa" prompt lookup drafts "bc"; the bias makes
    the target want "c" at every position (as a real model wants to write what a schema
    forbids); the grammar forbids it. The speculative output must be the non-speculative one,
    with no "c", though drafts of "c" were proposed where the unmasked target agreed."""
    prompt = list(b"xabcxabcxabcxabcx")
    spec = GuidedSpec(GuidedKind.REGEX, "(ab){8}")
    guided = SamplingParams(temperature=0.0, max_tokens=17, guided=spec, logit_bias={99: 50})
    plain_llm = make_llm(tiny_llama)
    expected = run(plain_llm, [prompt], guided)[0].outputs[0]
    spec_llm = make_llm(tiny_llama, speculative={"method": "ngram", "num_tokens": 3})
    got = run(spec_llm, [prompt], guided)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.finish_reason == "stop"
    assert got.text == "ab" * 8
    forbidden_drafted = [d for d, kept in record_drafts if ord("c") in d[len(kept) :]]
    assert forbidden_drafted, f"no draft held a forbidden token: {record_drafts}"
    assert spec_llm.engine.spec_stats().num_accepted_tokens > 0, "allowed drafts are accepted"
    finish_clean(plain_llm)
    finish_clean(spec_llm)


def test_verify_never_accepts_a_draft_the_target_wants_but_the_grammar_forbids(tiny_llama):
    """The verify step alone: every row's argmax is its draft (an unmasked verify would accept
    all three), the second draft is forbidden: one draft is accepted, then the grammar's best."""
    llm = make_llm(tiny_llama, speculative={"method": "ngram", "num_tokens": 3})
    engine = llm.engine
    spec = GuidedSpec(GuidedKind.REGEX, "a[ab]*")
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, guided=spec))
    while not engine.scheduler.running or engine.scheduler.running[0].matcher is None:
        engine.step()
    request = engine.scheduler.running[0]
    drafts = [ord("a"), ord("c"), ord("a")]
    request.draft_token_ids = drafts
    rows = torch.zeros(4, engine.loaded.vocab_size)
    for i, draft in enumerate(drafts):
        rows[i, draft] = 10.0
    rows[1, ord("b")] = 5.0  # the grammar's best at the forbidden draft's place
    verdict = engine.speculation.verdict(request, rows)
    assert (verdict.token_ids, verdict.num_accepted) == ([ord("a"), ord("b")], 1)
    request.draft_token_ids = []
    engine.abort("r")
    finish_clean(llm)


def test_sampled_speculation_under_a_grammar_emits_only_allowed_tokens(tiny_llama):
    prompt = list(b"abcabcabcabcabcabcabcabcab")
    spec = GuidedSpec(GuidedKind.REGEX, "[ab]{24}")
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_tokens=24, guided=spec)
    llm = make_llm(tiny_llama, speculative={"method": "ngram", "num_tokens": 4})
    outputs = run(llm, [prompt] * 4, params)
    for output in outputs:
        assert set(output.outputs[0].text) <= {"a", "b"} and len(output.outputs[0].text) == 24
    assert llm.engine.spec_stats().num_verified > 0
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_keeps_constrained_outputs(tiny_llama, mode):
    prompts = [PROMPT + [ord("a") + i] for i in range(6)]
    params = [
        SamplingParams(temperature=t, seed=11 + i, max_tokens=96, guided=JSON)
        for i, t in enumerate([0.0, 1.0] * 3)
    ]
    alone = [
        run(make_llm(tiny_llama), [p], q)[0].outputs[0]
        for p, q in zip(prompts, params, strict=True)
    ]
    llm = make_llm(
        tiny_llama, num_kv_blocks=20, watermark=0.0, preemption_mode=mode, num_swap_blocks=64
    )
    together = run(llm, prompts, params)
    assert sum(o.metrics.num_preemptions for o in together) > 0, "no preemption: nothing tested"
    for got, expected in zip(together, alone, strict=True):
        assert got.outputs[0].token_ids == expected.token_ids
        assert valid(got.outputs[0].text)
    finish_clean(llm)


def stream(engine: Engine, request_id: str, params=None, handoff=None, until=None):
    if handoff is None:
        engine.add_request(request_id, PROMPT, params)
    else:
        engine.adopt(handoff)
    tokens, text, handoffs = [], "", {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            handoffs.update(delta.handoffs)
            for completion in delta.completions:
                tokens += completion.token_ids
                text += completion.text
        if until is not None and len(tokens) >= until and engine.has_unfinished_requests():
            engine.abort(request_id)
            break
    return tokens, text, handoffs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_replay_on_a_peer_rebuilds_the_matcher_from_the_tokens(tiny_llama, temperature):
    """A worker lost after `split` tokens: the peer gets the tokens only (no matcher state),
    replays them into a fresh matcher, and the document comes out as if never interrupted."""
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=96, guided=JSON)
    llm = make_llm(tiny_llama)
    whole, whole_text, _ = stream(llm.engine, "whole", params)
    assert valid(whole_text)
    for split in (1, 5, len(whole) // 2, len(whole) - 2):
        first, text, _ = stream(llm.engine, f"first{split}", params, until=split)
        handoff = RequestHandoff.replay(
            f"again{split}",
            PROMPT,
            first,
            len(text),
            params,
            priority=0,
            cache_extra_keys=(llm.engine.loaded.name,),
            block_size=llm.engine.kv.block_size,
            deadline_remaining_s=None,
        )
        if temperature > 0:  # the generator's state is what a replay cannot carry
            break
        rest, rest_text, _ = stream(llm.engine, None, handoff=handoff)
        assert first + rest == whole and text + rest_text == whole_text, split
    finish_clean(llm)


def test_the_prefill_to_decode_hand_off_carries_the_grammar(tiny_llama):
    loaded, _ = tiny_llama
    config = EngineConfig(block_size=8, num_kv_blocks=64, attention_backend="torch")
    prefiller = Engine(config, loaded=loaded, role=WorkerRole.PREFILL)
    decoder = Engine(config, loaded=loaded, role=WorkerRole.DECODE)
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=96, guided=JSON)
    alone, alone_text, _ = stream(make_llm(tiny_llama).engine, "alone", params)
    first, text, handoffs = stream(prefiller, "pd", params)
    assert list(handoffs) == [0] and len(first) == 1
    rest, rest_text, _ = stream(decoder, None, handoff=handoffs[0])
    assert first + rest == alone and valid(text + rest_text)
    assert decoder.num_adopted_with_kv == 1


def test_logit_bias_allowed_ids_and_bad_words(tiny_llama):
    llm = make_llm(tiny_llama)
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    free = run(llm, [PROMPT], SamplingParams(**greedy))[0].outputs[0].token_ids
    forced = run(llm, [PROMPT], SamplingParams(logit_bias={65: 100}, **greedy))[0]
    assert forced.outputs[0].text == "A" * 12
    banned = run(llm, [PROMPT], SamplingParams(logit_bias={free[0]: -100}, **greedy))[0]
    assert banned.outputs[0].token_ids[0] != free[0]
    allowed = SamplingParams(allowed_token_ids=[97, 98], temperature=1.0, seed=1, max_tokens=40)
    text = run(llm, [PROMPT], allowed)[0].outputs[0].text
    assert set(text) <= {"a", "b"} and len(text) == 40
    no_ab = SamplingParams(
        allowed_token_ids=[97, 98], bad_words=["ab"], temperature=1.0, seed=1, max_tokens=40
    )
    text = run(llm, [PROMPT], no_ab)[0].outputs[0].text
    assert "ab" not in text and set(text) <= {"a", "b"}
    finish_clean(llm)


def test_min_tokens_never_leaves_a_complete_grammar_without_a_token(tiny_llama):
    llm = make_llm(tiny_llama)
    spec = GuidedSpec(GuidedKind.REGEX, "ok")
    out = run(llm, [PROMPT], SamplingParams(min_tokens=5, max_tokens=8, guided=spec))[0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("ok", "stop")
    finish_clean(llm)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logit_bias={300: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, 259]), "allowed_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(tiny_llama, params, field):
    llm = make_llm(tiny_llama)
    with pytest.raises(RequestRejected, match=f"^{field} holds ids outside the vocabulary"):
        llm.engine.add_request("r", PROMPT, params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1}}, "must be a token id >= 0"),
        ({"allowed_token_ids": []}, "allowed_token_ids must hold 1.."),
        ({"bad_words": [" "]}, r"bad_words\[0\] must be a non-blank string"),
        ({"guided": "json"}, "guided must be a GuidedSpec"),
    ],
)
def test_sampling_params_check_the_new_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_json_logit_bias_keys_are_token_ids():
    assert SamplingParams(logit_bias={"65": 2}).logit_bias == {65: 2}


class HeldBackend:
    """The real backend, whose compiles wait for `release` (a compile that takes long)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.release = threading.Event()

    def compile(self, spec):
        self.release.wait(timeout=60)
        return self.inner.compile(spec)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def ended(delta):
    return [c for c in delta.completions if c.finish_reason]


def test_a_slow_compile_stalls_nobody_and_times_out(tiny_llama):
    """A compile held until the test releases it: a plain request runs to its end meanwhile;
    once the wait passes the time bound, the constrained request ends with `error`."""
    llm = make_llm(tiny_llama)
    engine = llm.engine
    held = HeldBackend(engine.guided.compiler.backend)
    engine.guided._compiler = GrammarCompiler(held, "held")
    engine.add_request("slow", PROMPT, SamplingParams(max_tokens=8, guided=JSON))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", PROMPT, plain)
    finishes = {}
    while "plain" not in finishes:
        for delta in engine.step():
            finishes.update((delta.request_id, c.finish_reason) for c in ended(delta))
    assert finishes == {"plain": "length"} and engine.guided.num_parked == 1
    engine.guided.compile_timeout_s = 0.0  # the bound has passed
    while engine.has_unfinished_requests():
        for delta in engine.step():
            finishes.update((delta.request_id, c.finish_reason) for c in ended(delta))
    held.release.set()
    assert finishes == {"plain": "length", "slow": "error"}
    finish_clean(llm)


def test_requests_waiting_for_their_grammar_count_against_max_waiting(tiny_llama):
    llm = make_llm(tiny_llama, max_waiting=2)
    engine = llm.engine
    held = HeldBackend(engine.guided.compiler.backend)
    engine.guided._compiler = GrammarCompiler(held, "held")
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=8, guided=JSON))
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=8, guided=JSON))
    with pytest.raises(Overloaded, match="waiting queue is full"):
        engine.add_request("c", PROMPT, SamplingParams(max_tokens=8))
    held.release.set()
    while engine.has_unfinished_requests():
        engine.step()
    finish_clean(llm)


def test_a_grammar_that_fails_on_the_worker_ends_only_its_request(tiny_llama):
    llm = make_llm(tiny_llama)
    bad = SamplingParams(guided=GuidedSpec(GuidedKind.GRAMMAR, "root ::= nowhere"))
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], [bad, good])
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].outputs[0].finish_reason == "length"
    finish_clean(llm)


def test_a_request_moved_mid_output_continues_on_the_peer(tiny_llama):
    """`move` preemption: a pool too small for four constrained requests hands some to a
    roomy peer with their KV; the peer rebuilds each matcher from the tokens and the outputs
    are the ones of each request run alone."""
    loaded, _ = tiny_llama
    small = EngineConfig(
        block_size=8,
        num_kv_blocks=16,
        attention_backend="torch",
        preemption_mode="move",
        watermark=0.0,
        enable_prefix_caching=False,
    )
    roomy = EngineConfig(block_size=8, num_kv_blocks=64, attention_backend="torch")
    source, peer = Engine(small, loaded=loaded), Engine(roomy, loaded=loaded)
    prompts = {f"r{i}": PROMPT + [ord("a") + i] for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=90, guided=JSON)
    tokens = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        source.add_request(request_id, prompt, params)
    for engine in (source, peer):
        while engine.has_unfinished_requests():
            for delta in engine.step():
                for completion in delta.completions:
                    tokens[delta.request_id] += completion.token_ids
                for handoff in delta.handoffs.values():
                    peer.adopt(handoff)
    assert source.num_handoffs >= 1, "nothing moved: nothing tested"
    llm = make_llm(tiny_llama)
    for request_id, prompt in prompts.items():
        alone = run(llm, [prompt], params)[0].outputs[0]
        assert tokens[request_id] == alone.token_ids and valid(alone.text)
    finish_clean(llm)
