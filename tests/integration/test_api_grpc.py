"""The gRPC API end to end: Serve's gRPC proxy, the Router, two tiny-llama workers.

One app serves the whole module (auth on); the last test kills the workers.
"""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.api_app import (
    CONTEXT,
    POOL_TOKENS,
    VOCAB,
    assert_app_clean,
    held_workers,
    running_app,
    stall_workers,
    view_entries,
    wait_router_let_go,
    wait_until,
    wait_viewed,
)

from pagedserve.bench.grpc_burst import run_burst
from pagedserve.cli import main as cli_main
from pagedserve.cluster.api.grpc.backlog import pending_backlog_options
from pagedserve.cluster.client import AsyncClient, Client
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.ray_internals import serve_grpc_server_options

TOKEN = "grpc-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LONG = 900  # tokens: several seconds of decoding on a CPU, yet it fits the pool
# A reader that stops reading holds its stream back through small receive windows: its request
# pauses on the worker well before LONG tokens (test_api_grpc_backpressure.py), so a stream
# left early cannot have finished before its cancel, however fast the machine. (With gRPC's
# default windows the client's buffer alone takes in ~900 one-token messages.)
SMALL_WINDOWS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
HELD_STEPS = 20  # engine steps a request may take before its workers hold still


@pytest.fixture(scope="module")
def app(serve_cluster):
    with running_app("api-grpc", auth={"tokens": [TOKEN]}) as running:
        yield running


@pytest.fixture(scope="module")
def client(app):
    with Client(app.grpc_address, token=TOKEN, timeout=60) as c:
        yield c


@pytest.fixture
def reader(app):
    """A client whose streams, once it stops reading them, hold still (`SMALL_WINDOWS`)."""
    with Client(app.grpc_address, token=TOKEN, timeout=60, options=SMALL_WINDOWS) as c:
        yield c


def used_blocks(client: Client) -> int:
    return sum(w.kv.used_blocks for w in client.stats().workers)


def engine_steps(client: Client) -> dict[str, int]:
    """Each worker's engine steps so far (one token per step for every request it runs)."""
    return {w.worker_id: w.num_steps for w in client.stats().workers}


def assert_ended_early(app, client: Client, steps_before: dict[str, int]) -> None:
    """The requests sent since `steps_before` are over, blocks and all (the leak check), and
    none ran on to its LONG tokens: that takes LONG steps of the worker it ran on. No clock:
    a cancel that did not reach the worker would show as LONG steps, however fast."""
    assert_app_clean(app)
    steps = engine_steps(client)
    assert max(steps[w] - steps_before[w] for w in steps) < LONG, (steps_before, steps)


# -------------------------------------------------------------------- health
def test_health_check_with_the_stock_stub(app):
    channel = grpc.insecure_channel(app.grpc_address)
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
    named = health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation")
    assert stub.Check(named, timeout=10).status == serving
    with pytest.raises(grpc.RpcError) as raised:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watch).status == serving
    watch.cancel()
    channel.close()


# ------------------------------------------------------------------ generate
def test_unary_and_streaming_give_the_same_greedy_completion(client):
    kwargs = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    unary = client.generate("Paged attention", **kwargs)
    (completion,) = unary.completions
    assert completion.finish_reason == "length" and len(completion.token_ids) == 12
    assert completion.text == ByteTokenizer().decode(completion.token_ids)
    assert unary.usage.prompt_tokens == len("Paged attention")
    assert unary.usage.completion_tokens == 12 and unary.request_id and unary.worker_id
    assert unary.metrics.ttft_s > 0 and unary.metrics.e2e_s >= unary.metrics.ttft_s

    deltas = list(client.generate_stream("Paged attention", **kwargs))
    assert len(deltas) > 1, "a stream sends tokens as they come"
    assert [t for d in deltas for t in d.token_ids] == list(completion.token_ids)
    assert "".join(d.text for d in deltas) == completion.text
    assert [d.finish_reason for d in deltas[:-1]] == [""] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 12
    assert all(not d.HasField("usage") for d in deltas[:-1])


def test_token_ids_stop_strings_and_client_request_ids(client):
    response = client.generate(
        prompt_token_ids=[257, 72, 105], max_tokens=4, temperature=0.0, request_id="ids-1"
    )
    assert response.request_id == "ids-1" and response.usage.prompt_tokens == 3
    reference = client.generate("stop here", max_tokens=16, temperature=0.0, ignore_eos=True)
    text = reference.completions[0].text
    stop = next((ch for ch in text[2:] if ch != "\ufffd"), None)
    if stop is None:
        pytest.skip("the random model produced no usable stop character")
    stopped = client.generate("stop here", max_tokens=16, temperature=0.0, stop=[stop])
    (completion,) = stopped.completions
    assert completion.finish_reason == "stop" and completion.stop_string == stop
    assert stop not in completion.text and text.startswith(completion.text)


