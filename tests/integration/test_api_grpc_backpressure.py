"""Backpressure end to end through Serve's real gRPC proxy: streams nobody reads pause their
requests on the workers (blocks stop growing), and read to the end later they give exactly
what the same requests give unpaused; nothing leaks.

The hops that carry it: gRPC flow control → `grpc_streams` (bounded buffer, Ray generator
backpressure on the replica call) → the Router replica (user code on Serve's own loop, see
`serve_options.ROUTER_ENV_VARS`) → the router's bounded buffer of the request, read from its
worker's channel (`cluster/worker_channel.py`) → `Worker.set_paused` → the engine pauses the
request.
"""

from __future__ import annotations

import grpc
import ray
from support.api_app import assert_app_clean, running_app, wait_until

from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

NAME = "api-grpc-backpressure"
NUM_STREAMS = 4
MAX_TOKENS = 400  # two streams per worker fit its 127-block pool without preemption
DEADLINE_S = 180.0
# A small receive window, so that the client's own HTTP/2 buffer holds few messages.
CLIENT_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def request(i: int, request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i + j) % 250 + 1 for j in range(12)]
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, request_id=request_id)


def worker_stats() -> list[dict]:
    handles = [ray.get_actor(f"{NAME}-worker-{i}", namespace="pagedserve") for i in range(2)]
    return ray.get([h.stats.remote() for h in handles])


def test_unread_streams_pause_and_resume_with_unchanged_output(serve_cluster):
    # The Router deployment sets `serve_options.ROUTER_ENV_VARS` itself (cluster/app.py):
    # without it the replica would pull the Router's stream unread and nothing would pause.
    with running_app(NAME, max_buffered_deltas=4) as app:
        channel = grpc.insecure_channel(app.grpc_address, options=CLIENT_OPTIONS)
        stub = serving_pb2_grpc.GenerationStub(channel)
        # The same requests unpaused, all at once (as the streams below run).
        calls = [
            stub.Generate.future(request(i, f"ref-{i}"), timeout=DEADLINE_S)
            for i in range(NUM_STREAMS)
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
            _settled_when_all_paused(), DEADLINE_S, f"{NUM_STREAMS} paused requests, standing still"
        )
        produced = sum(s.kv.useful_tokens for s in paused)
        assert produced < NUM_STREAMS * MAX_TOKENS // 2, "paused well before the end"

        outputs = [[t for m in stream for t in m.token_ids] for stream in streams]
        assert outputs == reference
        assert_app_clean(app)  # blocks, requests and streams all back: no pause left behind
        assert all(s.num_paused == 0 and s.num_streams == 0 for s in worker_stats())
        channel.close()


def _settled_when_all_paused():
    """A poll for `wait_until`: the stats once every request is paused and no worker's steps or
    blocks changed since the poll before."""
    previous: list = []

    def poll():
        stats = worker_stats()
        if sum(s.num_paused for s in stats) != NUM_STREAMS:
            previous.clear()
            return None
        snapshot = [(s.num_steps, s.kv.used_blocks) for s in stats]
        settled = previous == [snapshot]
        previous[:] = [snapshot]
        return stats if settled else None

    return poll
