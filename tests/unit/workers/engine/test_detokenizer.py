"""IncrementalDetokenizer: UTF-8 split across tokens, stop strings, hold-back and flush."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.workers.engine.detokenizer import IncrementalDetokenizer

EOS = 258


class ByteTok:
    """Stand-in for the byte tokenizer: ids 0..255 are bytes, 256..258 are specials ("")."""

    def __init__(self) -> None:
        self.decoded_tokens = 0  # total ids decoded, to check the work stays linear

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded_tokens += len(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    """Deltas of feeding ``ids`` ``chunk`` at a time, then the flush."""
    deltas = [detok.append(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


def test_ascii_streams_token_by_token() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    assert stream(detok, ids_of("hi!")) == ["h", "i", "!", ""]
    assert detok.text == "hi!" and detok.stopped_by is None
    assert detok.token_ids == ids_of("hi!")


def test_multibyte_character_waits_for_its_last_byte() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    # "€" is E2 82 AC, "😀" is F0 9F 98 80.
    assert stream(detok, ids_of("a€😀b")) == ["a", "", "", "€", "", "", "", "😀", "b", ""]
    assert detok.text == "a€😀b"


def test_special_tokens_decode_to_nothing() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    assert stream(detok, [257, *ids_of("ok"), EOS]) == ["", "o", "k", "", ""]
    assert detok.text == "ok"


def test_flush_emits_an_unfinished_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    assert detok.append(ids_of("x")) == "x"
    assert detok.append([0xE2, 0x82]) == ""
    assert detok.text == "x"
    assert detok.flush() == "\ufffd"
    assert detok.text == "x\ufffd"
    assert detok.flush() == ""


def test_stop_string_spanning_tokens() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["END"])
    deltas = stream(detok, ids_of("helloEND world"))
    assert "".join(deltas) == "hello" == detok.text
    assert detok.stopped_by == "END"
    assert detok.append(ids_of("more")) == ""  # stopped: later tokens are ignored
    assert detok.text == "hello"


def test_stop_string_spanning_a_multibyte_character() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop="€!")
    deltas = stream(detok, ids_of("a €!b"))
    assert deltas[:2] == ["a", " "]
    assert "".join(deltas) == "a " == detok.text
    assert detok.stopped_by == "€!"


def test_include_stop_str_in_output() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["END"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids_of("helloEND world"))) == "helloEND" == detok.text


def test_possible_stop_prefix_is_held_then_released() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["STOP"])
    assert [detok.append([i]) for i in ids_of("go ST")] == ["g", "o", " ", "", ""]
    assert detok.text == "go ST"
    assert detok.flush() == "ST"


def test_held_prefix_released_once_it_diverges() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["STOP"])
    assert [detok.append(ids_of(c)) for c in "STX"] == ["", "", "STX"]


def test_only_the_longest_possible_prefix_is_held() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["abc", "xyz"])
    assert detok.append(ids_of("aaab")) == "aa"  # "ab" may still become "abc"


def test_first_completed_stop_string_wins() -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=["abcd", "bc"])
    assert "".join(stream(detok, ids_of("xabcdy"), chunk=6)) == "xa"
    assert detok.stopped_by == "bc"


def test_chunked_appends_match_token_by_token() -> None:
    text = "naïve café — fin: STOP here"
    for chunk in (1, 2, 3, 7, 100):
        detok = IncrementalDetokenizer(ByteTok(), stop=["STOP", "zz"])
        assert "".join(stream(detok, ids_of(text), chunk)) == "naïve café — fin: "
        assert detok.stopped_by == "STOP"


def test_long_output_decodes_a_bounded_window() -> None:
    tok = ByteTok()
    detok = IncrementalDetokenizer(tok)
    text = "héllo wörld ✓ " * 300
    assert "".join(stream(detok, ids_of(text))) == text
    assert tok.decoded_tokens < 20 * len(ids_of(text))


def test_long_run_of_invalid_bytes_stays_linear_and_exact() -> None:
    tok = ByteTok()
    detok = IncrementalDetokenizer(tok)
    ids = [0xFF] * 3000 + [0xE2, 0x82, 0xAC] + [0x80] * 50 + [0xF0, 0x9F]
    assert "".join(stream(detok, ids)) == tok.decode(ids) == detok.text
    assert tok.decoded_tokens < 100 * len(ids)


def test_with_the_real_byte_tokenizer() -> None:
    from pagedserve.workers.model.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stop=["\n\n"])
    ids = [*tokenizer.encode("ça va?\n\nnext"), tokenizer.eos_token_id]
    assert "".join(stream(detok, ids)) == "ça va?"


# ---- properties --------------------------------------------------------------------------------

token_ids = st.one_of(
    st.lists(st.integers(0, 258), max_size=60),
    st.text(max_size=30).map(ids_of),
    st.lists(st.sampled_from([0x41, 0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0x9F, 0xFF, 257]), max_size=60),
)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, chunks=st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_deltas_plus_flush_equal_the_decoded_text(ids: list[int], chunks: list[int]) -> None:
    tok = ByteTok()
    detok = IncrementalDetokenizer(tok)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)]
        deltas.append(detok.append(ids[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == tok.decode(ids)


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Text cut at the stop string a character-by-character stream completes first."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab€ ", max_size=25),
    stops=st.lists(st.text(alphabet="ab€", min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 4),
)
def test_stop_strings_match_a_reference(
    text: str, stops: list[str], include: bool, chunk: int
) -> None:
    detok = IncrementalDetokenizer(ByteTok(), stop=stops, include_stop_str_in_output=include)
    emitted = "".join(stream(detok, ids_of(text), chunk))
    expected, stopped_by = _reference_stop(text, stops, include)
    assert emitted == detok.text == expected
    assert detok.stopped_by == stopped_by


def test_resume_reports_only_what_the_other_one_had_not_emitted() -> None:
    text = "ab€ cST!OP tail"
    ids = ids_of(text)
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(ByteTok(), stop=["STOP"])
        sent = "".join(first.append([i]) for i in ids[:cut])
        second = IncrementalDetokenizer(ByteTok(), stop=["STOP"])
        second.resume(ids[:cut], first.num_emitted_chars)
        rest = "".join(stream(second, ids[cut:]))
        assert sent + rest == text == second.text, cut