def test_n_completions_unary_and_streamed(client):
    response = client.generate("branches", n=3, max_tokens=6, seed=11, ignore_eos=True)
    assert [c.index for c in response.completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in response.completions)
    assert response.usage.completion_tokens == 18
    again = client.generate("branches", n=3, max_tokens=6, seed=11, ignore_eos=True)
    assert [list(c.token_ids) for c in again.completions] == [
        list(c.token_ids) for c in response.completions
    ], "seeded branches are reproducible"

    finished: dict[int, str] = {}
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for delta in client.generate_stream("branches", n=3, max_tokens=6, seed=11, ignore_eos=True):
        tokens[delta.index].extend(delta.token_ids)
        if delta.finish_reason:
            finished[delta.index] = delta.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert [tokens[j] for j in range(3)] == [list(c.token_ids) for c in response.completions]


def test_async_client_streams_and_leaving_early_frees_blocks(app, client):
    steps = engine_steps(client)

    async def main():
        async with AsyncClient(
            app.grpc_address, token=TOKEN, timeout=60, options=SMALL_WINDOWS
        ) as aclient:
            assert await aclient.health() == "SERVING"
            assert len(await aclient.list_workers()) == 2
            response = await aclient.generate("async", max_tokens=3, temperature=0.0)
            assert len(response.completions[0].token_ids) == 3
            seen = 0
            stream = aclient.generate_stream("async", max_tokens=LONG, ignore_eos=True)
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()
            return seen

    assert asyncio.run(main()) == 3
    assert_ended_early(app, client, steps)


# ------------------------------------------------------- cancel and deadlines
def test_cancel_mid_stream_frees_the_blocks(app, client, reader):
    steps = engine_steps(client)
    call = reader.stub.GenerateStream(
        pb.GenerateRequest(
            prompt="cancel me", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
        ),
        metadata=AUTH,
        timeout=60,
    )
    for i, _ in enumerate(call):
        if i == 5:
            break
    assert used_blocks(client) > 0, "the request holds blocks while it runs"
    call.cancel()
    assert_ended_early(app, client, steps)
    assert sum(w.num_running + w.num_waiting for w in client.stats().workers) == 0


