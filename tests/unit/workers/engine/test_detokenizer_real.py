"""Streamed text and stop strings with a real BPE tokenizer (SmolLM2's): a character that
spans several tokens is never emitted half, and a stop string made of such characters cuts the
text exactly where a whole-text search would."""

from __future__ import annotations

import pytest
from support.real_text import EMOJI, FRENCH, JAPANESE

from pagedserve.workers.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [JAPANESE, EMOJI, FRENCH, "naïve café — 東京 🍓🍓 done"]


def split_characters(tokenizer, ids: list[int]) -> int:
    """How many tokens decode alone to U+FFFD: pieces of a character split over tokens."""
    return sum(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_never_hold_half_a_character(smollm2_tokenizer, text):
    tokenizer = smollm2_tokenizer
    ids = tokenizer.encode(text)
    if text is not FRENCH:  # the test means something only if characters are split
        assert split_characters(tokenizer, ids) > 0
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.append([token]) for token in ids]
    deltas.append(detokenizer.flush())
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text, stop",
    [
        (JAPANESE, "東京"),
        (EMOJI, "🍓"),
        ("naïve café — 東京 🍓🍓 done", "🍓 done"),
        (FRENCH, "é construite"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_of_multibyte_characters(smollm2_tokenizer, text, stop, include):
    tokenizer = smollm2_tokenizer
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [stop], include_stop_str_in_output=include)
    deltas = []
    for token in ids:
        deltas.append(detokenizer.append([token]))
        if detokenizer.stopped_by is not None:
            break
    deltas.append(detokenizer.flush())
    end = text.index(stop) + (len(stop) if include else 0)
    assert detokenizer.stopped_by == stop
    assert "".join(deltas) == detokenizer.text == text[:end]
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def resumed_at(tokenizer, ids: list[int], split: int, stops: list[str]) -> tuple[str, str | None]:
    """A stream whose first detokenizer (a lost worker's) saw `ids[:split]`, and a second one
    (a replay on a peer) resumed from those tokens and the text the client got: the client's
    whole text, and the stop string that ended it."""
    first = IncrementalDetokenizer(tokenizer, stops)
    got = ""
    for token in ids[:split]:
        got += first.append([token])
        if first.stopped_by is not None:
            return got + first.flush(), first.stopped_by
    second = IncrementalDetokenizer(tokenizer, stops)
    second.resume(ids[:split], len(got))
    for token in ids[split:]:
        got += second.append([token])
        if second.stopped_by is not None:
            break
    return got + second.flush(), second.stopped_by


@pytest.mark.parametrize("text", TEXTS)
def test_a_replay_resumes_the_text_exactly_at_every_split(smollm2_tokenizer, text):
    """A worker lost after any token, a character split over tokens or not: the client's text
    is the text, never a character lost, doubled or half."""
    ids = smollm2_tokenizer.encode(text)
    for split in range(1, len(ids)):
        assert resumed_at(smollm2_tokenizer, ids, split, []) == (text, None), split


@pytest.mark.parametrize(
    "text, stop",
    [(JAPANESE, "東京"), (EMOJI, "🍓"), ("naïve café — 東京 🍓🍓 done", "🍓 done")],
)
def test_a_stop_string_spanning_the_replay_point_still_stops(smollm2_tokenizer, text, stop):
    ids = smollm2_tokenizer.encode(text)
    expected = (text[: text.index(stop)], stop)
    for split in range(1, len(ids)):
        assert resumed_at(smollm2_tokenizer, ids, split, [stop]) == expected, split
