"""The Responses API's objects, as `/v1/responses` sends them (`api.openai.responses_api`): the
`Response` (whole, and as each lifecycle event carries it) and the stream's events, field for
field what the official openai client reads (`openai.types.responses`).

A stream is, in order (`ResponseEvents`; `sequence_number` counts from 0):

    response.created, response.in_progress             the Response, status in_progress
    then for each output item, in order (without tools: the one assistant message, opened at
    once; with tools: a message where the answer has text, a function_call per call):
      response.output_item.added                        the message, no content yet
      response.content_part.added                       its output_text part, empty
      response.output_text.delta ...                    the text as it is generated
      response.output_text.done, response.content_part.done, response.output_item.done
    or
      response.output_item.added                        the function_call, arguments ""
      response.function_call_arguments.delta ...        its arguments as they are generated
      response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete            the whole Response, with usage
    (response.failed: the Response with its error, after a failure mid-stream)

A Response that is not streamed is built by the same object, its events unsent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedserve.cluster.api.openai.tool_call_parser import CallDelta
from pagedserve.workers.protocol.stream import Usage

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class TextFormat(BaseModel):
    type: Literal["text"] = "text"


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponseObject(BaseModel):
    """A `Response`: what the request asked for, its status, its output and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


def new_item_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class ResponseEvents:
    """Builds one Response's output items and the stream's events for them, numbering them.

    Args:
        response: the Response as it starts (status in_progress, no output); `finish` and
            `fail` update it.
        message_at_start: open the assistant message at the start (without tools: the one
            item); else a message opens where text comes.
        new_id: item ids (`msg_...`, `fc_...`) from a prefix.
    """

    def __init__(
        self,
        response: ResponseObject,
        message_at_start: bool = True,
        new_id: Callable[[str], str] = new_item_id,
    ) -> None:
        self.response = response
        self.items: list[OutputItem] = []
        self.sequence_number = 0
        self._message_at_start = message_at_start
        self._new_id = new_id
        self._open: OutputItem | None = None
        self._text = ""  # the open message's text

    @property
    def open_item(self) -> OutputItem | None:
        """The item the next text or arguments go to."""
        return self._open

    def start(self) -> list[str]:
        events = [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]
        return events + (self._open_message() if self._message_at_start else [])

    def text(self, text: str) -> list[str]:
        """A piece of the answer's text (opening a message after a call, or first)."""
        opened = [] if isinstance(self._open, OutputMessage) else self.close_item()
        if not isinstance(self._open, OutputMessage):
            opened += self._open_message()
        self._text += text
        delta = self._event("response.output_text.delta", **self._part(), delta=text, logprobs=[])
        return [*opened, delta]

    def call(self, delta: CallDelta) -> list[str]:
        """A call's start (its item) or a piece of its arguments."""
        events = []
        if delta.id is not None:
            events += self.close_item()
            item = FunctionCallItem(
                id=self._new_id("fc_"),
                call_id=delta.id,
                name=delta.name or "",
                arguments="",
                status="in_progress",
            )
            events.append(self._add(item))
        call = self._open
        if delta.arguments and isinstance(call, FunctionCallItem):
            call.arguments += delta.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=len(self.items) - 1,
                    delta=delta.arguments,
                )
            )
        return events

    def close_item(self, status: str = "completed") -> list[str]:
        """The open item's end: its done events, and its final form in `items`."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        if isinstance(item, OutputMessage):
            part = OutputText(text=self._text)
            done: OutputItem = OutputMessage(id=item.id, status=status, content=[part])
            ids = {"item_id": item.id, "output_index": index, "content_index": 0}
            events = [
                self._event("response.output_text.done", **ids, text=part.text, logprobs=[]),
                self._event("response.content_part.done", **ids, part=part),
            ]
        else:
            done = item.model_copy(update={"status": status})
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.arguments,
                )
            ]
        self.items[index] = done
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events

    def finish(self, usage: Usage, incomplete: bool) -> list[str]:
        """The events after the answer: the open item done (a message, empty, if the answer
        had no item at all), then `response.completed` (or `response.incomplete`) with the
        whole Response."""
        status = "incomplete" if incomplete else "completed"
        events = self.close_item(status)
        if not self.items:
            events += [*self._open_message(), *self.close_item(status)]
        self.response = self.response.model_copy(
            update={
                "status": status,
                "incomplete_details": IncompleteDetails(reason="max_output_tokens")
                if incomplete
                else None,
                "output": list(self.items),
                "usage": ResponseUsage.of(usage),
            }
        )
        final = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(final, response=self.response)]

    def fail(self, code: str, message: str) -> str:
        failed = self.response.model_copy(
            update={"status": "failed", "error": ResponseError(code=code, message=message)}
        )
        return self._event("response.failed", response=failed)

    def _open_message(self) -> list[str]:
        message = OutputMessage(id=self._new_id("msg_"), status="in_progress", content=[])
        self._text = ""
        added = self._add(message)
        return [
            added,
            self._event("response.content_part.added", **self._part(), part=OutputText(text="")),
        ]

    def _add(self, item: OutputItem) -> str:
        self.items.append(item)
        self._open = item
        return self._event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item
        )

    def _part(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1, "content_index": 0}

    def _event(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            payload[name] = value.model_dump() if isinstance(value, BaseModel) else value
        self.sequence_number += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {event_type}\ndata: {data}\n\n"
