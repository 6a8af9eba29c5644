"""`ToolCallParser` and `ToolAnswers`: a choice's text → content and tool calls, the same fed in
any pieces as fed whole, in OpenAI's message and delta shapes."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.cluster.api.openai.tool_call_parser import ToolAnswers, ToolCallParser
from pagedserve.cluster.api.openai.tools import ARGUMENTS_KEY, CALL_BEGIN, CALL_END


def call(name: str, arguments: dict | str) -> str:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f"{CALL_BEGIN}{json.dumps(name)}, {ARGUMENTS_KEY}{text}{CALL_END}"


WEATHER = call("get_weather", {"city": "Paris", "unit": "celsius"})
NESTED = call("plan", {"steps": [{"do": "a}b"}, {"do": "</tool_ca"}], "n": {"x": {}}})
TEXTS = [
    "Just an answer.",
    WEATHER,
    f"Let me look.\n{WEATHER}",
    f"{WEATHER}\n{NESTED}",
    f"Before {WEATHER} between\n{NESTED}\nafter",
    "A < sign, a <tool tag and a } brace are content.",
    call("f", "{ }"),
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """The content and (id, name, arguments) of each call, from the parser's deltas."""
    parser = ToolCallParser(ids())
    content, calls = "", {}
    for parsed in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        content += parsed.content
        for delta in parsed.calls:
            if delta.id is not None:
                assert delta.index not in calls, "a call's start is sent once"
                calls[delta.index] = [delta.id, delta.name, ""]
            calls[delta.index][2] += delta.arguments
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c.id, c.name, c.arguments) for c in parser.calls
    ]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text", TEXTS)
def test_whole_text(text):
    content, calls = parse([text])
    expected_calls = text.count(CALL_BEGIN)
    assert len(calls) == expected_calls
    for _, _, arguments in calls:
        json.loads(arguments)
    if not expected_calls:
        assert content == text


def test_content_and_calls_are_split_where_they_meet():
    content, calls = parse([f"Before {WEATHER} between\n{NESTED}\nafter"])
    assert content == "Beforebetweenafter"
    assert calls == [
        ("call_0", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("call_1", "plan", '{"steps": [{"do": "a}b"}, {"do": "</tool_ca"}], "n": {"x": {}}}'),
    ]


@given(
    text=st.sampled_from(TEXTS),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_any_pieces_give_what_the_whole_gives(text, cuts):
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert parse(pieces) == parse([text])


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(ids())
    first = parser.feed(f'{CALL_BEGIN}"f", {ARGUMENTS_KEY}{{"city": "Pa')
    assert [(d.index, d.id, d.name, d.arguments) for d in first.calls] == [
        (0, "call_0", "f", '{"city": "Pa')
    ]
    later = parser.feed('ris"}')
    assert [d.arguments for d in later.calls] == ['ris"']  # the `}` may be the call's end
    end = parser.feed("}\n</tool_call>")
    assert [d.arguments for d in end.calls] == ["}"]
    assert parser.called


def test_a_call_cut_short_keeps_its_arguments_and_is_not_called():
    parser = ToolCallParser(ids())
    parser.feed(f'Hi {CALL_BEGIN}"f", {ARGUMENTS_KEY}{{"a": [1, 2')
    parser.finish()
    assert parser.content == "Hi"
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("f", '{"a": [1, 2', False)
    ]
    assert not parser.called


def test_a_header_cut_short_is_content():
    parser = ToolCallParser(ids())
    parser.feed('Hi <tool_call>\n{"na')
    assert parser.finish().content == '<tool_call>\n{"na'
    assert parser.calls == []


def test_answers_carry_calls_and_finish_with_tool_calls():
    answers = ToolAnswers(ids())
    message, finish = answers.message(f"Sure.\n{WEATHER}", "stop")
    assert message.model_dump() == {
        "role": "assistant",
        "content": "Sure.",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    }
    assert finish == "tool_calls"
    only_calls, _ = answers.message(WEATHER, "stop")
    assert only_calls.content is None
    plain, finish = answers.message("No call.", "stop")
    assert plain.model_dump() == {"role": "assistant", "content": "No call."}
    assert finish == "stop"
    assert answers.message(WEATHER[:-3], "length")[1] == "length"


def test_stream_deltas_are_openai_shaped():
    answers = ToolAnswers(ids())
    head, rest = WEATHER[:51], WEATHER[51:]  # the header and `{"`
    content, calls, finish = answers.delta(0, "Ok " + head, None)
    assert (content, finish) == ("Ok", None)
    assert [c.model_dump() for c in calls] == [
        {
            "index": 0,
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"'},
        }
    ]
    content, calls, finish = answers.delta(0, rest, "stop")
    assert content is None and finish == "tool_calls"
    assert [c.model_dump() for c in calls] == [
        {"index": 0, "function": {"arguments": 'city": "Paris", "unit": "celsius"}'}}
    ]
    # Branches parse apart.
    assert answers.delta(1, "Plain", "stop") == ("Plain", None, "stop")
