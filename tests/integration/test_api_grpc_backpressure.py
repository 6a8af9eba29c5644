"""Backpressure end to end through Serve's real proxies: streams nobody reads pause their
requests on the workers (blocks stop growing), and read to the end later they give exactly
what the same requests give unpaused; nothing leaks. gRPC and HTTP (SSE) alike.

The hops that carry it: gRPC flow control → `api.grpc.streams` (bounded buffer, Ray generator
backpressure on the replica call) → the Router replica (user code on Serve's own loop, see
`serve_options.ROUTER_ENV_VARS`) → the router's bounded buffer of the request, read from its
worker's channel (`cluster/router/worker_channel.py`) → `Worker.set_paused` → the engine pauses the
request. Over HTTP, the first hops are TCP flow control → uvicorn's write buffer in the proxy →
the same Ray generator backpressure → the replica's bounded queue of the response's messages
(`cluster/api/sse_response.py`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import requests
from support.api_app import assert_app_clean, running_app, wait_until
from support.unread_stream import open_unread_stream, streamed_text

from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

NAME = "api-grpc-backpressure"
NUM_STREAMS = 4
MAX_TOKENS = 400  # two streams per worker fit its 127-block pool without preemption
DEADLINE_S = 180.0
# A small receive window, so that the client's own HTTP/2 buffer holds few messages.
CLIENT_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
# Over HTTP a stream pauses once the buffers on its way fill: the client's socket, the proxy's
# socket and its write buffer (`sse_response.limit_send_buffers`) hold tens of KB: a few hundred
# events of a token each (~450 tokens). Each event here carries its token's top logprobs, so
# that a stream pauses sooner (at ~220 tokens) and can be shorter; 40 streams, 20 per worker.
HTTP_STREAMS = 40
HTTP_MAX_TOKENS = 600
HTTP_TOP_LOGPROBS = 5
ENGINE = {"num_kv_blocks": 1200, "block_size": 8, "attention_backend": "torch"}


@pytest.fixture(scope="module")
def app(serve_cluster):
    # The Router deployment sets `serve_options.ROUTER_ENV_VARS` itself (cluster/app.py):
    # without it the replica would pull the Router's stream unread and nothing would pause.
    with running_app(NAME, max_buffered_deltas=4, engine=ENGINE) as app:
        yield app


def request(i: int, request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i + j) % 250 + 1 for j in range(12)]
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, request_id=request_id)


def worker_stats() -> list[dict]:
    handles = [ray.get_actor(f"{NAME}-worker-{i}", namespace="pagedserve") for i in range(2)]
    return ray.get([h.stats.remote() for h in handles])


def test_unread_grpc_streams_pause_and_resume_with_unchanged_output(app):
    channel = grpc.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS)
    stub = serving_pb2_grpc.GenerationStub(channel)
    # The same requests unpaused, all at once (as the streams below run).
    calls = [
        stub.Generate.future(request(i, f"ref-{i}"), timeout=DEADLINE_S) for i in range(NUM_STREAMS)
    ]
    reference = [list(call.result().completions[0].token_ids) for call in calls]
    streams = [
        stub.GenerateStream(request(i, f"unread-{i}"), timeout=DEADLINE_S)
        for i in range(NUM_STREAMS)
    ]
    # Every request paused, and its engine standing still: steps and blocks the same in two
    # snapshots in a row. (One all-paused snapshot is not enough: the router and the proxy
    # may still drain a few deltas until gRPC's windows fill, and a drained buffer resumes
    # its request for another step or two. An engine that ignored pauses never settles.)
    paused = wait_until(
        _settled_when_all_paused(NUM_STREAMS),
        DEADLINE_S,
        f"{NUM_STREAMS} paused requests, standing still",
    )
    produced = sum(s.kv.useful_tokens for s in paused)
    assert produced < NUM_STREAMS * MAX_TOKENS // 2, "paused well before the end"

    outputs = [[t for m in stream for t in m.token_ids] for stream in streams]
    assert outputs == reference
    assert_app_clean(app)  # blocks, requests and streams all back: no pause left behind
    assert all(s.num_paused == 0 and s.num_streams == 0 for s in worker_stats())
    channel.close()


def test_unread_http_streams_pause_and_resume_with_unchanged_output(app):
    bodies = [completion_body(i) for i in range(HTTP_STREAMS)]
    with ThreadPoolExecutor(HTTP_STREAMS) as pool:
        reference = list(pool.map(lambda body: whole_text(app, body), bodies))
    streams = [
        open_unread_stream(app.http_port, {**body, "stream": True}, DEADLINE_S) for body in bodies
    ]
    paused = wait_until(
        _settled_when_all_paused(HTTP_STREAMS),
        DEADLINE_S,
        f"{HTTP_STREAMS} paused requests, standing still",
    )
    produced = sum(s.kv.useful_tokens for s in paused)
    assert produced < HTTP_STREAMS * HTTP_MAX_TOKENS // 2, "paused well before the end"

    with ThreadPoolExecutor(HTTP_STREAMS) as pool:  # each resumes as it is read
        outputs = list(pool.map(lambda stream: streamed_text(stream[1]), streams))
    assert outputs == reference
    for connection, _ in streams:
        connection.close()
    assert_app_clean(app)
    assert all(s.num_paused == 0 and s.num_streams == 0 for s in worker_stats())


def completion_body(i: int) -> dict:
    prompt = [(7 * i + j) % 250 + 1 for j in range(12)]
    return {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": HTTP_MAX_TOKENS,
        "logprobs": HTTP_TOP_LOGPROBS,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def whole_text(app, body: dict) -> str:
    response = requests.post(f"{app.http_url}/v1/completions", json=body, timeout=DEADLINE_S)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _settled_when_all_paused(num_streams: int):
    """A poll for `wait_until`: the stats once every request is paused and no worker's steps or
    blocks changed since the poll before."""
    previous: list = []

    def poll():
        stats = worker_stats()
        if sum(s.num_paused for s in stats) != num_streams:
            previous.clear()
            return None
        snapshot = [(s.num_steps, s.kv.used_blocks) for s in stats]
        settled = previous == [snapshot]
        previous[:] = [snapshot]
        return stats if settled else None

    return poll
