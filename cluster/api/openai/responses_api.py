"""`POST /v1/responses`: the OpenAI Responses API, stateless, over the chat path.

    {"model", "input": TEXT | [messages], "instructions"?, "max_output_tokens"?, "temperature"?,
     "top_p"?, "stream"?, "store"?: false}
      → a Response (`api.openai.responses_objects`): `output[0]` the assistant message, its
        `content[0].text` the answer, `usage` {input_tokens, output_tokens, total_tokens, ...}

`input` is a text (one user turn) or a list of messages (`role` user, assistant, system or
developer; `content` a text or `input_text` / `output_text` parts); `instructions` goes first
as a system turn. The turns are rendered by the model's chat template, as
`/v1/chat/completions` renders them, and the request runs through the router as any
generation. Status: `completed` when the model stopped, `incomplete` (`incomplete_details:
{"reason": "max_output_tokens"}`) when the output budget ran out.

Stateless: nothing is stored, so `store` is false. It may be left out (the response says
`"store": false`; OpenAI's own default is true, but a client leaving it out does not rely on
a stored response), and `store: true` is a 400 naming `store`, as is `previous_response_id`
(it needs stored responses). Function `tools` are served as on chat completions
(`api.openai.responses_tools`): calls come out as `function_call` items; `text` takes only the
plain text format. vLLM's extra sampling fields (`top_k`, `seed`, `stop`, ...)
and the cluster's (`priority`, `cache_salt`, `request_id`) are accepted as in completions.

A streamed response checks the request and waits for its first delta before the 200, so a bad
request still gets its status; the events are those the official client's
`responses.stream(...)` folds into its final Response (see `ResponseEvents`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import Caller, TokenAuth
from pagedserve.cluster.api.common import (
    chat_prompt,
    new_request_id,
    sampling_params,
)
from pagedserve.cluster.api.errors import ApiError, engine_failure, to_api_error
from pagedserve.cluster.api.guided import guided_spec
from pagedserve.cluster.api.openai.api import error_response
from pagedserve.cluster.api.openai.reading import read_request, room_for
from pagedserve.cluster.api.openai.responses_objects import (
    FunctionCallItem,
    ResponseEvents,
    ResponseObject,
)
from pagedserve.cluster.api.openai.responses_tools import (
    FunctionCallIn,
    FunctionCallOutputIn,
    FunctionToolIn,
    ToolChoiceIn,
    call_turns,
    responses_tool_calling,
)
from pagedserve.cluster.api.openai.tool_call_parser import ToolCallParser
from pagedserve.cluster.api.openai.tools import ToolCalling
from pagedserve.cluster.api.sse_response import PacedStreamingResponse
from pagedserve.cluster.router.route import check_prompt_size
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.tracing import tag_ingress
from pagedserve.workers.engine.outputs import CompletionCollector
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingKwargs
from pagedserve.workers.protocol.stream import FinishReason, StreamDelta


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier response's output sent back
    logprobs: list[Any] | None = None


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None  # an earlier response's output message sent back
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormatIn(_Body):
    type: Literal["text"]


class TextConfigIn(_Body):
    format: TextFormatIn


class ResponsesBody(_Body):
    """`POST /v1/responses`."""

    model: str
    input: str | list[InputMessage | FunctionCallIn | FunctionCallOutputIn] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[FunctionToolIn] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfigIn | None = None
    truncation: Literal["disabled"] | None = None
    # vLLM-style extras
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # cluster extras
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None

    @cached_property
    def tool_calling(self) -> ToolCalling | None:
        return responses_tool_calling(
            self.tools, self.tool_choice, self.parallel_tool_calls is not False
        )

    def turns(self) -> list[dict[str, Any]]:
        """The chat: `instructions` as a system turn, then `input`; INVALID_ARGUMENT naming
        what a stateless server cannot do."""
        if self.store:
            raise ApiError.invalid(
                "store: stored responses are not supported here; send store: false or leave "
                "it out (this server is stateless)",
                "store",
            )
        if self.previous_response_id is not None:
            raise ApiError.invalid(
                "previous_response_id: needs stored responses, which this server does not "
                "keep; send the earlier turns in input",
                "previous_response_id",
            )
        turns: list[dict[str, Any]] = []
        if self.instructions is not None:
            turns.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            turns.append({"role": "user", "content": self.input})
            return turns
        for i, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                turns.append({"role": item.role, "content": item.text()})
            else:
                call_turns(turns, item, i)
        return turns

    def sampling_kwargs(self) -> SamplingKwargs:
        kwargs = SamplingKwargs(
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        spec = self.tool_calling.grammar() if self.tool_calling else None
        if spec is not None:
            kwargs["guided"] = guided_spec({"tools": (spec.kind, spec.value, True)})
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(self, name)) is not None:
                kwargs[name] = value
        return kwargs


class ResponsesFrontend:
    """Serves `/v1/responses` through the router.

    Args:
        core: the router.
        auth: the token check (a no-op when auth is off).
        model_name: the served model's id.
    """

    def __init__(self, core: RouterCore, auth: TokenAuth, model_name: str) -> None:
        self.core = core
        self.auth = auth
        self.model_name = model_name

    async def responses(self, request: Request) -> Response:
        try:
            max_bytes = self.core.config.limits.max_request_bytes
            body, caller = await read_request(
                request, self.auth, max_bytes, ResponsesBody, self.model_name
            )
            generate = await self._request(body, caller)
            (generate,) = tag_ingress([generate], request.headers.items(), "http")
            stream = self.core.generate(generate)
            first = await anext(stream)  # a refused request gets its status, not a 200
        except Exception as error:
            return error_response(to_api_error(error))
        tools = body.tool_calling
        reader = AnswerReader(tools is not None and tools.parses_calls)
        events = ResponseEvents(self._start(body, generate.request_id), not reader.parser)
        if body.stream:
            return PacedStreamingResponse(_sse(events, reader, first, stream))
        collector = CompletionCollector()
        collector.add(first)
        try:
            async with aclosing(stream):
                async for delta in stream:
                    collector.add(delta)
                    if delta.error:
                        raise engine_failure(delta.error)
        except Exception as error:
            return error_response(to_api_error(error))
        (result,) = collector.completions
        events.start()
        reader.read(events, result.text, last=True)
        events.finish(collector.usage(), incomplete=result.finish_reason is FinishReason.LENGTH)
        return JSONResponse(events.response.model_dump())

    async def _request(self, body: ResponsesBody, caller: Caller) -> GenerateRequest:
        turns = body.turns()
        check_prompt_size(
            sum(len(t["content"]) for t in turns), self.core.config.limits.max_prompt_chars
        )
        prompt = await asyncio.to_thread(
            chat_prompt, turns, self.core.tokenizer, tools=body.tool_calling
        )
        max_tokens = body.max_output_tokens
        if max_tokens is None:
            max_tokens = await room_for(self.core, prompt)
        params = sampling_params(
            {"max_tokens": "max_output_tokens"}, max_tokens=max_tokens, **body.sampling_kwargs()
        )
        return GenerateRequest(
            params=params,
            prompt=prompt,
            request_id=body.request_id or new_request_id("resp_"),
            priority=body.priority,
            cache_salt=body.cache_salt,
            tenant=caller.tenant,
            cache_scope=caller.cache_scope,
        )

    def _start(self, body: ResponsesBody, response_id: str) -> ResponseObject:
        """The Response as it starts: what the request asked for, status in_progress."""
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model_name,
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            tool_choice=_echoed(body.tool_choice) or "auto",
            tools=[tool.model_dump() for tool in body.tools or ()],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            user=body.user,
            metadata=body.metadata or {},
        )


class AnswerReader:
    """Feeds the answer's text to `ResponseEvents`: as text, or (with tools) read for calls."""

    def __init__(self, reads_calls: bool) -> None:
        self.parser = ToolCallParser() if reads_calls else None

    def read(self, events: ResponseEvents, text: str, last: bool) -> list[str]:
        """The events of the next piece of text (`last`: the answer ends with it)."""
        if self.parser is None:
            return events.text(text) if text else []
        parsed = self.parser.feed(text, last)
        sent = events.text(parsed.content) if parsed.content else []
        for call in parsed.calls:
            sent += events.call(call)
        calls = self.parser.calls
        if calls and calls[-1].complete and isinstance(events.open_item, FunctionCallItem):
            sent += events.close_item()
        return sent


def _echoed(choice: Any) -> Any:
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


async def _sse(
    events: ResponseEvents,
    reader: AnswerReader,
    first: StreamDelta,
    rest: AsyncGenerator[StreamDelta, None],
) -> AsyncIterator[str]:
    """The stream's events: the start, a delta per piece of text, then the end (or
    `response.failed` after a failure). Closing them (`PacedStreamingResponse`, once the
    client is gone) closes `rest`, which aborts the request on its worker now."""
    collector = CompletionCollector()
    async with aclosing(rest):
        for event in events.start():
            yield event
        try:
            async for delta in _chained(first, rest):
                collector.add(delta)
                for event in reader.read(events, delta.text, delta.finish_reason is not None):
                    yield event
                if delta.error:
                    raise engine_failure(delta.error)
        except Exception as error:
            failure = to_api_error(error)
            yield events.fail(failure.code.value.lower(), failure.message)
            return
    (result,) = collector.completions
    for event in events.finish(
        collector.usage(), incomplete=result.finish_reason is FinishReason.LENGTH
    ):
        yield event


async def _chained(first: StreamDelta, rest: AsyncIterator[StreamDelta]) -> AsyncIterator:
    yield first
    async for delta in rest:
        yield delta
