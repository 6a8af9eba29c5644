"""The Responses API's objects, as `/v1/responses` sends them (`openai_responses_api`): the
`Response` (whole, and as each lifecycle event carries it) and the stream's events, field for
field what the official openai client reads (`openai.types.responses`).

A stream is, in order (`ResponseEvents`; `sequence_number` counts from 0):

    response.created, response.in_progress             the Response, status in_progress
    response.output_item.added                          the assistant message, no content yet
    response.content_part.added                         its output_text part, empty
    response.output_text.delta ...                      the text as it is generated
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete            the whole Response, with usage
    (response.failed: the Response with its error, after a failure mid-stream)
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedserve.workers.outputs import Usage

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
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = False
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["auto", "none"] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def message(self) -> OutputMessage:
        return self.output[0]


class ResponseEvents:
    """Builds one stream's server-sent events, numbering them.

    Args:
        response: the Response as it starts (status in_progress, no output); `finish` and
            `fail` update it.
        message_id: the id of its one assistant message.
    """

    def __init__(self, response: ResponseObject, message_id: str) -> None:
        self.response = response
        self.message_id = message_id
        self.sequence_number = 0

    def start(self) -> list[str]:
        empty = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
            self._event("response.output_item.added", output_index=0, item=empty),
            self._event("response.content_part.added", **self._part(), part=OutputText(text="")),
        ]

    def delta(self, text: str) -> str:
        return self._event("response.output_text.delta", **self._part(), delta=text, logprobs=[])

    def finish(self, done: ResponseObject) -> list[str]:
        """The events after the last delta: the text, the part and the message done, then
        `response.completed` (or `response.incomplete`) with the whole Response."""
        self.response = done
        message = done.message
        (part,) = message.content
        final = "response.completed" if done.status == "completed" else "response.incomplete"
        return [
            self._event("response.output_text.done", **self._part(), text=part.text, logprobs=[]),
            self._event("response.content_part.done", **self._part(), part=part),
            self._event("response.output_item.done", output_index=0, item=message),
            self._event(final, response=done),
        ]

    def fail(self, code: str, message: str) -> str:
        failed = self.response.model_copy(
            update={"status": "failed", "error": ResponseError(code=code, message=message)}
        )
        return self._event("response.failed", response=failed)

    def _part(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _event(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            payload[name] = value.model_dump() if isinstance(value, BaseModel) else value
        self.sequence_number += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {event_type}\ndata: {data}\n\n"
