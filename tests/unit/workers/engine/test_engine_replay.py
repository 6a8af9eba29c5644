"""A sequence replayed on a peer from its tokens (its worker was lost) continues its text
exactly: `RequestHandoff.replay` carries the output tokens and how much of their text the client
got, and the adopting engine's detokenizer resumes there. tiny-llama's tokens are bytes, so
every UTF-8 character of two or more bytes is split over tokens, and a random output is full
of incomplete and invalid sequences: the hardest case for a resumed detokenizer."""

from __future__ import annotations

import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.handoff import RequestHandoff

PROMPT = list("Réplique: «naïve café» → 日本語テキスト".encode())
MAX_TOKENS = 24


def make_llm(tiny_llama) -> LLM:
    loaded, _ = tiny_llama
    return LLM(loaded_model=loaded, block_size=8, num_kv_blocks=128, attention_backend="torch")


def stream(
    llm: LLM,
    request_id: str,
    params: SamplingParams,
    *,
    until: int | None = None,
    handoff: RequestHandoff | None = None,
):
    """Run `request_id` (PROMPT, or an adopted `handoff`) to its end, or abort it once `until`
    tokens came out (as a lost worker's stream stops): the token ids and the text the client
    received, and how it ended."""
    if handoff is None:
        llm.engine.add_request(request_id, PROMPT, params)
    else:
        llm.engine.adopt(handoff)
    tokens, text, finish = [], "", None
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            for completion in delta.completions:
                tokens += completion.token_ids
                text += completion.text
                finish = completion.finish_reason or finish
        if until is not None and len(tokens) >= until and finish is None:
            llm.engine.abort(request_id)
            break
    return tokens, text, finish


def replayed(llm: LLM, params: SamplingParams, split: int):
    """The client's whole text when the first worker is lost after `split` tokens and a peer
    continues from a replay handoff; and the text it had at the split."""
    tokens, text, finish = stream(llm, "first", params, until=split)
    if finish is not None:
        return tokens, text, finish, text
    handoff = RequestHandoff.replay(
        "again",
        PROMPT,
        tokens,
        len(text),
        params,
        priority=0,
        cache_extra_keys=(llm.engine.loaded.name,),
        block_size=llm.engine.kv.block_size,
        deadline_remaining_s=None,
    )
    more_tokens, more_text, finish = stream(llm, "again", params, handoff=handoff)
    return tokens + more_tokens, text + more_text, finish, text


def test_replayed_text_continues_byte_exactly_at_every_split(tiny_llama):
    llm = make_llm(tiny_llama)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, text, _ = stream(llm, "whole", params)
    decode = llm.get_tokenizer().decode
    held_back_splits = 0
    for split in range(1, MAX_TOKENS):
        got_tokens, got_text, _, at_split = replayed(llm, params, split)
        assert (got_tokens, got_text) == (tokens, text), f"split after {split} tokens"
        # The text a client has after `split` tokens may lag them (a character not complete).
        held_back_splits += len(at_split) < len(decode(tokens[:split]))
    assert held_back_splits > 0, "no split fell inside a held-back character: nothing tested"
    finish_clean(llm)


@pytest.mark.parametrize("offset", [-2, -1, 0, 1])
def test_a_stop_string_spanning_the_split_still_stops(tiny_llama, offset):
    llm = make_llm(tiny_llama)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _, text, _ = stream(llm, "whole", params)
    # A stop string of 4 characters from the middle of the output; the split falls in it.
    start = len(text) // 2
    stop = text[start : start + 4]
    with_stop = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop])
    expected_tokens, expected_text, expected_finish = stream(llm, "alone", with_stop)
    assert expected_finish == "stop" and expected_text == text[: text.index(stop)]
    split = len(text[: start + 2].encode("utf-8", "surrogatepass")) + offset
    split = max(1, min(split, len(expected_tokens) - 1))
    got_tokens, got_text, got_finish, _ = replayed(llm, with_stop, split)
    assert (got_text, got_finish) == (expected_text, "stop")
    assert got_tokens == expected_tokens
    finish_clean(llm)


@pytest.mark.parametrize("max_tokens", [1_000_000, 10_000])
def test_a_replay_that_cannot_fit_is_refused_not_left_waiting(tiny_llama, max_tokens):
    """A lost worker may not have checked the request yet: its replay is checked here, past
    the context (1,000,000) or past the pool (10,000 tokens, 128 blocks of 8), never queued."""
    llm = make_llm(tiny_llama)
    loaded, _ = tiny_llama
    llm.engine.intake.max_model_len = 1_000  # the pool, not the context, refuses 10,000 here
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    handoff = RequestHandoff.replay(
        "lost",
        PROMPT,
        [],
        0,
        params,
        priority=0,
        cache_extra_keys=(loaded.name,),
        block_size=llm.engine.kv.block_size,
        deadline_remaining_s=None,
    )
    with pytest.raises(RequestRejected, match="max_tokens"):
        llm.engine.adopt(handoff)
    finish_clean(llm)
