"""The bytes on the wire of the OpenAI front end, pinned: the response models
(`api.openai.responses`) must send exactly what the dict-built bodies before them sent (the
whole-body JSON compact, server-sent events with `", "` separators, explicit nulls, a stream's
`"usage": null` only with `include_usage`)."""

from __future__ import annotations

import asyncio

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.config import AuthConfig
from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.api import OpenAIFrontend
from pagedserve.cluster.api.openai.chunks import ChatChunks, CompletionChunks
from pagedserve.cluster.api.openai.logprobs import CompletionExtras, echoed_prompts
from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.protocol.stream import (
    FinishReason,
    StreamDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    text = ByteTokenizer().token_text
    alternatives = tuple(TopLogprob(t, v, text(t)) for t, v in top)
    return TokenLogprob(token_id, logprob, 1, text(token_id), alternatives)


class FakeCore:
    """Streams fixed deltas for any request, then raises `error` if given."""

    def __init__(self, deltas: list[StreamDelta], error: Exception | None = None) -> None:
        self.deltas, self.error = deltas, error

    def generate(self, request):
        async def stream():
            for delta in self.deltas:
                yield delta
            if self.error is not None:
                raise self.error

        return stream()


def respond(deltas, chunks, stream: bool, include_usage: bool, error=None) -> str:
    """The response body the front end sends for one request streaming `deltas`."""
    front = OpenAIFrontend(FakeCore(deltas, error), TokenAuth.from_config(AuthConfig()), "m")

    async def run() -> str:
        response = await front._respond(["r1"], stream, include_usage, chunks)
        if not stream:
            return response.body.decode()
        return "".join([part async for part in response.body_iterator])

    return asyncio.run(run())


def cmpl() -> tuple[list[StreamDelta], CompletionChunks]:
    """`echo` + `logprobs: 2` on the prompt "hi"; "é" arrives as two byte tokens."""
    chunks = CompletionChunks("cmpl-1", 7, "m", n=1)
    chunks.extras = CompletionExtras(echoed_prompts(["hi"], ByteTokenizer()), logprobs=True)
    first = StreamDelta(
        "r1", 0, [195], "", logprobs=[lp(195, -0.1, (195, -0.1), (65, -2.5))],
        prompt_logprobs=[None, lp(105, -2.0, (101, -1.0))],
    )  # fmt: skip
    last = StreamDelta(
        "r1", 0, [169], "é", FinishReason.LENGTH, usage=Usage(2, 2, 1), logprobs=[lp(169, -1e-05)]
    )
    return [first, last], chunks


def chat() -> tuple[list[StreamDelta], ChatChunks]:
    first = StreamDelta("r1", 0, [65], "A", logprobs=[lp(65, -0.5, (65, -0.5))])
    last = StreamDelta("r1", 0, [], "", FinishReason.STOP, usage=Usage(3, 1, 0), logprobs=[])
    return [first, last], ChatChunks("chatcmpl-1", 7, "m", n=1)


def test_completion_body_with_echo_and_logprobs():
    assert respond(*cmpl(), False, False) == (
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":'
        '0,"text":"hié","logprobs":{"tokens":["h","i","�","�"],"token_logprobs":[null,'
        '-2.0,-0.1,-1e-05],"top_logprobs":[null,{"e":-1.0},{"�":-0.1,"A":-2.5},{}],'
        '"text_offset":[0,1,2,3]},"finish_reason":"length"}],"usage":{"prompt_tokens":2,'
        '"completion_tokens":2,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":1}}}'
    )


def test_completion_stream_with_usage():
    assert respond(*cmpl(), True, True) == (
        'data: {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": '
        '"m", "choices": [{"index": 0, "text": "hi", "logprobs": {"tokens": ["h",'
        ' "i", "�"], "token_logprobs": [null, -2.0, -0.1], "top_logprobs": [null,'
        ' {"e": -1.0}, {"�": -0.1, "A": -2.5}], "text_offset": [0, 1, 2]}, "finish_reason": '
        'null}], "usage": null}\n\n'
        'data: {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": '
        '"m", "choices": [{"index": 0, "text": "é", "logprobs": {"tokens": ["�"],'
        ' "token_logprobs": [-1e-05], "top_logprobs": [{}], "text_offset": [2]}, '
        '"finish_reason": "length"}], "usage": null}\n\n'
        'data: {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": '
        '"m", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,'
        ' "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 1}}}\n\n'
        "data: [DONE]\n\n"
    )


def test_chat_body():
    assert respond(*chat(), False, False) == (
        '{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m","choices":[{"ind'
        'ex":0,"message":{"role":"assistant","content":"A"},"logprobs":{"content":[{"token":"A"'
        ',"logprob":-0.5,"bytes":[65],"top_logprobs":[{"token":"A","logprob":-0.5,'
        '"bytes":[65]}]}]},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_toke'
        'ns":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}'
    )


def test_chat_stream_without_usage():
    assert respond(*chat(), True, False) == (
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": '
        '7, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",'
        ' "content": ""}, "logprobs": null, "finish_reason": null}]}\n\n'
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": '
        '7, "model": "m", "choices": [{"index": 0, "delta": {"content": "A"}, "logprobs": '
        '{"content": [{"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": '
        '[{"token": "A", "logprob": -0.5, "bytes": [65]}]}]}, "finish_reason": null}]}\n\n'
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": '
        '7, "model": "m", "choices": [{"index": 0, "delta": {}, "logprobs": {"content": '
        '[]}, "finish_reason": "stop"}]}\n\n'
        "data: [DONE]\n\n"
    )


def test_chat_stream_error_event():
    deltas, chunks = chat()
    error = ApiError.invalid("n: bad", "n")
    assert respond(deltas[:1], chunks, True, True, error) == (
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": '
        '7, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",'
        ' "content": ""}, "logprobs": null, "finish_reason": null}], "usage": null}\n\n'
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": '
        '7, "model": "m", "choices": [{"index": 0, "delta": {"content": "A"}, "logprobs": '
        '{"content": [{"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": '
        '[{"token": "A", "logprob": -0.5, "bytes": [65]}]}]}, "finish_reason": null}],'
        ' "usage": null}\n\n'
        'data: {"error": {"message": "n: bad", "type": "invalid_request_error", "param": '
        '"n", "code": "invalid_argument"}}\n\n'
        "data: [DONE]\n\n"
    )