def test_many_cancels_at_any_moment_free_every_block(app, client, reader):
    """Cancels land at random points of the stream (while a message is being written, too)."""
    steps = engine_steps(client)
    request = pb.GenerateRequest(
        prompt="cancel us", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
    )
    calls = [reader.stub.GenerateStream(request, metadata=AUTH, timeout=60) for _ in range(8)]
    for k, call in enumerate(calls):
        for i, _ in enumerate(call):
            if i >= k:
                break
        call.cancel()
    assert_ended_early(app, client, steps)
    assert client.health() == "SERVING"


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
def test_deadline_exceeded_frees_the_blocks(app, client, streaming):
    request = pb.GenerateRequest(
        prompt="too slow", sampling=pb.SamplingParams(max_tokens=LONG, ignore_eos=True)
    )
    steps = engine_steps(client)
    # Held after HELD_STEPS: the request cannot finish before its deadline on any machine.
    with held_workers(app, after_steps=HELD_STEPS):
        with pytest.raises(grpc.RpcError) as raised:
            if streaming:
                list(client.stub.GenerateStream(request, metadata=AUTH, timeout=1.0))
            else:
                client.stub.Generate(request, metadata=AUTH, timeout=1.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_router_let_go(app)
    assert_ended_early(app, client, steps)  # the deadline reached the worker, not just us


def test_abort_by_request_id(app, client):
    steps = engine_steps(client)
    stream = client.generate_stream(
        "abort me", max_tokens=LONG, ignore_eos=True, request_id="abort-me"
    )
    first = next(stream)
    assert first.request_id == "abort-me"
    assert client.abort("abort-me") is True
    last = list(stream)[-1]
    assert last.finish_reason == "abort"
    assert_ended_early(app, client, steps)
    assert client.abort("abort-me") is False
    with pytest.raises(grpc.RpcError) as raised:
        client.abort("")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- bad input
def sampling(**kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="abc", sampling=pb.SamplingParams(**kwargs))


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_REQUESTS = [
    # (case, request message or raw bytes, status, text the details must hold)
    ("empty prompt", pb.GenerateRequest(), INVALID, "prompt is empty"),
    ("text and ids", pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), INVALID, "prompt"),
    ("id past vocab", pb.GenerateRequest(prompt_token_ids=[1, VOCAB]), INVALID, "prompt_token_ids"),
    ("negative id", pb.GenerateRequest(prompt_token_ids=[-1]), INVALID, "prompt_token_ids"),
    ("max_tokens 0", sampling(max_tokens=0), INVALID, "max_tokens must be >= 1"),
    ("max_tokens < 0", sampling(max_tokens=-5), INVALID, "max_tokens must be >= 1"),
    ("past context", sampling(max_tokens=CONTEXT), INVALID, "max_tokens"),
    ("temperature < 0", sampling(temperature=-0.1), INVALID, "temperature must be >= 0"),
    ("temperature nan", sampling(temperature=math.nan), INVALID, "temperature must be finite"),
    ("top_p 0", sampling(top_p=0.0), INVALID, "top_p must be in (0, 1]"),
    ("top_p > 1", sampling(top_p=1.01), INVALID, "top_p must be in (0, 1]"),
    ("n 0", sampling(n=0), INVALID, "n must be in [1, 64]"),
    ("n too large", sampling(n=1000), INVALID, "n must be in [1, 64]"),
    ("top_k < -1", sampling(top_k=-5), INVALID, "top_k"),
    ("empty stop", sampling(stop=[""]), INVALID, "stop[0]"),
    ("min > max", sampling(max_tokens=2, min_tokens=3), INVALID, "min_tokens"),
    ("negative timeout", pb.GenerateRequest(prompt="a", timeout_s=-1), INVALID, "timeout_s"),
    ("duplicate id", pb.GenerateRequest(prompt="a", request_id="good-1"), INVALID, "request_id"),
    ("bad UTF-8 prompt", b"\x0a\x03ab\xff", INVALID, "prompt is not valid UTF-8"),
    ("bad UTF-8 stop", b"\x0a\x01a\x1a\x03\x32\x01\xc3", INVALID, "sampling.stop[0] is not valid"),
    ("unknown field", b"\x0a\x01a\x98\x06\x05", INVALID, "unknown field number 99"),
    (
        "never fits",
        sampling(max_tokens=POOL_TOKENS),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "can never fit in the KV pool",
    ),
]


def call_both_ways(channel: grpc.Channel, request, metadata) -> list[grpc.RpcError | None]:
    """The request through Generate and GenerateStream; the error each raised (or None)."""
    serialize = None if isinstance(request, bytes) else pb.GenerateRequest.SerializeToString
    errors = []
    for method, kind in (("Generate", "unary_unary"), ("GenerateStream", "unary_stream")):
        rpc = getattr(channel, kind)(
            f"/pagedserve.v1.Generation/{method}",
            request_serializer=serialize,
            response_deserializer=lambda b: b,
        )
        try:
            result = rpc(request, metadata=metadata, timeout=30)
            if kind == "unary_stream":
                list(result)
            errors.append(None)
        except grpc.RpcError as error:
            errors.append(error)
    return errors


STEPS = 40  # engine steps the good request may take before the workers hold still


def test_bad_inputs_get_their_errors_while_a_good_request_completes(app, client):
    """Every bad call gets its status while a good stream is open, and the good one's tokens
    are what they are alone. The workers take at most `STEPS` engine steps from the good
    request's start, then hold still until the bad calls are answered: the stream is open
    throughout by construction. (A reader that stops reading does not hold it: gRPC's flow
    control window alone takes in ~900 one-token messages, measured.)"""
    good_kwargs = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    reference = client.generate("the good request", **good_kwargs).completions[0]
    stall_workers(app, True, after_steps=STEPS)
    good: dict[str, object] = {}
    first_delta = threading.Event()

    def run_good():
        tokens = []
        for delta in client.generate_stream("the good request", request_id="good-1", **good_kwargs):
            tokens.extend(delta.token_ids)
            good["finish_reason"] = delta.finish_reason
            first_delta.set()
        good["tokens"] = tokens

    thread = threading.Thread(target=run_good)
    thread.start()
    channel = grpc.insecure_channel(app.grpc_address)
    try:
        assert first_delta.wait(30), "the good request never started"
        failures = []
        for case, request, code, text in BAD_REQUESTS:
            for error in call_both_ways(channel, request, AUTH):
                if error is None or error.code() != code or text not in (error.details() or ""):
                    got = None if error is None else (error.code(), error.details())
                    failures.append(f"{case}: want {code.name} with {text!r}, got {got}")
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            for error in call_both_ways(channel, pb.GenerateRequest(prompt="a"), metadata):
                if error is None or error.code() != grpc.StatusCode.UNAUTHENTICATED:
                    failures.append(f"auth {metadata}: got {error}")
    finally:
        stall_workers(app, False)
        thread.join(60)
        channel.close()
    assert not failures, "\n".join(failures)
    assert good.get("finish_reason") == "length"
    assert good["tokens"] == list(reference.token_ids), "the good request was disturbed"


