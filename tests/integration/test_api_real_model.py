"""SmolLM2-135M-Instruct served, through the official `openai` client: tool calls (`required`,
a named function, `auto`; streamed and not) parse into OpenAI's `tool_calls`, and a
`response_format` json_schema answer validates.

SmolLM2's chat template has no tools: they reach the model in the system turn
(`api.openai.tools.tool_chat_turns`), and the grammar holds each call to its function's schema.
Under `auto` a 135M model calls only when the chat shows it how: the chat holds two earlier
calls, as the client sent them back.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from support.api_app import assert_app_clean, running_app
from support.real_model import SMOLLM2

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def earlier_call(city: str, i: int) -> list[dict]:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    function = {"name": "get_weather", "arguments": arguments}
    call = {"id": f"call_{i}", "type": "function", "function": function}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]


SHOWN_HOW = [*earlier_call("London", 1), *earlier_call("Berlin", 2), *PARIS]


@pytest.fixture(scope="module")
def app(serve_cluster):
    engine = {"model": SMOLLM2, "block_size": 16, "num_kv_blocks": 160}
    with running_app("api-real-model", engine=engine, num_workers=1) as running:
        yield running


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{app.http_url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def check_call(name: str, arguments: str) -> dict:
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, tool["function"]["parameters"])
    return parsed


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    """The (name, arguments) of each streamed call, the finish reason and the content."""
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                assert delta.index not in calls and delta.id.startswith("call_")
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish, content


def ask(oai, messages, stream: bool, **fields):
    return oai.chat.completions.create(
        model=SMOLLM2,
        messages=messages,
        tools=TOOLS,
        temperature=0.0,
        max_tokens=80,
        stream=stream,
        **fields,
    )


@pytest.mark.parametrize(
    ("messages", "choice", "name"),
    [
        (PARIS, "required", "get_weather"),
        (PARIS, {"type": "function", "function": {"name": "get_time"}}, "get_time"),
        (SHOWN_HOW, "auto", "get_weather"),
    ],
    ids=["required", "named", "auto"],
)
def test_tool_calls_parse_streamed_and_not(app, oai, messages, choice, name):
    whole = ask(oai, messages, False, tool_choice=choice, parallel_tool_calls=False)
    (answer,) = whole.choices
    assert answer.finish_reason == "tool_calls", answer.message
    assert answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.function.name == name
    arguments = check_call(name, call.function.arguments)
    if name == "get_weather":
        assert arguments["city"] == "Paris"

    stream = ask(oai, messages, True, tool_choice=choice, parallel_tool_calls=False)
    calls, finish, content = streamed_calls(stream)
    assert (calls, finish, content) == ([(name, call.function.arguments)], "tool_calls", "")
    assert_app_clean(app)


def test_auto_answers_in_text_when_the_model_does_not_call(app, oai):
    (answer,) = ask(oai, PARIS, False).choices  # greedy, it describes the weather instead
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None and "Paris" in answer.message.content
    assert_app_clean(app)


CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
    "additionalProperties": False,
}


def test_json_schema_answers_validate(app, oai):
    completion = oai.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "Describe Paris as a JSON object."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
        n=4,
        temperature=1.0,
        seed=11,
        max_tokens=120,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)
    assert_app_clean(app)
