"""`/v1/responses`' body to chat turns, and its stream's events on the wire (the route end to
end with the official client: the integration module `test_api_http_surface`)."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.api_common import CompletionCollector
from pagedserve.cluster.api_errors import ApiError
from pagedserve.cluster.openai_models import parse_body
from pagedserve.cluster.openai_responses_api import ResponsesBody, ResponsesFrontend
from pagedserve.cluster.openai_responses_objects import ResponseEvents, ResponseObject
from pagedserve.workers.outputs import Usage
from pagedserve.workers.stream import StreamDelta


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
        ({"tools": [{"type": "function"}]}, "tools"),
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


def test_a_stream_s_events_are_numbered_and_end_with_the_whole_response():
    start = ResponseObject(id="resp_1", created_at=7, status="in_progress", model="m")
    events = ResponseEvents(start, "msg_1")
    collector = CompletionCollector()
    collector.add(StreamDelta("r", 0, [72], "H"))
    collector.add(StreamDelta("r", 0, [105], "i", "length", usage=Usage(5, 2, 3)))
    done = ResponsesFrontend._finish(start, "msg_1", collector)
    sse = [*events.start(), events.delta("H"), events.delta("i"), *events.finish(done)]
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
