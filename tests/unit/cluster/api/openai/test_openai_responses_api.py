"""`/v1/responses`' body to chat turns, and its stream's events on the wire (the route end to
end with the official client: the integration module `test_api_http_surface`)."""

from __future__ import annotations

import itertools
import json

import pytest

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.models import parse_body
from pagedserve.cluster.api.openai.responses_api import AnswerReader, ResponsesBody
from pagedserve.cluster.api.openai.responses_objects import ResponseEvents, ResponseObject
from pagedserve.workers.protocol.stream import Usage


def body(**fields) -> ResponsesBody:
    return parse_body(ResponsesBody, {"model": "m", "input": "Hi", **fields})


def test_instructions_come_first_then_the_input():
    assert body(instructions="Be brief.").turns() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    messages = [{"role": "developer", "content": "x"}, {"role": "user", "content": parts}]
    assert body(input=messages).turns() == [
        {"role": "developer", "content": "x"},
        {"role": "user", "content": "ab"},
    ]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_what_a_stateless_server_cannot_do_is_named(fields, param):
    with pytest.raises(ApiError) as caught:
        body(**fields).turns()
    assert caught.value.param == param and caught.value.http_status == 400
    assert body(store=False).turns() == body().turns()  # store: false, or left out, is fine


def events_of(sse: list[str]) -> list[dict]:
    parsed = []
    for event in sse:
        name, data = event.removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        parsed.append(payload)
    return parsed


def ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}{next(counter)}"


def test_a_stream_s_events_are_numbered_and_end_with_the_whole_response():
    start = ResponseObject(id="resp_1", created_at=7, status="in_progress", model="m")
    events = ResponseEvents(start, new_id=ids())
    sse = [*events.start(), *events.text("H"), *events.text("i")]
    sse += events.finish(Usage(5, 2, 3), incomplete=True)
    parsed = events_of(sse)
    assert [e["sequence_number"] for e in parsed] == list(range(10))
    assert [e["type"] for e in parsed][-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = parsed[-1]["response"]
    assert final["status"] == "incomplete" and final["store"] is False
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hi" == parsed[-4]["text"]
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["total_tokens"] == 7
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3
    failed = events_of([events.fail("internal", "boom")])[0]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 10
    assert failed["response"]["error"] == {"code": "internal", "message": "boom"}


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_function_tools_become_the_chat_s_tools_and_calls_go_back_as_turns():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    request = body(input=items, tools=[WEATHER], tool_choice="required")
    calling = request.tool_calling
    assert calling.mode == "required" and calling.functions[0].strict  # strict by default
    assert request.sampling_kwargs()["guided"].kind.value == "structural_tag"
    turns = request.turns()
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"]
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
    ],
)
def test_bad_tools_are_named(fields, param):
    with pytest.raises(ApiError) as caught:
        request = body(**fields)
        request.turns()
        request.sampling_kwargs()
    assert caught.value.param == param, caught.value.message


def test_calls_come_out_as_function_call_items_around_the_text():
    start = ResponseObject(id="resp_1", created_at=7, status="in_progress", model="m")
    events = ResponseEvents(start, message_at_start=False, new_id=ids())
    reader = AnswerReader(reads_calls=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"Let me look.\n{call}"
    sse = events.start()
    for piece in (text[:20], text[20:70], text[70:]):
        sse += reader.read(events, piece, last=piece == text[70:])
    sse += events.finish(Usage(5, 9, 0), incomplete=False)
    parsed = events_of(sse)
    kinds = [e["type"] for e in parsed]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.function_call_arguments.delta" in kinds
    arguments = "".join(
        e["delta"] for e in parsed if e["type"] == "response.function_call_arguments.delta"
    )
    output = parsed[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me look."
    assert output[1] == {
        "type": "function_call",
        "id": "fc_1",
        "call_id": output[1]["call_id"],
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    assert arguments == output[1]["arguments"]
    assert parsed[-1]["type"] == "response.completed"
