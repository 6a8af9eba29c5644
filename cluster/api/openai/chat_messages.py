"""What a chat request carries besides its sampling fields: its messages (turns, parts, earlier
tool calls sent back) and the tools it declares, as the OpenAI-compatible bodies take them
(`api.openai.models.ChatCompletionBody`, the Responses API's input), and the strict base every
request body model shares.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.api.errors import ApiError


class StrictBody(BaseModel):
    """A request body's part: strictly typed, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class CalledFunction(StrictBody):
    name: str
    arguments: str  # the arguments object as JSON text, as the call was answered


class ToolCallIn(StrictBody):
    """An earlier answer's call, sent back in an assistant turn."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictBody):
    """One turn. Its `content` is required but beside an assistant's `tool_calls` (left out or
    null: a 400 naming it); a `tool` turn answers the call `tool_call_id` names."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())

    def turn(self, i: int) -> dict[str, Any]:
        """The turn as chat templates take it (a call's arguments as an object)."""
        if self.content is None and not self.tool_calls:
            param = f"messages[{i}].content"
            raise ApiError.invalid(
                f"{param}: field required (role {self.role!r} needs content)", param
            )
        turn: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                param = f"messages[{i}].tool_calls"
                raise ApiError.invalid(f"{param}: only an assistant turn has tool calls", param)
            turn["tool_calls"] = [
                _call_turn(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


def _call_turn(call: ToolCallIn, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as error:
        param = f"{param}.function.arguments"
        raise ApiError.invalid(f"{param}: not valid JSON: {error}", param) from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction
