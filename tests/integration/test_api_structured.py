"""Structured outputs and token constraints end to end, through Serve's HTTP and gRPC proxies:
the official `openai` client's `response_format` (json_schema with strict, json_object), the
vLLM-style extras, `logit_bias`, streamed and not; bad specs refused with 400 naming the field
before any work is queued. tiny-llama's random weights never write JSON by themselves: every
valid document here is the grammar's doing."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
import requests
from support.api_app import ENGINE, assert_app_clean, running_app

from pagedserve.cluster.client import Client

MODEL = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "new"]}, "maxItems": 3},
        "mayor": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["city", "population", "tags", "mayor"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def app(serve_cluster):
    # Room for the tools' prompt (tiny-llama's tokens are bytes) beside the output.
    engine = {**ENGINE, "num_kv_blocks": 256}
    with running_app("api-structured", engine=engine) as running:
        yield running


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{app.http_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_chat_json_schema_outputs_validate_for_every_branch(app, oai):
    completion = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a city as JSON."}],
        response_format=RESPONSE_FORMAT,
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    assert len(completion.choices) == 4
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert_app_clean(app)


def test_streamed_json_schema_completion_validates(app, oai):
    stream = oai.completions.create(
        model=MODEL,
        prompt="A city as JSON:",
        stream=True,
        temperature=1.0,
        seed=5,
        max_tokens=200,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    text, finish, chunks = "", None, 0
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        chunks += 1
    assert finish == "stop" and chunks > 2, (finish, text)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert_app_clean(app)


def test_json_object_outputs_are_objects(app, oai):
    """Any JSON object: biased towards closing quotes and braces (a random model's strings
    would otherwise run past max_tokens), each branch is a complete object."""
    completion = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Some JSON please."}],
        response_format={"type": "json_object"},
        logit_bias={"34": 8, "125": 8},
        n=4,
        temperature=1.0,
        seed=8,
        max_tokens=200,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
    assert_app_clean(app)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{4}", t)),
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        (
            {"guided_grammar": 'root ::= "(" [a-c]+ ")"'},
            lambda t: re.fullmatch(r"\([a-c]+\)", t),
        ),
        ({"structured_outputs": {"regex": "x{2,5}"}}, lambda t: re.fullmatch("x{2,5}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
    ],
)
def test_vllm_style_extras(oai, extra, check):
    completion = oai.completions.create(
        model=MODEL,
        prompt="Answer:",
        n=2,
        temperature=1.0,
        seed=1,
        max_tokens=200,
        extra_body=extra,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


def test_logit_bias_forces_a_token(oai):
    completion = oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=0.0,
        logit_bias={"66": 100},
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].text == "B" * 6


def test_grpc_sampling_params_carry_the_grammar(app):
    with Client(app.grpc_address, timeout=120) as client:
        response = client.generate(
            "A city:",
            max_tokens=200,
            temperature=1.0,
            seed=2,
            guided_json=json.dumps(SCHEMA),
            guided_json_strict=True,
        )
        text = response.completions[0].text
        jsonschema.validate(json.loads(text), SCHEMA)
        choice = client.generate("Pick:", max_tokens=10, guided_choice=["yes", "no"])
        assert choice.completions[0].text in ("yes", "no")
        with pytest.raises(grpc.RpcError) as error:
            client.generate("x", max_tokens=4, guided_regex="a(b")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("guided_regex is invalid")
    assert_app_clean(app)


BAD = [
    # (body fields, param, text in message)
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex is invalid"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "is not defined"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.json_schema",
        "Unsupported type",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "1..1024"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json", "at most one"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]", "[-100, 100]"),
    ({"logit_bias": {"400": 1}}, None, "logit_bias holds ids outside the vocabulary"),
    ({"allowed_token_ids": [1, 999]}, None, "allowed_token_ids holds ids outside"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
]


@pytest.mark.parametrize(("fields", "param", "text"), BAD, ids=[str(b[1]) for b in BAD])
def test_bad_specs_are_refused_naming_the_field(app, fields, param, text):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, **fields}
    response = requests.post(f"{app.http_url}/v1/completions", json=body, timeout=60)
    error = response.json().get("error", {})
    assert response.status_code == 400 and error.get("code") == "invalid_argument", response.text
    assert text in error.get("message", ""), error
    if param is not None:
        assert error.get("param") == param, error
    assert_app_clean(app)


# ------------------------------------------------------------------ tool calls
# The tools' prompt is ~900 of tiny-llama's byte tokens; one call (`parallel_tool_calls:
# false`, a named choice) ends in ~100.
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "hourly": {"type": "boolean"},
            },
            "required": ["unit", "days", "hourly"],
            "additionalProperties": False,
        },
    },
}
ALERTS = {
    "type": "function",
    "function": {
        "name": "alerts",
        "parameters": {
            "type": "object",
            "properties": {"severe": {"type": "boolean"}},
            "required": ["severe"],
            "additionalProperties": False,
        },
    },
}
WEATHER_CHAT = [{"role": "user", "content": "Forecast please."}]


def check_call(name: str, arguments: str) -> None:
    tool = {"forecast": FORECAST, "alerts": ALERTS}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_required_tool_calls_parse_for_every_branch(app, oai):
    """A random model under the grammar: every branch answers with calls only, each naming an
    offered tool with arguments its schema takes."""
    completion = oai.chat.completions.create(
        model=MODEL,
        messages=WEATHER_CHAT,
        tools=[FORECAST, ALERTS],
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        temperature=1.0,
        seed=4,
        max_tokens=150,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, call.function.arguments)
    assert_app_clean(app)


def test_named_tool_call_streams_its_arguments(app, oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=WEATHER_CHAT,
        tools=[FORECAST, ALERTS],
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        temperature=1.0,
        seed=6,
        max_tokens=150,
        stream=True,
    )
    calls: dict[int, dict] = {}
    pieces, finish = 0, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
            calls[delta.index]["args"] += delta.function.arguments or ""
            pieces += 1
        assert not choice.delta.content
    assert finish == "tool_calls" and pieces > 2, calls
    assert [c["name"] for c in calls.values()] == ["forecast"]
    check_call("forecast", calls[0]["args"])
    assert_app_clean(app)


def test_a_tool_s_result_goes_back_into_the_chat(app, oai):
    arguments = json.dumps({"unit": "C", "days": 2, "hourly": False})
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "forecast", "arguments": arguments},
    }
    messages = [
        *WEATHER_CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "Sunny, then rain."},
    ]
    completion = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[FORECAST], max_tokens=8, temperature=0.0
    )
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert completion.usage.prompt_tokens > len("Sunny, then rain.")
    assert_app_clean(app)


def test_unknown_tool_choice_is_refused(app):
    body = {
        "model": MODEL,
        "messages": WEATHER_CHAT,
        "tools": [FORECAST],
        "tool_choice": {"type": "function", "function": {"name": "radar"}},
    }
    response = requests.post(f"{app.http_url}/v1/chat/completions", json=body, timeout=60)
    error = response.json().get("error", {})
    assert response.status_code == 400 and error.get("param") == "tool_choice.function.name"
    assert "radar" in error.get("message", "")
    assert_app_clean(app)


def test_responses_api_function_calls(app, oai):
    """`/v1/responses` with a function tool: the call is a `function_call` item, streamed as
    its arguments are generated, and its arguments take the tool's schema."""
    function = FORECAST["function"]
    tool = {"type": "function", "name": function["name"], "parameters": function["parameters"]}
    fields = {
        "model": MODEL,
        "input": "Forecast please.",
        "tools": [tool],
        "max_output_tokens": 150,
    }
    fields |= {"tool_choice": "required", "temperature": 1.0}
    response = oai.responses.create(**fields)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "forecast" and call.status == "completed"
    check_call("forecast", call.arguments)

    kinds, arguments, final = [], "", None
    for event in oai.responses.create(**fields, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.completed":
            final = event.response
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == arguments
    check_call("forecast", arguments)
    assert "response.output_text.delta" not in kinds
    assert_app_clean(app)
