"""Function tools on `/v1/responses`: the Responses API's shapes for what `api.openai.tools` does on
chat completions (the same prompt, grammar and parser).

    tools: [{"type": "function", "name", "description"?, "parameters"?, "strict"?}]
    tool_choice: "auto" | "none" | "required" | {"type": "function", "name"}
    input items: {"type": "function_call", "call_id", "name", "arguments"} (an earlier call)
                 {"type": "function_call_output", "call_id", "output"} (its result)

`strict` defaults to true here, as the Responses API has it (chat completions: false).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.tools import ToolCalling, checked_tool_calling


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionToolIn(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionIn(_Body):
    type: Literal["function"]
    name: str


class FunctionCallIn(_Body):
    """An earlier response's call, sent back in `input`."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputIn(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


ToolChoiceIn = Literal["auto", "none", "required"] | NamedFunctionIn


def responses_tool_calling(
    tools: Sequence[FunctionToolIn] | None, choice: ToolChoiceIn | None, parallel: bool
) -> ToolCalling | None:
    """The request's tools, checked (INVALID_ARGUMENT naming the field at fault)."""
    functions = []
    for i, tool in enumerate(tools or ()):
        fields = tool.model_dump()
        fields["strict"] = tool.strict is not False
        functions.append((f"tools[{i}]", fields))
    named = choice.name if isinstance(choice, NamedFunctionIn) else None
    mode = "named" if isinstance(choice, NamedFunctionIn) else choice
    return checked_tool_calling(functions, mode, named, parallel, "tool_choice.name")


def call_turns(
    turns: list[dict[str, Any]], item: FunctionCallIn | FunctionCallOutputIn, i: int
) -> None:
    """Add one call item of `input` (`input[i]`) to `turns`: calls in a row are one
    assistant turn, as the model wrote them; a result is a `tool` turn."""
    if isinstance(item, FunctionCallOutputIn):
        turns.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        return
    try:
        arguments = json.loads(item.arguments)
    except json.JSONDecodeError as error:
        param = f"input[{i}].arguments"
        raise ApiError.invalid(f"{param}: not valid JSON: {error}", param) from None
    function = {"name": item.name, "arguments": arguments}
    call = {"id": item.call_id, "type": "function", "function": function}
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
