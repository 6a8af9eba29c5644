"""`ToolCallParser`: one choice's text, as it streams, split into content and tool calls.

The text is in the call format of `api.openai.tools` (the grammar writes it exactly):

    Some content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The parser sends text as soon as it knows what it is: content up to anything that may start a
call, a call's name once its header is whole, and its arguments up to anything that may be the
call's end (`}` then `</tool_call>`). Fed the text in any pieces, it gives the same calls and
the same content, joined, as fed whole (tests/unit/cluster/api/openai/test_tool_call_parser.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from pagedserve.cluster.api.openai.responses import (
    AssistantMessage,
    CalledFunction,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
)
from pagedserve.cluster.api.openai.tools import CALL_CLOSE, CALL_TRIGGER

# `<tool_call>` `{"name": "...", "arguments": ` with any whitespace a template may put in.
_HEADER = re.compile(
    r'<tool_call>\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*'
)
# The call's end: the closing brace of `{"name": ..., "arguments": ...}`, then `</tool_call>`.
_END = re.compile(r"\}\s*</tool_call>")
# A header longer than this is not one (under the grammar it is `len(name) + 40`).
_MAX_HEADER_CHARS = 4096


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    """One call, as far as it has been read."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(frozen=True)
class CallDelta:
    """What a piece of text added to one call: its start (id and name) or arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Parsed:
    """What a piece of text added: content and call deltas (in the order written)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class _State(Enum):
    CONTENT = "content"
    HEADER = "header"
    ARGUMENTS = "arguments"


class ToolCallParser:
    """Splits one choice's text into content and tool calls as it arrives."""

    def __init__(self, call_ids: Callable[[], str] = new_call_id) -> None:
        self._call_ids = call_ids
        self._state = _State.CONTENT
        self._held = ""  # text read but not yet given out
        self._after_call = False  # whitespace right after a call is not content
        self.calls: list[ParsedCall] = []
        self.content = ""  # all content given out so far

    @property
    def called(self) -> bool:
        """Whether at least one call was read whole."""
        return any(call.complete for call in self.calls)

    def feed(self, text: str, last: bool = False) -> Parsed:
        """What `text`, after everything fed before, adds; with `last` (the text ends with it),
        everything still held too (`_finish`)."""
        self._held += text
        parsed = Parsed()
        state_changed = True
        while state_changed:
            state_changed = self._step(parsed)
        if last:
            self._finish(parsed)
        return parsed

    def finish(self) -> Parsed:
        """Everything still held, at the end of the text."""
        return self.feed("", last=True)

    def _finish(self, parsed: Parsed) -> None:
        """Give out everything still held, at the end of the text: a call cut short keeps what
        it has; a header cut short is content."""
        held, self._held = self._held, ""
        if self._state is _State.ARGUMENTS:
            self._add_arguments(parsed, held)
        else:
            self._add_content(parsed, held.strip() if self._after_call else held)
        self._state = _State.CONTENT

    def _step(self, parsed: Parsed) -> bool:
        """Read what can be read in the current state; True when the state changed."""
        if self._state is _State.CONTENT:
            return self._read_content(parsed)
        if self._state is _State.HEADER:
            return self._read_header(parsed)
        return self._read_arguments(parsed)

    def _read_content(self, parsed: Parsed) -> bool:
        if self._after_call:
            self._held = self._held.lstrip()
            self._after_call = not self._held
        start = self._held.find(CALL_TRIGGER)
        if start >= 0:
            self._add_content(parsed, self._held[:start].rstrip())
            self._held = self._held[start:]
            self._state = _State.HEADER
            return True
        # Hold what may start a call, and trailing whitespace (dropped before a call).
        keep = len(self._held) - _partial_suffix(self._held, CALL_TRIGGER)
        keep = len(self._held[:keep].rstrip())
        self._add_content(parsed, self._held[:keep])
        self._held = self._held[keep:]
        return False

    def _read_header(self, parsed: Parsed) -> bool:
        match = _HEADER.match(self._held)
        if match is None or match.end() == len(self._held):
            # Not whole yet (or the whitespace after its colon may go on).
            if len(self._held) > _MAX_HEADER_CHARS:
                self._add_content(parsed, self._held)  # never a call: it was content
                self._held, self._state = "", _State.CONTENT
            return False
        call = ParsedCall(id=self._call_ids(), name=json.loads(match.group(1)))
        self.calls.append(call)
        parsed.calls.append(CallDelta(len(self.calls) - 1, id=call.id, name=call.name))
        self._held = self._held[match.end() :]
        self._state = _State.ARGUMENTS
        return True

    def _read_arguments(self, parsed: Parsed) -> bool:
        end = _END.search(self._held)
        if end is not None:
            self._add_arguments(parsed, self._held[: end.start()].rstrip())
            self.calls[-1].complete = True
            self._held = self._held[end.end() :]
            self._state, self._after_call = _State.CONTENT, True
            return True
        keep = _arguments_safe_length(self._held)
        self._add_arguments(parsed, self._held[:keep])
        self._held = self._held[keep:]
        return False

    def _add_content(self, parsed: Parsed, text: str) -> None:
        parsed.content += text
        self.content += text

    def _add_arguments(self, parsed: Parsed, text: str) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments += text
        if parsed.calls and parsed.calls[-1].index == index:
            last = parsed.calls[-1]
            parsed.calls[-1] = CallDelta(index, last.id, last.name, last.arguments + text)
        else:
            parsed.calls.append(CallDelta(index, arguments=text))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _arguments_safe_length(text: str) -> int:
    """How much of a call's arguments text can be given out: all but a last `}` that may be
    the call's closing brace (whitespace and part of `</tool_call>` may follow it)."""
    brace = text.rfind("}")
    if brace < 0:
        return len(text)
    rest = text[brace + 1 :].lstrip()
    if CALL_CLOSE.startswith(rest):
        return brace
    return len(text)


class ToolAnswers:
    """The chat answers of a request with tools: one parser per choice, its deltas and its
    whole message in OpenAI's shapes, and `finish_reason: "tool_calls"` for an answer that
    called (and was not cut short)."""

    def __init__(self, call_ids: Callable[[], str] = new_call_id) -> None:
        self._call_ids = call_ids
        self._parsers: dict[int, ToolCallParser] = {}

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCallDelta] | None, str | None]:
        """Choice `index`'s next text → (content, call deltas, finish reason)."""
        parser = self._parsers.setdefault(index, ToolCallParser(self._call_ids))
        parsed = parser.feed(text, last=finish_reason is not None)
        calls = [_call_delta(call) for call in parsed.calls] or None
        return parsed.content or None, calls, _finish(parser, finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        """A whole answer's message and finish reason."""
        parser = ToolCallParser(self._call_ids)
        parser.feed(text, last=True)
        calls = [
            ToolCall(id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments))
            for call in parser.calls
        ]
        message = AssistantMessage(content=parser.content or None, tool_calls=calls or None)
        return message, _finish(parser, finish_reason)


def _call_delta(call: CallDelta) -> ToolCallDelta:
    if call.id is None:
        return ToolCallDelta(index=call.index, function=FunctionDelta(arguments=call.arguments))
    function = FunctionDelta(name=call.name, arguments=call.arguments)
    return ToolCallDelta(index=call.index, id=call.id, type="function", function=function)


def _finish(parser: ToolCallParser, finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" and parser.called else finish_reason