# -------------------------------------------------------------- stats + CLI
def test_stats_and_workers(app, client):
    entries = view_entries(app)
    client.generate("stats prefix " * 4, max_tokens=2)
    wait_viewed(app, entries, 1)  # the second is routed on the first's blocks
    client.generate("stats prefix " * 4, max_tokens=2)
    stats = client.stats()
    assert stats.num_alive_workers == 2 and len(stats.workers) == 2
    assert stats.kv.total_blocks == sum(w.kv.total_blocks for w in stats.workers) == 256
    assert stats.routing_policy == "kv_aware"
    assert stats.kv.prefix_hits_tokens > 0 and 0 < stats.prefix_hit_rate <= 1
    assert stats.router_counters["routed.prefix_hit"] >= 1
    assert stats.index.entries > 0
    workers = client.list_workers()
    assert [w.worker_id for w in workers] == ["api-grpc-worker-0", "api-grpc-worker-1"]
    assert all(w.alive and w.model == "tiny-llama" and w.vocab_size == VOCAB for w in workers)


def test_cli_generate_streams_and_status_prints_a_table(app, capsys):
    address = ["--address", app.grpc_address, "--token", TOKEN]
    code = cli_main(
        ["generate", "Hello", "--stream", "--max-tokens", "8", "--ignore-eos", *address]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "usage: 5 prompt + 8 completion tokens" in err
    assert out.endswith("\n") and len(out) > 1

    assert cli_main(["generate", "Hello", "--max-tokens", "4", "-n", "2", *address]) == 0
    out, _ = capsys.readouterr()
    assert "[0]" in out and "[1]" in out and "(length, 4 tokens)" in out

    assert cli_main(["status", *address]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["worker", "alive"]
    assert lines[1].startswith("api-grpc-worker-0") and lines[3].startswith("cluster")
    assert "prefix hit rate" in lines[0] and "routing: kv_aware" in out

    assert cli_main(["status", "--address", app.grpc_address, "--token", "wrong"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


# --------------------------------------------------------------------- burst
BURST = 1_200  # past gRPC's default pending-call limit (1,000), which dropped calls unnamed


def test_a_burst_ends_every_call_served_or_refused_with_a_retry_hint(app, client):
    # The proxy's gRPC server was built with our pending-call limit (its setup hook ran before
    # Serve built the server), so gRPC core drops none of a burst below that limit.
    node = ray.get_runtime_context().get_node_id()
    proxy = ray.get_actor(f"SERVE_PROXY_ACTOR-{node}", namespace="serve")
    options = dict(ray.get(proxy.__ray_call__.remote(lambda _: serve_grpc_server_options())))
    limit = app.config.limits.max_pending_grpc_calls
    assert options.items() >= dict(pending_backlog_options(limit)).items()

    outcomes = asyncio.run(run_burst(app.grpc_address, BURST, max_tokens=1, metadata=AUTH))
    assert [o for o in outcomes if not o.expected] == []
    codes = {o.code for o in outcomes}
    assert codes <= {"OK", "RESOURCE_EXHAUSTED"} and "OK" in codes
    wait_until(lambda: used_blocks(client) == 0, 120, "every block to be free")


# ------------------------------------------------------ last: workers gone
def test_unavailable_when_no_worker_is_alive(app, client):
    for i in range(2):
        actor = ray.get_actor(f"{app.name}-worker-{i}", namespace="pagedserve")
        ray.kill(actor, no_restart=True)

    def unavailable() -> bool:
        try:
            client.generate("anyone?", max_tokens=2)
        except grpc.RpcError as error:
            return error.code() == grpc.StatusCode.UNAVAILABLE
        return False

    wait_until(unavailable, 120, "UNAVAILABLE")
    with pytest.raises(grpc.RpcError) as raised:
        list(client.generate_stream("anyone?", max_tokens=2))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.health() == "NOT_SERVING"
