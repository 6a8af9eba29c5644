"""The OpenAI-compatible HTTP front end: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Served by the `Router` deployment through Serve's HTTP proxy (a FastAPI ingress). Errors follow
the gRPC rules (see `api_errors`) as OpenAI-style JSON: `{"error": {"message", "type", "param",
"code"}}`, `code` being the gRPC status name in lower case. A streamed response checks the
request and waits for its first delta before sending the 200, so a bad request still gets its
status; a failure after that arrives as an `{"error": ...}` event before `[DONE]`. A client that
disconnects cancels the request, which frees its blocks on the worker.

Requests are parsed into `api.openai.models`; every answer, chunk and error is an
`api.openai.responses` model, built by `CompletionChunks` / `ChatChunks` (`api.openai.chunks`)
and turned into JSON here, at the last moment.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from collections.abc import Set as AbstractSet
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import Caller, TokenAuth
from pagedserve.cluster.api.common import (
    chat_prompt,
    merge_streams,
    new_request_id,
    sampling_params,
)
from pagedserve.cluster.api.errors import ApiError, ErrorCode, engine_failure, to_api_error
from pagedserve.cluster.api.openai.chunks import ChatChunks, CompletionChunks, ResponseBuilder
from pagedserve.cluster.api.openai.logprobs import CompletionExtras, echoed_prompts
from pagedserve.cluster.api.openai.models import (
    ChatCompletionBody,
    CompletionBody,
)
from pagedserve.cluster.api.openai.reading import read_request, room_for
from pagedserve.cluster.api.openai.responses import (
    STREAM_WITHOUT_USAGE,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from pagedserve.cluster.api.openai.tool_call_parser import ToolAnswers
from pagedserve.cluster.api.sse_response import PacedStreamingResponse
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.tracing import tag_ingress
from pagedserve.workers.engine.outputs import CompletionCollector
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.stream import StreamDelta, Usage

logger = logging.getLogger(__name__)
OWNER = "pagedserve"


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
        cards = [ModelCard(id=self.model_name, created=self.created, owned_by=OWNER)]
        try:
            adapters = await self.core.served_loras()
        except Exception as error:
            return _error_or_raise(error)
        cards += [
            ModelCard(id=name, created=self.created, owned_by=OWNER, parent=self.model_name)
            for name in sorted(adapters)
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

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
        requests = tag_ingress(requests, request.headers.items(), "http")
        chunks = CompletionChunks(base_id, self.created, body.model or self.model_name, body.n)
        try:
            echo = echoed_prompts(prompts, self.core.tokenizer) if body.echo else None
        except Exception as error:
            return _error_or_raise(error)
        chunks.extras = CompletionExtras(echo, logprobs=body.logprobs is not None)
        chunks.keep_best = body.n if body.picks_best else None
        return await self._respond(requests, body.stream, body.include_usage, chunks)

    async def chat_completions(self, request: Request) -> Response:
        try:
            body, caller = await self._read(request, ChatCompletionBody)
            tools = body.tool_calling
            prompt = chat_prompt(body.turns(), self.core.tokenizer, tools=tools)
            base_id = body.request_id or new_request_id("chatcmpl-")
            max_tokens = body.max_output_tokens()
            requests = [await self._request(body, prompt, max_tokens, base_id, caller)]
        except Exception as error:
            return _error_or_raise(error)
        requests = tag_ingress(requests, request.headers.items(), "http")
        chunks = ChatChunks(base_id, self.created, body.model or self.model_name, body.n)
        if tools is not None and tools.parses_calls:
            chunks.tools = ToolAnswers()
        return await self._respond(requests, body.stream, body.include_usage, chunks)

    # -------------------------------------------------------------- plumbing
    async def _read(self, request: Request, model: type) -> tuple[Any, Caller]:
        """Auth, then the body (`openai_reading.read_request`). Returns the body and caller."""
        max_bytes = self.core.config.limits.max_request_bytes
        served = self.core.served_loras
        return await read_request(request, self.auth, max_bytes, model, self.model_name, served)

    async def _request(
        self,
        body: Any,
        prompt: str | list[int],
        max_tokens: int | None,
        request_id: str,
        caller: Caller,
    ) -> GenerateRequest:
        if max_tokens is None:
            max_tokens = await room_for(self.core, prompt)
        return GenerateRequest(
            params=sampling_params(body.sent_as(), max_tokens=max_tokens, **body.sampling_kwargs()),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            request_id=request_id,
            priority=body.priority,
            cache_salt=body.cache_salt,
            tenant=caller.tenant,
            cache_scope=caller.cache_scope,
            lora=None if body.model in (None, self.model_name) else body.model,
        )

    async def _respond(
        self,
        requests: list[GenerateRequest],
        stream: bool,
        include_usage: bool,
        chunks: ResponseBuilder,
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
                async with aclosing(merged):
                    async for i, delta in merged:
                        collectors[i].add(delta)
            except Exception as error:
                return _error_or_raise(error)
            return JSONResponse(chunks.whole(collectors).model_dump())
        events = _sse(first, merged, chunks, include_usage)
        return PacedStreamingResponse(events)


async def _sse(
    first: tuple[int, StreamDelta],
    rest: AsyncGenerator[tuple[int, StreamDelta], None],
    chunks: ResponseBuilder,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: the chunks, then usage if asked for, then `[DONE]`. Closing them
    (`PacedStreamingResponse`, once the client is gone) closes `rest`: its requests are
    aborted on their workers now."""
    totals: dict[int, CompletionCollector] = {}  # per prompt, for the usage chunk
    exclude = None if include_usage else STREAM_WITHOUT_USAGE

    def event(i: int, delta: StreamDelta) -> str:
        totals.setdefault(i, CompletionCollector(keep_output=False)).add(delta)
        chunk = chunks.chunk(chunks.choice_index(i, delta.index), delta)
        return "" if chunk is None else _data(chunk, exclude)

    async with aclosing(rest):
        for start in chunks.start():
            yield _data(start, exclude)
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
def error_json(error: ApiError) -> ErrorResponse:
    param = "prompt" if error.param == "prompt_token_ids" else error.param
    info = ErrorInfo(
        message=error.message, type=error.openai_type, param=param, code=error.code.value.lower()
    )
    return ErrorResponse(error=info)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.code is ErrorCode.UNAUTHENTICATED else {}
    if retry_after := error.retry_after_header():
        headers["retry-after"] = retry_after
    body = error_json(error).model_dump()
    return JSONResponse(body, status_code=error.http_status, headers=headers or None)


def _error_or_raise(error: Exception) -> JSONResponse:
    """The error response for any failure: a bug too becomes INTERNAL with an incident id."""
    return error_response(to_api_error(error))


def _batch_id(base: str, i: int, prompts: list) -> str:
    return base if len(prompts) == 1 else f"{base}-{i}"


def _data(payload: BaseModel, exclude: AbstractSet[str] | None = None) -> str:
    """One server-sent event. `json.dumps` of `model_dump()`, not `model_dump_json()`: its
    `", "` separators and float spelling are what clients have always been sent."""
    return f"data: {json.dumps(payload.model_dump(exclude=exclude), ensure_ascii=False)}\n\n"
