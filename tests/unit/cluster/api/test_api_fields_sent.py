"""The API's small inconsistencies an outside run found (issue 45), on both front ends' request
conversion: an error names the field the client sent, a chat message needs its `content`, and
a seed is in [0, 2**64). Through the running proxies: tests/integration/test_serve_process.py.
"""

from __future__ import annotations

import pytest

from pagedserve.cluster.api.common import sampling_params
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.grpc.convert import request_from_proto
from pagedserve.cluster.api.openai.models import ChatCompletionBody, CompletionBody, parse_body
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.model.tokenizer import ByteTokenizer

MODEL = {"model": "tiny-llama"}
USER = {"role": "user", "content": "hi"}


def http_params(model: type, data: dict, max_tokens: int = 4):
    """What `OpenAIFrontend` does with a body before routing it: parse it, build its params
    (and, for a chat, its turns)."""
    body = parse_body(model, data)
    if isinstance(body, ChatCompletionBody):
        body.turns()
        if body.max_output_tokens() is not None:
            max_tokens = body.max_output_tokens()
    return sampling_params(body.sent_as(), max_tokens=max_tokens, **body.sampling_kwargs())


def http_error(model: type, data: dict) -> ApiError:
    with pytest.raises(ApiError) as raised:
        http_params(model, data)
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT and raised.value.http_status == 400
    return raised.value


def grpc_error(message: pb.GenerateRequest) -> ApiError:
    with pytest.raises(ApiError) as raised:
        request_from_proto(message, tokenizer=ByteTokenizer())
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT
    return raised.value


# ------------------------------------------------------ the field the client sent
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_a_chat_error_names_the_field_the_client_sent(fields, param):
    error = http_error(ChatCompletionBody, {**MODEL, "messages": [USER], **fields})
    assert error.param == param and error.message.startswith(f"{param} must"), error.message


def test_completions_logprobs_keep_their_own_name():
    error = http_error(CompletionBody, {**MODEL, "prompt": "a", "logprobs": 21, "echo": True})
    assert error.param == "logprobs"


# ------------------------------------------------------------ content is required
@pytest.mark.parametrize("role", ["system", "user", "assistant", "developer", "tool"])
@pytest.mark.parametrize("content", ["missing", None])
def test_a_chat_message_without_content_is_a_400(role, content):
    message = {"role": role} if content == "missing" else {"role": role, "content": content}
    error = http_error(ChatCompletionBody, {**MODEL, "messages": [USER, message]})
    assert error.param == "messages[1].content", error.message
    grpc = pb.GenerateRequest(messages=[pb.ChatMessage(**USER), pb.ChatMessage(role=role)])
    assert grpc_error(grpc).param == "messages[1].content"


def test_empty_content_is_content():
    http_params(ChatCompletionBody, {**MODEL, "messages": [{"role": "user", "content": ""}]})
    http_params(ChatCompletionBody, {**MODEL, "messages": [{"role": "user", "content": []}]})
    message = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="")])
    assert request_from_proto(message, tokenizer=ByteTokenizer()).prompt.startswith("<|user|>")


# --------------------------------------------------------------------- seeds
@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
@pytest.mark.parametrize("model", [CompletionBody, ChatCompletionBody])
def test_an_http_seed_outside_the_generator_range_is_a_400(model, seed):
    data = {**MODEL, "prompt": "a"} if model is CompletionBody else {**MODEL, "messages": [USER]}
    error = http_error(model, {**data, "seed": seed})
    assert error.param == "seed" and "[0, 2**64)" in error.message


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_seeds_at_the_ends_of_the_range_are_served(seed):
    assert http_params(CompletionBody, {**MODEL, "prompt": "a", "seed": seed}).seed == seed
    message = pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(seed=min(seed, 2**63 - 1)))
    assert request_from_proto(message).params.seed == min(seed, 2**63 - 1)


def test_a_negative_grpc_seed_is_invalid_argument():
    error = grpc_error(pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(seed=-1)))
    assert error.param == "seed" and "[0, 2**64)" in error.message
