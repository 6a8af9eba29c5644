"""Tool calling at the router: a chat body's `tools` and `tool_choice` checked into a
`ToolCalling`, the grammar each choice builds (walked byte by byte with xgrammar), and the
prompt a template without tools gets."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.api.common import chat_prompt, sampling_params
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.openai.models import ChatCompletionBody, parse_body
from pagedserve.cluster.api.openai.tools import ARGUMENTS_KEY, CALL_BEGIN, CALL_END
from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.structured.xgrammar_backend import XGrammarBackend

EOS = ByteTokenizer.eos_token_id
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
USER = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields) -> ChatCompletionBody:
    return parse_body(ChatCompletionBody, {"model": "m", "messages": USER, **fields})


def refused(**fields) -> ApiError:
    with pytest.raises(ApiError) as raised:
        chat = body(**fields)
        sampling_params(chat.sent_as(), max_tokens=4, **chat.sampling_kwargs())
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT
    return raised.value


def call(name: str, arguments: dict) -> str:
    return f"{CALL_BEGIN}{json.dumps(name)}, {ARGUMENTS_KEY}{json.dumps(arguments)}{CALL_END}"


PARIS = call("get_weather", {"city": "Paris", "unit": "C"})
NOW = call("get_time", {})


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(ByteTokenizer(), ByteTokenizer.vocab_size, [EOS])


def accepts(backend, chat: ChatCompletionBody, text: str) -> bool:
    """Whether the request's grammar takes `text` whole and then lets it end."""
    spec = chat.sampling_kwargs()["guided"]
    matcher = backend.new_matcher(backend.compile(spec))
    return all(matcher.accept_token(byte) for byte in text.encode()) and matcher.accept_token(EOS)


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "taken"),
    [
        ("required", True, PARIS, True),
        ("required", True, f"{PARIS}\n{NOW}", True),
        ("required", False, f"{PARIS}\n{NOW}", False),  # one call only
        ("required", True, "It is sunny.", False),  # calls only
        ("required", True, "", False),  # at least one
        ("required", True, call("get_weather", {"city": "Paris"}), False),  # unit is required
        ("required", True, call("get_wetter", {"city": "Paris", "unit": "C"}), False),
        ("required", True, call("get_weather", {"city": "Paris", "unit": "K"}), False),
        ("auto", True, "It is sunny.", True),
        ("auto", True, f"Let me see.\n{PARIS}", True),
        ("auto", True, f"{PARIS}\n{NOW}", True),
        ("auto", False, f"{PARIS}\n{NOW}", False),
        ("auto", True, f"See {call('get_weather', {'city': 'Paris'})}", False),
        ({"type": "function", "function": {"name": "get_time"}}, True, NOW, True),
        ({"type": "function", "function": {"name": "get_time"}}, True, PARIS, False),
        ({"type": "function", "function": {"name": "get_time"}}, True, f"{NOW}\n{NOW}", False),
    ],
)
def test_each_choice_s_grammar(backend, choice, parallel, text, taken):
    chat = body(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel)
    assert accepts(backend, chat, text) is taken


def test_tools_default_to_auto_and_none_constrains_nothing():
    assert body(tools=[WEATHER]).tool_calling.mode == "auto"
    chat = body(tools=[WEATHER], tool_choice="none")
    assert chat.tool_calling.mode == "none" and chat.sampling_kwargs()["guided"] is None
    # `none` leaves room for a response format; the other choices are a grammar already.
    chat = body(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    assert chat.sampling_kwargs()["guided"] is not None
    assert (
        "at most one" in refused(tools=[WEATHER], response_format={"type": "json_object"}).message
    )


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", ""),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
            "no tool is named 'x'",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "named twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "pattern",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
            "tools[0].function.parameters is invalid",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ""),
        ({"tools": []}, "tools", "at least 1"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(fields, param, text):
    error = refused(**fields)
    assert error.param == param
    assert text in error.message


def test_calls_and_results_are_written_into_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    chat = parse_body(ChatCompletionBody, {"model": "m", "messages": messages, "tools": [WEATHER]})
    prompt = chat_prompt(chat.turns(), ByteTokenizer(), tools=chat.tool_calling)
    system, user, assistant, tool, opened = prompt.split("<|")[1:]
    assert system.startswith("system|>\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in system
    assert user == "user|>\nWeather in Paris?\n"
    assert assistant == f"assistant|>\n{call('get_weather', {'city': 'Paris'})}\n"
    assert tool == "user|>\n<tool_response>\nSunny, 21 C\n</tool_response>\n"
    assert opened == "assistant|>\n"


def test_a_template_that_takes_tools_renders_them_itself(smollm2_tokenizer, monkeypatch):
    template = "{{ tools | tojson }}|{% for m in messages %}{{ m | tojson }}{% endfor %}"
    monkeypatch.setattr(smollm2_tokenizer.hf_tokenizer, "chat_template", template)
    chat = body(tools=[WEATHER])
    prompt = chat_prompt(chat.turns(), smollm2_tokenizer, tools=chat.tool_calling)
    tools, turns = prompt.split("|", 1)
    assert json.loads(tools) == [WEATHER]
    assert json.loads(turns) == USER[0]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant"}, "messages[0].content"),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "messages[0].tool_calls",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_turns_are_refused_naming_them(message, param):
    chat = parse_body(ChatCompletionBody, {"model": "m", "messages": [message]})
    with pytest.raises(ApiError) as raised:
        chat.turns()
    assert raised.value.param == param
