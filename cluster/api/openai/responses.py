"""Response bodies of the OpenAI-compatible HTTP API: what `api.openai.api` sends.

The request bodies are in `api.openai.models`; these are their answers, field for field what the
OpenAI clients read (vLLM's `entrypoints/openai/protocol.py` declares the same shapes):

    POST /v1/completions       → Completion       (stream: CompletionChunk events)
    POST /v1/chat/completions  → ChatCompletion   (stream: ChatCompletionChunk events)
    GET  /v1/models            → ModelList
    any failure                → ErrorResponse    (stream: one ErrorResponse event)

Fields are declared in the order they go on the wire, and a field that is null today is a
declared `None`, not a missing key (`"logprobs": null`, `"finish_reason": null`). The two
exceptions are written down where they are: a chat `delta` carries only the keys it has
(`ChatDelta`), and a stream chunk has `"usage": null` only when the client asked for usage
(`STREAM_WITHOUT_USAGE`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from pagedserve.workers.protocol.stream import Usage


class _Response(BaseModel):
    """A body we build ourselves: validated on construction (so a wrong type fails here, in
    the test that builds it), serialised with `model_dump()` then `json.dumps`."""


# -------------------------------------------------------------------- usage
class PromptTokensDetails(_Response):
    cached_tokens: int


class UsageInfo(_Response):
    """Token counts of a request (every prompt and branch of it)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


# ---------------------------------------------------------- log-probabilities
class CompletionLogprobs(_Response):
    """The legacy completions `logprobs`: parallel lists, one entry per token; a token without
    a log-probability (an echoed prompt's first) is null in `token_logprobs` and
    `top_logprobs`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # token text → log-probability
    text_offset: list[int]  # where each token starts in the choice's text


class ChatLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]  # the UTF-8 of `token`, as vLLM fills it


class ChatLogprobEntry(ChatLogprob):
    """One generated token and its most likely alternatives."""

    top_logprobs: list[ChatLogprob]


class ChatLogprobs(_Response):
    content: list[ChatLogprobEntry]


# -------------------------------------------------------------- completions
class CompletionChoice(_Response):
    """A whole choice, or a stream chunk's piece of one (the same four fields)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Response):
    """A stream event; `usage` is set on the last one only (with `include_usage`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------- chat
class _OnlySet(_Response):
    """Serialised with only the keys that are set (not None), as OpenAI sends stream deltas."""

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class CalledFunction(_Response):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_Response):
    """The answer of a chat completion (the request's messages are
    `api.openai.chat_messages.ChatMessage`): `content` is null when the answer is only tool
    calls; `tool_calls` is left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_if_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if body["tool_calls"] is None:
            del body["tool_calls"]
        return body


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionDelta(_OnlySet):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_OnlySet):
    """A call's first delta has its `id`, `type` and `function.name` (and `arguments: ""`);
    later ones add to `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_OnlySet):
    """What a chat chunk adds to its message: only the keys it has, as OpenAI sends them
    (`{"role": "assistant", "content": ""}` first, then `{"content": "..."}` or
    `{"tool_calls": [...]}`, the last chunk often `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Response):
    """A stream event; `usage` is set on the last one only (with `include_usage`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# A stream chunk without `include_usage` has no `usage` key at all (with it: null until the
# last): `chunk.model_dump(exclude=STREAM_WITHOUT_USAGE)`.
STREAM_WITHOUT_USAGE = frozenset({"usage"})


# ------------------------------------------------------------ models, errors
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str  # OpenAI's error type: invalid_request_error, rate_limit_error, ...
    param: str | None  # the request field at fault
    code: str  # the gRPC status name in lower case (see `api.errors`)


class ErrorResponse(_Response):
    error: ErrorInfo
