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
from support.api_app import assert_app_clean, running_app

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
    with running_app("api-structured") as running:
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
