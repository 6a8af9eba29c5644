"""Tool calling on `/v1/chat/completions`: what a request's `tools` and `tool_choice` become.

One format for every model, the Hermes one Qwen2.5 and Hermes templates use, so that a call
written under the grammar is what the parser reads and what a tool-aware template renders back:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- **The prompt**: a chat template that takes `tools` (it mentions them) renders them itself;
  for any other template (SmolLM2's) the tools go into the system turn as that format asks,
  an assistant's earlier calls are written back in it and a tool's result becomes a
  `<tool_response>` turn of the user (`tool_chat_turns`).
- **The grammar** (xgrammar's structural tag, built by `ToolCalling.grammar`): each call's
  `arguments` must match its function's `parameters` schema, so a call always parses.
  `required` allows calls only (at least one), a named choice exactly one call of that
  function, `auto` free text in which a call may start at `<tool_call>`; without
  `parallel_tool_calls` at most one call. `none` renders the tools and constrains nothing.
- **The answer**: `tool_call_parser.ToolCallParser` splits the text, as it streams, into content
  and calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.guided import guided_spec
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec

CALL_TRIGGER = "<tool_call>"
CALL_BEGIN = '<tool_call>\n{"name": '
ARGUMENTS_KEY = '"arguments": '
CALL_END = "}\n</tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
# Whitespace a call's arguments may hold between tokens: enough for readable JSON, too little
# for a weak model to spend its tokens on.
MAX_WHITESPACE = 1
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ChoiceMode = Literal["none", "auto", "required", "named"]

_FALLBACK_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_FALLBACK_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class Function:
    """One function a request offers (`tools[i].function`).

    Attributes:
        name: what a call names.
        parameters: the JSON schema of its arguments (an object schema).
        description: what it does, for the model.
        strict: OpenAI's `strict`: properties the schema does not name are refused.
    """

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None
    strict: bool = False

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI `tools` entry, as templates and the fallback prompt show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}

    def call_tag(self) -> dict[str, Any]:
        """The structural-tag `tag` of one call of this function."""
        return {
            "type": "tag",
            "begin": f"{CALL_BEGIN}{json.dumps(self.name)}, {ARGUMENTS_KEY}",
            "content": {
                "type": "json_schema",
                "json_schema": _strict_schema(self.parameters) if self.strict else self.parameters,
                "max_whitespace_cnt": MAX_WHITESPACE,
                "excludes": [CALL_CLOSE],
            },
            "end": CALL_END,
        }


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how they may be called.

    Attributes:
        functions: the offered functions, names unique.
        mode: `tool_choice`: none, auto, required, or named (`named` is its function).
        named: the function a named choice calls.
        parallel: `parallel_tool_calls`: more than one call in one answer.
    """

    functions: tuple[Function, ...]
    mode: ChoiceMode = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether the answer's text is read for calls (every mode but `none`)."""
        return self.mode != "none"

    def tools(self) -> list[dict[str, Any]]:
        return [function.as_tool() for function in self.functions]

    def grammar(self) -> GuidedSpec | None:
        """The structural tag the output must match; None for `none`."""
        if self.mode == "none":
            return None
        if self.mode == "named":
            tags = [f.call_tag() for f in self.functions if f.name == self.named]
        else:
            tags = [f.call_tag() for f in self.functions]
        single = self.mode == "named" or not self.parallel
        if self.mode == "auto":
            form: dict[str, Any] = {
                "type": "triggered_tags",
                "triggers": [CALL_TRIGGER],
                "tags": tags,
                "stop_after_first": single,
            }
        else:
            form = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": CALL_SEPARATOR,
                "at_least_one": True,
                "stop_after_first": single,
            }
        tag = {"type": "structural_tag", "format": form}
        return GuidedSpec(GuidedKind.STRUCTURAL_TAG, json.dumps(tag))


def checked_tool_calling(
    functions: Sequence[tuple[str, Mapping[str, Any]]],
    choice: str | None,
    named: str | None,
    parallel: bool,
    named_param: str,
) -> ToolCalling | None:
    """A request's tools, checked; INVALID_ARGUMENT naming the field at fault.

    Args:
        functions: each offered function's path in the request (`tools[0].function`) and its
            fields (`name`, `parameters`, `description`, `strict`; a name already matched
            `[A-Za-z0-9_-]{1,64}`).
        choice: `tool_choice` (`named` for a named function; None: not sent).
        named: the function a named choice names.
        parallel: `parallel_tool_calls`.
        named_param: the field a named choice's name is in.

    Returns:
        None without tools (a `tool_choice` other than `none` is then refused).
    """
    if not functions:
        if choice is not None and choice != "none":
            raise ApiError.invalid("tool_choice: needs tools", "tool_choice")
        return None
    checked = tuple(_checked_function(path, fields) for path, fields in functions)
    for i, function in enumerate(checked):
        if any(other.name == function.name for other in checked[:i]):
            param = f"{functions[i][0]}.name"
            raise ApiError.invalid(f"{param}: {function.name!r} is named twice", param)
    if choice == "named" and all(function.name != named for function in checked):
        raise ApiError.invalid(f"{named_param}: no tool is named {named!r}", named_param)
    mode = cast(ChoiceMode, choice or "auto")
    return ToolCalling(checked, mode, named if mode == "named" else None, parallel)


def _checked_function(path: str, fields: Mapping[str, Any]) -> Function:
    """One function, its `parameters` checked as a JSON schema the grammar backend builds."""
    param = f"{path}.parameters"
    parameters = fields.get("parameters")
    parameters = EMPTY_PARAMETERS if parameters is None else parameters
    strict = bool(fields.get("strict"))
    guided_spec({param: (GuidedKind.JSON_SCHEMA, parameters, strict)})
    return Function(fields["name"], parameters, fields.get("description"), strict)


def _strict_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` on its top object unless it says otherwise
    (the JSON-schema compile applies OpenAI's strict to nested objects the same way)."""
    strict = dict(schema)
    if strict.get("type") == "object":
        strict.setdefault("additionalProperties", False)
    return strict


# -------------------------------------------------------------------- prompt
def tool_chat_turns(
    turns: Sequence[Mapping[str, Any]], calling: ToolCalling | None
) -> list[dict[str, str]]:
    """`turns` (with assistant `tool_calls` and `tool` results) for a template without tools:
    the tools in the system turn, calls written back in the call format, results as
    `<tool_response>` user turns.

    Args:
        turns: the chat, as `api.openai.models.ChatCompletionBody.turns` gives it.
        calling: the request's tools (None: the chat only carries earlier calls or results).
    """
    rendered = [_plain_turn(turn) for turn in turns]
    if calling is None or not calling.functions:
        return rendered
    listing = "\n".join(json.dumps(tool) for tool in calling.tools())
    block = f"{_FALLBACK_INTRO}{listing}{_FALLBACK_FORMAT}"
    if rendered and rendered[0]["role"] == "system":
        first = rendered[0]
        rendered[0] = {"role": "system", "content": f"{first['content']}\n\n{block}"}
    else:
        rendered.insert(0, {"role": "system", "content": block})
    return rendered


def _plain_turn(turn: Mapping[str, Any]) -> dict[str, str]:
    content = turn.get("content") or ""
    if turn["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [_call_text(call["function"]) for call in turn.get("tool_calls") or ()]
    if calls:
        content = "\n".join([content, *calls] if content else calls)
    return {"role": turn["role"], "content": content}


def _call_text(function: Mapping[str, Any]) -> str:
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    name = json.dumps(function["name"])
    return f"{CALL_BEGIN}{name}, {ARGUMENTS_KEY}{arguments}{CALL_END}"
