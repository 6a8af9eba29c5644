"""The OpenAI-compatible HTTP front end: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Served by the `Router` deployment through Serve's HTTP proxy (a FastAPI ingress). Errors follow
the gRPC rules (see `api_errors`) as OpenAI-style JSON: `{"error": {"message", "type", "param",
"code"}}`, `code` being the gRPC status name in lower case. A streamed response checks the
request and waits for its first delta before sending the 200, so a bad request still gets its
status; a failure after that arrives as an `{"error": ...}` event before `[DONE]`. A client that
disconnects cancels the request, which frees its blocks on the worker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.api_common import (
    CompletionCollector,
    chat_prompt,
    find_malformed_text,
    merge_streams,
    new_request_id,
    sampling_params,
)
from pagedserve.cluster.api_errors import ApiError, ErrorCode, engine_failure, to_api_error
from pagedserve.cluster.auth import Caller, TokenAuth
from pagedserve.cluster.openai_logprobs import CompletionExtras, chat_logprobs, echoed_prompts
from pagedserve.cluster.openai_models import (
    ChatCompletionBody,
    ChatMessage,
    CompletionBody,
    parse_body,
)
from pagedserve.cluster.router import RouterCore
from pagedserve.cluster.router_types import GenerateRequest
from pagedserve.cluster.tracing import tag_ingress
from pagedserve.workers.outputs import Usage
from pagedserve.workers.stream import StreamDelta

logger = logging.getLogger(__name__)
OWNER = "pagedserve"
MAX_JSON_DEPTH = 32  # a request body nests 4 deep; anything far deeper is an attack


class OpenAIFrontend:
    """Serves the OpenAI routes from a `RouterCore`.

    Args:
        core: the router.
        auth: the token check (a no-op when auth is off).
        model_name: the model id clients must name.
    """

    def __init__(self, core: RouterCore, auth: TokenAuth, model_name: str) -> None:
        self.core = core
        self.auth = auth
        self.model_name = model_name
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes
    async def models(self, request: Request) -> Response:
        try:
            self.auth.check(request.headers.get("authorization"))
        except ApiError as error:
            return error_response(error)
        card = {"id": self.model_name, "object": "model", "created": self.created}
        return JSONResponse({"object": "list", "data": [{**card, "owned_by": OWNER}]})

    async def completions(self, request: Request) -> Response:
        try:
            body, caller = await self._read(request, CompletionBody)
            prompts = body.prompts()
            base_id = body.request_id or new_request_id("cmpl-")
            requests = [
                await self._request(
                    body, prompt, body.max_tokens, _batch_id(base_id, i, prompts), caller
                )
                for i, prompt in enumerate(prompts)
            ]
        except Exception as error:
            return _error_or_raise(error)
        tag_ingress(requests, request.headers.items(), "http")
        chunks = CompletionChunks(base_id, self.created, self.model_name, body.n)
        try:
            echo = echoed_prompts(prompts, self.core.tokenizer) if body.echo else None
        except Exception as error:
            return _error_or_raise(error)
        chunks.extras = CompletionExtras(echo, logprobs=body.logprobs is not None)
        return await self._respond(requests, body.stream, body.include_usage, chunks)

    async def chat_completions(self, request: Request) -> Response:
        try:
            body, caller = await self._read(request, ChatCompletionBody)
            prompt = render_chat(body.messages, self.core.tokenizer)
            base_id = body.request_id or new_request_id("chatcmpl-")
            max_tokens = body.max_output_tokens()
            requests = [await self._request(body, prompt, max_tokens, base_id, caller)]
        except Exception as error:
            return _error_or_raise(error)
        tag_ingress(requests, request.headers.items(), "http")
        chunks = ChatChunks(base_id, self.created, self.model_name, body.n)
        return await self._respond(requests, body.stream, body.include_usage, chunks)

    # -------------------------------------------------------------- plumbing
    async def _read(self, request: Request, model: type) -> tuple[Any, Caller]:
        """Auth, then the body: bounded size, JSON of bounded depth, valid text, known fields,
        the served model. Returns the body and the caller."""
        caller = self.auth.check(request.headers.get("authorization"))
        raw = await read_body(request, self.core.config.max_request_bytes)
        data = parse_json(raw)
        bad = find_malformed_text(data, "")
        if bad is not None:
            raise ApiError.invalid(f"{bad} is not valid UTF-8", bad)
        body = parse_body(model, data)
        if body.model != self.model_name:
            raise ApiError(
                ErrorCode.NOT_FOUND,
                f"model: {body.model!r} is not served here (GET /v1/models: {self.model_name!r})",
                "model",
            )
        return body, caller

    async def _request(
        self,
        body: Any,
        prompt: str | list[int],
        max_tokens: int | None,
        request_id: str,
        caller: Caller,
    ) -> GenerateRequest:
        if max_tokens is None:
            max_tokens = await self._room_for(prompt)
        return GenerateRequest(
            params=sampling_params(max_tokens=max_tokens, **body.sampling_kwargs()),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            request_id=request_id,
            priority=body.priority,
            cache_salt=body.cache_salt,
            tenant=caller.tenant,
            cache_scope=caller.cache_scope,
        )

    async def _room_for(self, prompt: str | list[int]) -> int:
        """Default max_tokens: what fits after the prompt in the smallest worker's context and
        KV pool (at least 1, so an over-long prompt gets the worker's own error)."""
        await self.core.start()
        if isinstance(prompt, str) and self.core.tokenizer is None:
            return 1  # the router refuses text without a tokenizer, naming the problem
        prompt_len = await self.core.prompt_length(prompt)
        capacities = [w.capacity_tokens() for w in self.core.workers.values() if w.alive]
        return max(1, min(capacities, default=1) - prompt_len)

    async def _respond(
        self, requests: list[GenerateRequest], stream: bool, include_usage: bool, chunks: Any
    ) -> Response:
        merged = merge_streams([self.core.generate(r) for r in requests])
        try:
            first = await anext(merged)
        except Exception as error:
            return _error_or_raise(error)
        if not stream:
            collectors = [CompletionCollector() for _ in requests]
            collectors[first[0]].add(first[1])
            try:
                async for i, delta in merged:
                    collectors[i].add(delta)
            except Exception as error:
                return _error_or_raise(error)
            return JSONResponse(chunks.whole(collectors))
        events = _sse(first, merged, chunks, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")


# ------------------------------------------------------------------- chunks
class CompletionChunks:
    """Builds `text_completion` bodies and stream chunks; choice = prompt index * n + branch."""

    object_name = "text_completion"

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        self.head = {"id": request_id, "object": self.object_name, "created": created}
        self.model = model
        self.n = n
        self.extras = CompletionExtras()  # echo and log-probabilities, when asked for

    def choice_index(self, prompt_index: int, branch: int) -> int:
        return prompt_index * self.n + branch

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, index: int, delta: StreamDelta) -> dict[str, Any]:
        text, logprobs = self.text_and_logprobs(index, delta)
        choice = {"index": index, "text": text, "logprobs": logprobs}
        return self._wrap([{**choice, "finish_reason": delta.finish_reason}])

    def text_and_logprobs(self, index: int, part: Any) -> tuple[str, dict[str, Any] | None]:
        """A delta's (or a whole completion's) text and `logprobs`, with `echo` applied."""
        return self.extras.piece(
            index, index // self.n, part.text, part.logprobs, part.prompt_logprobs
        )

    def whole(self, collectors: list[CompletionCollector]) -> dict[str, Any]:
        choices = []
        for i, collector in enumerate(collectors):
            for c in collector.completions:
                index = self.choice_index(i, c.index)
                text, logprobs = self.text_and_logprobs(index, c)
                choices.append(
                    {
                        "index": index,
                        **self.content(text),
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
        usage = Usage.total(collector.usage() for collector in collectors)
        return {**self.head, "model": self.model, "choices": choices, "usage": usage_json(usage)}

    def content(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._wrap([]), "usage": usage_json(usage)}

    def _wrap(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.head, "model": self.model, "choices": choices}


class ChatChunks(CompletionChunks):
    """Builds `chat.completion` bodies and `chat.completion.chunk` stream chunks."""

    object_name = "chat.completion"

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        super().__init__(request_id, created, model, n)
        self.chunk_head = {**self.head, "object": "chat.completion.chunk"}

    def start(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            self._wrap([{"index": j, "delta": role, "logprobs": None, "finish_reason": None}])
            for j in range(self.n)
        ]

    def chunk(self, index: int, delta: StreamDelta) -> dict[str, Any]:
        content = {"content": delta.text} if delta.text else {}
        choice = {"index": index, "delta": content, "logprobs": chat_logprobs(delta.logprobs)}
        return self._wrap([{**choice, "finish_reason": delta.finish_reason}])

    def text_and_logprobs(self, index: int, part: Any) -> tuple[str, dict[str, Any] | None]:
        return part.text, chat_logprobs(part.logprobs)

    def content(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _wrap(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.chunk_head, "model": self.model, "choices": choices}


async def _sse(
    first: tuple[int, StreamDelta],
    rest: AsyncIterator[tuple[int, StreamDelta]],
    chunks: CompletionChunks,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: the chunks, then usage if asked for, then `[DONE]`."""
    totals: dict[int, CompletionCollector] = {}  # per prompt, for the usage chunk
    extra = {"usage": None} if include_usage else {}

    def event(i: int, delta: StreamDelta) -> str:
        totals.setdefault(i, CompletionCollector(keep_output=False)).add(delta)
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return ""  # tokens whose text is not complete yet (a split UTF-8 character)
        return _data({**chunks.chunk(chunks.choice_index(i, delta.index), delta), **extra})

    for start in chunks.start():
        yield _data({**start, **extra})
    if text := event(*first):
        yield text
    try:
        async for i, delta in rest:
            if text := event(i, delta):
                yield text
            if delta.error:
                raise engine_failure(delta.error)
    except Exception as error:
        yield _data(error_json(to_api_error(error)))
    else:
        if include_usage:
            usage = Usage.total(totals[i].usage() for i in sorted(totals))
            yield _data(chunks.usage_chunk(usage))
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------ helpers
def render_chat(messages: list[ChatMessage], tokenizer: Any) -> str:
    """The prompt for a chat by the model's chat template (tiny-llama's is `<|role|>` lines,
    then `<|assistant|>`); a model without one gets INVALID_ARGUMENT."""
    return chat_prompt([{"role": m.role, "content": m.text()} for m in messages], tokenizer)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def error_json(error: ApiError) -> dict[str, Any]:
    param = "prompt" if error.param == "prompt_token_ids" else error.param
    return {
        "error": {
            "message": error.message,
            "type": error.openai_type,
            "param": param,
            "code": error.code.value.lower(),
        }
    }


def error_response(error: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHENTICATED else {}
    if retry_after := error.retry_after_header():
        headers["retry-after"] = retry_after
    return JSONResponse(error_json(error), status_code=error.http_status, headers=headers or None)


def _error_or_raise(error: Exception) -> JSONResponse:
    """The error response for any failure: a bug too becomes INTERNAL with an incident id."""
    return error_response(to_api_error(error))


def _batch_id(base: str, i: int, prompts: list) -> str:
    return base if len(prompts) == 1 else f"{base}-{i}"


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to pass `limit` bytes: from its
    `content-length` before reading, else while reading it, so a huge body costs no more
    than `limit` bytes of memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """JSON without NaN/Infinity, nested at most `MAX_JSON_DEPTH` deep (400 otherwise)."""
    try:
        # surrogateescape keeps invalid UTF-8 bytes as lone surrogates (find_malformed_text).
        data = json.loads(raw.decode("utf-8", "surrogateescape"), parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ApiError.invalid(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise _too_deep() from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    return data


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0), without recursion."""
    depth, level = 0, [value]
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]
    return depth


def _no_constant(name: str) -> Any:
    raise ApiError.invalid(f"the request body holds {name}: numbers must be finite")


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        ErrorCode.INVALID_ARGUMENT,
        f"the request body is {size:,} bytes or more; the limit is {limit:,} (max_request_bytes)",
        http_status=413,
    )


def _too_deep() -> ApiError:
    return ApiError.invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
