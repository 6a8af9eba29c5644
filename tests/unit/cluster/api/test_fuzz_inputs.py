"""Hostile input, fuzzed: every HTTP body and gRPC message either becomes a valid request or
an `ApiError` (400 / INVALID_ARGUMENT) naming the field at fault, never another exception.

HTTP bodies start from a valid one and are mutated (wrong types, extreme numbers, NaN, unknown
fields such as `logit_bias`, thousands of stop strings, n = 10,000), or are spoiled as raw bytes
(invalid UTF-8, 1,000-deep nesting, a 5,000-digit number). gRPC messages are built with random
field values, and random or corrupted bytes are decoded the way Serve's proxy decodes them.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pagedserve.cluster.api.common import sampling_params
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.grpc.convert import request_from_proto
from pagedserve.cluster.api.grpc.wire import MalformedRequest, request_parser
from pagedserve.cluster.api.openai.models import ChatCompletionBody, CompletionBody
from pagedserve.cluster.api.openai.reading import parse_request
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
VALID = {
    CompletionBody: {"model": "m", "prompt": "hello", "max_tokens": 4},
    ChatCompletionBody: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
# Fields OpenAI or vLLM clients send that pagedserve does not serve: refused, by name.
UNSERVED = ["tools", "functions", "suffix", "extra"]
EXTREME_INTS = [0, -1, 1, 64, 65, 10_000, 2**31, 2**63, -(2**63) - 1, 2**64, 10**100]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e300, -1e300, float("nan"), float("inf")]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREME_INTS),
    st.integers(),
    st.sampled_from(EXTREME_FLOATS),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["\ud800", "\udcff", "", "x" * 10_000]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
many_stops = st.integers(0, 6000).map(lambda k: [f"s{i}" for i in range(k)])
hostile = st.one_of(values, many_stops, st.sampled_from([["x" * 5000], list(range(5000))]))


def _check_error(error: ApiError, known: set[str]) -> None:
    """A refusal of a bad request: 400 or 413, naming a field that exists (or the unknown one
    that was sent) in its message."""
    assert error.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.RESOURCE_EXHAUSTED), error
    assert error.http_status in (400, 413), error
    if error.param is None:  # a fault of the whole body (not JSON, too deep, not an object)
        assert "request body" in error.message, error
        return
    assert error.param in error.message, error
    assert re.split(r"[.\[]", error.param)[0] in known, error


def _convert(raw: bytes, model: type[BaseModel]) -> list[SamplingParams]:
    """What the HTTP front end does with a body before routing it."""
    body = parse_request(raw, model)
    if isinstance(body, CompletionBody):
        body.prompts()
        max_tokens = body.max_tokens
    else:
        max_tokens = body.max_output_tokens()
    return [sampling_params(body.sent_as(), max_tokens=max_tokens or 16, **body.sampling_kwargs())]


def _check_http(raw: bytes, model: type[BaseModel], sent: set[str]) -> None:
    try:
        params = _convert(raw, model)
    except ApiError as error:
        _check_error(error, set(model.model_fields) | sent)
    else:
        assert all(isinstance(p, SamplingParams) for p in params)


@pytest.mark.parametrize("model", [CompletionBody, ChatCompletionBody])
@FUZZ
@given(
    changes=st.lists(
        st.tuples(st.sampled_from([*CompletionBody.model_fields, "messages", *UNSERVED]), hostile),
        min_size=1,
        max_size=3,
    ),
)
def test_mutated_http_bodies_are_valid_or_name_the_field(model, changes):
    body = dict(VALID[model])
    body.update(changes)
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    _check_http(raw, model, {name for name, _ in changes})


@pytest.mark.parametrize("model", [CompletionBody, ChatCompletionBody])
@FUZZ
@given(
    spoil=st.sampled_from(
        [
            b"NaN",
            b"-Infinity",
            b"1e400",
            b"1" * 5000,
            b"-" + b"9" * 120,
            b'"\xff\xfe"',
            b'"ok\xc3"',
            b"[" * 1000 + b"]" * 1000,
            b'{"a":' * 40 + b"1" + b"}" * 40,
            b"",
            b"{",
            b'"\\ud800"',
        ]
    ),
    field=st.sampled_from(["temperature", "n", "stop", "max_tokens", "seed", "\xff", "logit_bias"]),
)
def test_spoiled_json_is_refused_by_name(model, spoil, field):
    """Raw JSON no serializer writes: each gets a 400; a bad value names its field."""
    prefix = json.dumps(VALID[model])[:-1].encode()
    key = field.encode("latin-1") if field == "\xff" else field.encode()
    raw = prefix + b', "' + key + b'": ' + spoil + b"}"
    _check_http(raw, model, {field, "\\udcff"})
    for whole in (spoil, b"[" + spoil + b"]"):
        _check_http(whole, model, set())


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"n": 10_000}, "n"),
        ({"stop": [f"s{i}" for i in range(5000)]}, "stop"),
        ({"stop": ["x" * 5000]}, "stop[0]"),
        ({"stop_token_ids": list(range(5000))}, "stop_token_ids"),
        ({"logit_bias": {"50256": -101}}, "logit_bias[50256]"),
        ({"best_of": 1000}, "best_of"),
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"temperature": 10**100}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_named_refusals(change, param):
    """The cases the issue names, each refused with its field (unknown fields are refused)."""
    raw = json.dumps({**VALID[CompletionBody], **change}).encode()
    with pytest.raises(ApiError) as raised:
        _convert(raw, CompletionBody)
    assert raised.value.param == param and param in raised.value.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "prompt": "a", "n": ' + b"1" * 5000 + b"}", "n"),
        (b'{"model": "m", "prompt": "a", "top_p": 1e400}', "top_p"),
        (b'{"model": "m", "prompt": "a", "stop": [NaN]}', "stop[0]"),
        (b'{"model": "m", "prompt": "a", "\xff": 1}', "\\udcff"),
    ],
)
def test_bad_numbers_and_keys_name_their_field(raw, param):
    with pytest.raises(ApiError) as raised:
        _convert(raw, CompletionBody)
    assert raised.value.param == param and param in raised.value.message
    json.dumps(raised.value.message, ensure_ascii=False).encode()  # printable in a response


# ------------------------------------------------------------------------------------ gRPC
GRPC_FIELDS = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} | {
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields
}
int32s = st.one_of(st.sampled_from([0, -1, 1, 64, 65, 10_000, 2**31 - 1, -(2**31)]), st.integers())
int64s = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
doubles = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats())
texts = st.one_of(st.text(max_size=12), st.sampled_from(["", "x" * 100_000]))


@st.composite
def sampling_messages(draw) -> pb.SamplingParams:
    message = pb.SamplingParams()
    for name in ("max_tokens", "top_k", "n", "min_tokens", "logprobs", "prompt_logprobs"):
        if draw(st.booleans()):
            setattr(message, name, draw(int32s.map(lambda v: (v + 2**31) % 2**32 - 2**31)))
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(message, name, draw(doubles))
    if draw(st.booleans()):
        message.repetition_penalty = draw(doubles)
    if draw(st.booleans()):
        message.seed = draw(int64s)
    message.stop.extend(draw(st.one_of(st.lists(texts, max_size=4), many_stops)))
    message.stop_token_ids.extend(draw(st.lists(int64s, max_size=4)))
    message.ignore_eos = draw(st.booleans())
    return message


@st.composite
def generate_messages(draw) -> pb.GenerateRequest:
    message = pb.GenerateRequest(sampling=draw(sampling_messages()))
    if draw(st.booleans()):
        message.prompt = draw(texts)
    message.prompt_token_ids.extend(draw(st.lists(int64s, max_size=4)))
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(["user", "assistant", "system", "", "root", "\u202e"]))
        message.messages.add(role=role, content=draw(texts))
    message.priority = draw(int32s.map(lambda v: (v + 2**31) % 2**32 - 2**31))
    message.cache_salt = draw(texts)
    message.request_id = draw(texts)
    message.timeout_s = draw(doubles)
    return message


def _check_grpc(message: pb.GenerateRequest) -> None:
    try:
        request = request_from_proto(message, tokenizer=ByteTokenizer())
    except ApiError as error:
        _check_error(error, GRPC_FIELDS)
    else:
        assert isinstance(request, GenerateRequest) and isinstance(request.params, SamplingParams)


@FUZZ
@given(message=generate_messages())
def test_random_grpc_requests_are_valid_or_name_the_field(message):
    parsed = request_parser(pb.GenerateRequest)(message.SerializeToString())
    assert parsed == message  # a well-formed message reaches the replica as it was sent
    _check_grpc(message)


def _check_wire(data: bytes) -> None:
    """Serve's proxy decodes; the replica refuses a `MalformedRequest` or converts."""
    parsed = request_parser(pb.GenerateRequest)(data)
    if isinstance(parsed, MalformedRequest):
        assert "GenerateRequest" in parsed.message or parsed.param in parsed.message
        if parsed.param is not None:
            _check_path(parsed.param)
        return
    _check_grpc(parsed)


def _check_path(path: str) -> None:
    """`sampling.stop[1]` names fields that exist, message by message."""
    descriptor = pb.GenerateRequest.DESCRIPTOR
    for part in path.split("."):
        field = descriptor.fields_by_name[part.split("[")[0]]
        descriptor = field.message_type or descriptor


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_decode_to_a_request_or_a_named_fault(data):
    _check_wire(data)


@FUZZ
@given(message=generate_messages(), edits=st.data())
def test_corrupted_messages_decode_to_a_request_or_a_named_fault(message, edits):
    data = bytearray(message.SerializeToString()[:4000])
    for _ in range(edits.draw(st.integers(1, 4))):
        if not data:
            break
        at = edits.draw(st.integers(0, len(data) - 1))
        data[at] = edits.draw(st.sampled_from([0x80, 0xFF, 0xC3, 0x00, 0x0A, 0x12, 0x7F]))
    _check_wire(bytes(data))
