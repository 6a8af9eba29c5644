"""The structured-output and token-constraint fields of both front ends → `SamplingParams`,
and the INVALID_ARGUMENT naming the field the client sent, all at the router (no worker)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.api.common import sampling_params
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.grpc.convert import params_from_proto
from pagedserve.cluster.api.openai.models import ChatCompletionBody, CompletionBody, parse_body
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def completion_params(**fields):
    body = parse_body(CompletionBody, {"model": "m", "prompt": "x", **fields})
    return sampling_params(body.sent_as(), max_tokens=4, **body.sampling_kwargs())


def chat_params(**fields):
    messages = [{"role": "user", "content": "hi"}]
    body = parse_body(ChatCompletionBody, {"model": "m", "messages": messages, **fields})
    return sampling_params(body.sent_as(), max_tokens=4, **body.sampling_kwargs())


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GuidedSpec(GuidedKind.JSON_OBJECT)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA, "strict": True},
                }
            },
            GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA), strict=True),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMA},
                }
            },
            GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA), strict=False),
        ),
        ({"guided_json": SCHEMA}, GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps(SCHEMA), False)),
        (
            {"guided_json": '{"type": "array"}'},
            GuidedSpec(GuidedKind.JSON_SCHEMA, '{"type": "array"}', False),
        ),
        ({"guided_regex": "[a-z]+"}, GuidedSpec(GuidedKind.REGEX, "[a-z]+")),
        ({"guided_choice": ["a", "b"]}, GuidedSpec.choice(["a", "b"])),
        ({"guided_grammar": 'root ::= "x"'}, GuidedSpec(GuidedKind.GRAMMAR, 'root ::= "x"')),
        ({"structured_outputs": {"choice": ["y"]}}, GuidedSpec.choice(["y"])),
        ({"structured_outputs": {"json_object": True}}, GuidedSpec(GuidedKind.JSON_OBJECT)),
    ],
)
@pytest.mark.parametrize("params_of", [completion_params, chat_params])
def test_every_spelling_reaches_sampling_params(params_of, fields, expected):
    guided = params_of(**fields).guided
    if expected is None:
        assert guided is None
    else:
        assert (guided.kind, guided.strict) == (expected.kind, expected.strict)
        assert guided.value == expected.value  # the schema's property order is kept


def test_token_constraints_reach_sampling_params():
    params = completion_params(
        logit_bias={"65": -100, "66": 2.5}, allowed_token_ids=[1, 2], bad_words=["no"]
    )
    assert params.logit_bias == {65: -100, 66: 2.5}
    assert (params.allowed_token_ids, params.bad_words) == ([1, 2], ["no"])


BAD = [
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex is invalid: "),
    ({"guided_grammar": "root ::= y"}, "guided_grammar", 'Rule "y" is not defined'),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "is invalid"),
    ({"guided_json": "{"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_json": {"type": "bogus"}}, "guided_json", 'Unsupported type "bogus"'),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": 1}},
            }
        },
        "response_format.json_schema",
        "response_format.json_schema is invalid",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"guided_choice": ["ok", ""]}, "guided_choice", "guided_choice[1] must be a non-empty"),
    (
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
        "guided_regex and response_format: at most one structured-output field",
    ),
    ({"guided_grammar": "x" * 70_000}, "guided_grammar", "at most 65536"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[b[1] for b in BAD])
def test_bad_specs_name_the_field_sent(fields, param, message):
    with pytest.raises(ApiError) as caught:
        completion_params(**fields)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.param == param and message in caught.value.message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"3": 100.5}}, "logit_bias[3] must be in [-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids must hold"),
        ({"bad_words": [""]}, "bad_words[0] must be a non-blank string"),
    ],
)
def test_bad_token_constraints_name_the_field(fields, message):
    with pytest.raises(ApiError) as caught:
        completion_params(**fields)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and message in caught.value.message


def test_grpc_fields():
    message = pb.SamplingParams(
        guided_json=json.dumps(SCHEMA),
        guided_json_strict=True,
        logit_bias={7: 1.5},
        allowed_token_ids=[7, 8],
        bad_words=["w"],
    )
    params = params_from_proto(message)
    assert (params.guided.kind, params.guided.strict) == (GuidedKind.JSON_SCHEMA, True)
    assert params.logit_bias == {7: 1.5} and params.allowed_token_ids == [7, 8]
    assert params_from_proto(pb.SamplingParams(guided_choice=["a"])).guided.choices() == ["a"]
    assert (
        params_from_proto(pb.SamplingParams(guided_json_object=True)).guided.kind == "json_object"
    )
    plain = params_from_proto(pb.SamplingParams())
    assert plain.guided is None and plain.allowed_token_ids is None and plain.logit_bias == {}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (pb.SamplingParams(guided_regex="("), "guided_regex"),
        (pb.SamplingParams(guided_grammar="root ::= q"), "guided_grammar"),
        (pb.SamplingParams(guided_regex="a", guided_choice=["b"]), "guided_choice"),
    ],
)
def test_grpc_bad_specs_name_the_field(message, param):
    with pytest.raises(ApiError) as caught:
        params_from_proto(message)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and caught.value.param == param
