"""A Router replica killed mid-stream: its clients get UNAVAILABLE (no internals), Serve
starts a new replica that serves at once, and the workers abort the orphaned requests (Ray
closes a dead caller's stream; the dead router's lease lapses as a backstop), so none decodes
on to `max_tokens`.

Own module: it kills the app's only Router replica.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import ray
from support.api_app import assert_app_clean, running_app, wait_until

from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

LONG = 2000  # tokens: minutes of decoding on a CPU, far past the lease
LEASE_S = 3.0
INTERNALS = re.compile(r"Traceback|\.py\b|pid=|\d+\.\d+\.\d+\.\d+:\d+|actor_id|File \"")


@pytest.fixture(scope="module")
def app(serve_cluster):
    engine = {"num_kv_blocks": 512, "block_size": 8, "attention_backend": "torch"}
    with running_app("api-router-kill", engine=engine, lease_timeout_s=LEASE_S) as running:
        yield running


def router_replicas() -> list:
    names = ray.util.list_named_actors(all_namespaces=True)
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in names
        if "SERVE_REPLICA" in a["name"] and "Router" in a["name"]
    ]


def request(i: int, max_tokens: int = LONG) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(prompt=f"orphan {i}", sampling=sampling)


async def kill_router_mid_stream(address: str, num_streams: int) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.GenerationStub(channel)
        calls = [stub.GenerateStream(request(i), timeout=300) for i in range(num_streams)]
        for call in calls:
            await call.read()  # every stream is decoding
        (replica,) = router_replicas()
        ray.kill(replica, no_restart=False)
        outcomes = []
        for call in calls:
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
                outcomes.append((grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as error:
                outcomes.append((error.code(), error.details()))
        return outcomes


def test_a_killed_router_s_streams_end_unavailable_and_leave_no_orphan(app):
    outcomes = asyncio.run(kill_router_mid_stream(app.grpc_address, 4))
    for code, details in outcomes:
        assert code is grpc.StatusCode.UNAVAILABLE, (code, details)
        assert not INTERNALS.search(details), details

    def serves_again() -> bool:
        channel = grpc.insecure_channel(app.grpc_address)
        try:
            stub = serving_pb2_grpc.GenerationStub(channel)
            response = stub.Generate(request(99, max_tokens=4), timeout=30)
            return len(response.completions[0].token_ids) == 4
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    wait_until(serves_again, 120, "a new Router replica to serve")
    # The orphans ended long before LONG tokens: Ray closes a dead caller's stream (the worker
    # aborts the request) and, as a backstop, the dead router's lease lapses. Finishing any
    # of them would have taken at least LONG engine steps.
    assert_app_clean(app)
    stats = [
        ray.get(
            ray.get_actor(app.config.actors.worker_name(i), namespace="pagedserve").stats.remote()
        )
        for i in range(app.config.scaling.num_workers)
    ]
    assert max(s.num_steps for s in stats) < LONG, stats
