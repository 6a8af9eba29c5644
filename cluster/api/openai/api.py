"""The OpenAI-compatible HTTP front end: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Served by the `Router` deployment through Serve's HTTP proxy (a FastAPI ingress). Errors follow
the gRPC rules (see `api_errors`) as OpenAI-style JSON: `{"error": {"message", "type", "param",
"code"}}`, `code` being the gRPC status name in lower case. A streamed response checks the
request and waits for its first delta before sending the 200, so a bad request still gets its
status; a failure after that arrives as an `{"error": ...}` event before `[DONE]`. A client that
disconnects cancels the request, which frees its blocks on the worker.

Requests are parsed into `openai_models`; every answer, chunk and error is an `openai_responses`
model, built here by `CompletionChunks` / `ChatChunks` and turned into JSON at the last moment.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from collections.abc import Set as AbstractSet
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import Caller, TokenAuth
from pagedserve.cluster.api.common import (
    CompletionCollector,
    CompletionResult,
    chat_prompt,
    merge_streams,
    new_request_id,
    sampling_params,
)
from pagedserve.cluster.api.errors import ApiError, ErrorCode, engine_failure, to_api_error
from pagedserve.cluster.api.openai.logprobs import CompletionExtras, chat_logprobs, echoed_prompts
from pagedserve.cluster.api.openai.models import (
    ChatCompletionBody,
    CompletionBody,
)
from pagedserve.cluster.api.openai.reading import read_request, room_for
from pagedserve.cluster.api.openai.responses import (
    STREAM_WITHOUT_USAGE,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from pagedserve.cluster.api.openai.tool_call_parser import ToolAnswers
from pagedserve.cluster.api.sse_response import PacedStreamingResponse
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.tracing import tag_ingress
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
        tag_ingress(requests, request.headers.items(), "http")
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
        tag_ingress(requests, request.headers.items(), "http")
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


# ------------------------------------------------------------------- chunks
class _ChoiceBuilder:
    """What both response builders share: the response's id, time and model, and choice
    numbering (choice = prompt index * n + branch)."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.n = n

    def choice_index(self, prompt_index: int, branch: int) -> int:
        return prompt_index * self.n + branch

    def results(
        self, collectors: list[CompletionCollector]
    ) -> Iterator[tuple[int, CompletionResult]]:
        """Every finished branch of every prompt, with its choice index, in choice order."""
        for i, collector in enumerate(collectors):
            for result in collector.completions:
                yield self.choice_index(i, result.index), result


class CompletionChunks(_ChoiceBuilder):
    """Builds `text_completion` bodies and stream chunks."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        super().__init__(request_id, created, model, n)
        self.extras = CompletionExtras()  # echo and log-probabilities, when asked for
        self.keep_best: int | None = None  # `best_of`: the branches returned per prompt

    def start(self) -> list[CompletionChunk]:
        return []

    def chunk(self, index: int, delta: StreamDelta) -> CompletionChunk | None:
        """The chunk of one delta; None when it has nothing to send yet."""
        if _is_empty(delta):
            return None
        return self._chunk([self._choice(index, delta, delta.finish_reason)])

    def whole(self, collectors: list[CompletionCollector]) -> Completion:
        if self.keep_best is not None:
            for collector in collectors:
                collector.keep_best(self.keep_best)
        return Completion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, c, c.finish_reason) for i, c in self.results(collectors)],
            usage=UsageInfo.of(Usage.total(c.usage() for c in collectors)),
        )

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return self._chunk([], UsageInfo.of(usage))

    def _choice(
        self, index: int, part: StreamDelta | CompletionResult, finish_reason: str | None
    ) -> CompletionChoice:
        """A delta's (or a whole completion's) choice, with `echo` and `logprobs` applied."""
        text, logprobs = self.extras.piece(
            index, index // self.n, part.text, part.logprobs, part.prompt_logprobs
        )
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
        )

    def _chunk(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionChunk:
        return CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )


class ChatChunks(_ChoiceBuilder):
    """Builds `chat.completion` bodies and `chat.completion.chunk` stream chunks; with `tools`
    set, each choice's text is read for tool calls."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        super().__init__(request_id, created, model, n)
        self.tools: ToolAnswers | None = None

    def start(self) -> list[ChatCompletionChunk]:
        """One chunk per branch naming the assistant's role, before any text (as OpenAI)."""
        role = ChatDelta(role="assistant", content="")
        return [
            self._chunk([ChatChunkChoice(index=j, delta=role, logprobs=None, finish_reason=None)])
            for j in range(self.n)
        ]

    def chunk(self, index: int, delta: StreamDelta) -> ChatCompletionChunk | None:
        """The chunk of one delta; None when it has nothing to send yet."""
        content, calls, finish_reason = delta.text or None, None, delta.finish_reason
        if self.tools is not None:
            content, calls, finish_reason = self.tools.delta(index, delta.text, finish_reason)
        if not content and not calls and finish_reason is None and not delta.logprobs:
            return None
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=content, tool_calls=calls),
            logprobs=chat_logprobs(delta.logprobs),
            finish_reason=finish_reason,
        )
        return self._chunk([choice])

    def whole(self, collectors: list[CompletionCollector]) -> ChatCompletion:
        choices = [self._choice(index, c) for index, c in self.results(collectors)]
        return ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(Usage.total(c.usage() for c in collectors)),
        )

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], UsageInfo.of(usage))

    def _choice(self, index: int, result: CompletionResult) -> ChatChoice:
        message, finish_reason = AssistantMessage(content=result.text), result.finish_reason
        if self.tools is not None:
            message, finish_reason = self.tools.message(result.text, finish_reason)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(result.logprobs),
            finish_reason=finish_reason,
        )

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )


ResponseBuilder = CompletionChunks | ChatChunks


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


def _is_empty(delta: StreamDelta) -> bool:
    """A delta with nothing to send: tokens whose text is not complete yet (a split UTF-8
    character)."""
    return not delta.text and delta.finish_reason is None and not delta.logprobs


def _batch_id(base: str, i: int, prompts: list) -> str:
    return base if len(prompts) == 1 else f"{base}-{i}"


def _data(payload: BaseModel, exclude: AbstractSet[str] | None = None) -> str:
    """One server-sent event. `json.dumps` of `model_dump()`, not `model_dump_json()`: its
    `", "` separators and float spelling are what clients have always been sent."""
    return f"data: {json.dumps(payload.model_dump(exclude=exclude), ensure_ascii=False)}\n\n"
