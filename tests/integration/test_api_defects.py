"""Regressions of an outside attack, through the real front ends (Serve's gRPC and HTTP
proxies in front of a running app), never `RouterCore` in-process:

- refusals under overload reach gRPC clients as RESOURCE_EXHAUSTED with a `retry-after`
  trailer, never INTERNAL, and no status carries a traceback or other internals;
- oversized prompts and bodies are refused before any work (gRPC message limit, prompt
  length, HTTP body limit, JSON depth), NaN/Infinity anywhere is refused;
- request ids are the router's: a duplicate is refused and disturbs nothing, and with auth
  each tenant has its own ids: another tenant can neither abort nor squat them;
- `/metrics` needs a token when auth is on.

One app for the module (auth on, two tenants, small limits); like every test that runs
requests, each ends with the session's leak check (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import grpc
import pytest
import requests
from support.api_app import running_app, stall_workers, wait_router_let_go

from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

TENANT_A, TENANT_B = "tenant-a-token", "tenant-b-token"
MAX_INFLIGHT = 6
MAX_PROMPT_CHARS = 20_000
MAX_REQUEST_BYTES = 1 << 20
LONG = 400  # tokens: long enough to still be streaming while the test acts
# What must never reach a client: traceback text, file paths, pids, addresses, actor ids.
INTERNALS = re.compile(r"Traceback|\.py\b|pid=|\d+\.\d+\.\d+\.\d+:\d+|actor_id|ActorID|File \"")


@pytest.fixture(scope="module")
def app(serve_cluster):
    with running_app(
        "api-defects",
        auth={"tokens": [TENANT_A, TENANT_B]},
        max_inflight=MAX_INFLIGHT,
        max_waiting_per_worker=2,
        retry_after_s=2.0,
        max_prompt_chars=MAX_PROMPT_CHARS,
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as running:
        yield running


def auth(token: str = TENANT_A) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def greedy_request(prompt: str, max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(prompt=prompt, sampling=sampling, request_id=request_id)


def assert_no_internals(details: str | None) -> None:
    assert details is not None and not INTERNALS.search(details), details


# ---------------------------------------------------------------- refusals
async def _call(stub, request, streaming: bool, token: str = TENANT_A):
    """(status code, details, trailing metadata, token ids) of one call."""
    try:
        if streaming:
            call = stub.GenerateStream(request, metadata=auth(token), timeout=120)
            tokens = [t async for delta in call for t in delta.token_ids]
        else:
            call = stub.Generate(request, metadata=auth(token), timeout=120)
            response = await call
            tokens = list(response.completions[0].token_ids)
        return grpc.StatusCode.OK, "", dict(await call.trailing_metadata() or ()), tokens
    except grpc.aio.AioRpcError as error:
        trailers = dict(error.trailing_metadata() or ())
        return error.code(), error.details(), trailers, None


async def _burst_past_the_limit(app, streaming: bool, count: int) -> tuple[list, bool]:
    """Fill the router's MAX_INFLIGHT slots with streams (each read once: admitted), hold the
    workers still so that none of them can finish (an unread stream's tokens still flow into
    the transports' buffers), send `count` requests at once, then cancel the holders and
    release the workers. Returns the burst's results, and whether every holder was still open
    when the burst had been answered."""
    async with grpc.aio.insecure_channel(app.grpc_address) as channel:
        stub = serving_pb2_grpc.GenerationStub(channel)
        holders = []
        for i in range(MAX_INFLIGHT):  # one at a time: no worker's queue is ever past its bound
            request = greedy_request(f"hold {i}", LONG)
            holders.append(stub.GenerateStream(request, metadata=auth(), timeout=120))
            await holders[-1].read()  # admitted and decoding
        await asyncio.to_thread(stall_workers, app, True)
        try:
            requests_ = [greedy_request(f"burst {i}", 64) for i in range(count)]
            results = await asyncio.gather(*(_call(stub, r, streaming) for r in requests_))
            held = not any(holder.done() for holder in holders)
            for holder in holders:
                holder.cancel()
            await asyncio.to_thread(wait_router_let_go, app)
        finally:
            await asyncio.to_thread(stall_workers, app, False)
        return results, held


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_overload_refusals_are_resource_exhausted_with_a_retry_trailer(app, streaming):
    results, held = asyncio.run(_burst_past_the_limit(app, streaming, 14))
    if not held:
        pytest.fail("a holder ended before the burst was answered: make the holders longer")
    codes = [code for code, *_ in results]
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 14, codes  # every slot was taken
    for _, details, trailers, _ in results:
        assert trailers.get("retry-after") == "2", trailers
        assert "limit" in details
        assert_no_internals(details)


# ------------------------------------------------------------ size limits
def test_oversized_and_non_finite_inputs_are_refused_before_any_work(app):
    channel = grpc.insecure_channel(app.grpc_address)
    stub = serving_pb2_grpc.GenerationStub(channel)
    good = stub.Generate.future(greedy_request("good", 32), metadata=auth(), timeout=120)
    cases = {
        "message": (greedy_request("x" * (2 * MAX_REQUEST_BYTES), 4), "RESOURCE_EXHAUSTED"),
        "prompt": (greedy_request("x" * (MAX_PROMPT_CHARS + 1), 4), "INVALID_ARGUMENT"),
        "nan": (
            pb.GenerateRequest(
                prompt="hi", timeout_s=float("nan"), sampling=pb.SamplingParams(max_tokens=2)
            ),
            "INVALID_ARGUMENT",
        ),
    }
    for name, (request, expected) in cases.items():
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(request, metadata=auth(), timeout=60)
        assert raised.value.code().name == expected, (name, raised.value.details())
        assert_no_internals(raised.value.details())
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(greedy_request("x" * (MAX_PROMPT_CHARS + 1), 4), metadata=auth())
    assert "max_prompt_chars" in raised.value.details()
    assert len(good.result().completions[0].token_ids) == 32, "a good request is untouched"
    channel.close()


def _post(app, body: bytes | str, token: str = TENANT_A) -> requests.Response:
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    return requests.post(f"{app.http_url}/v1/completions", data=body, headers=headers, timeout=60)


def test_http_body_limit_depth_limit_and_non_finite_numbers(app):
    model = app.config.engine.model or "tiny-llama"
    big = json.dumps({"model": model, "prompt": "x" * (2 * MAX_REQUEST_BYTES)})
    response = _post(app, big)
    assert response.status_code == 413, response.text
    assert "max_request_bytes" in response.json()["error"]["message"]

    nested = "[" * 5000 + "]" * 5000
    deep = f'{{"model": "{model}", "prompt": "hi", "stop": {nested}}}'
    response = _post(app, deep)
    assert response.status_code == 400, response.text
    assert "nests deeper" in response.json()["error"]["message"]

    for constant in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"model": "{model}", "prompt": "hi", "temperature": {constant}}}'
        response = _post(app, body)
        assert response.status_code == 400, (constant, response.text)
        assert constant in response.json()["error"]["message"]

    ok = _post(app, json.dumps({"model": model, "prompt": "hi", "max_tokens": 3}))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("token", [TENANT_A, "wrong"], ids=["413", "401"])
def test_a_client_that_sends_its_whole_body_first_reads_the_early_refusal(app, token):
    """urllib sends `Connection: close` and the whole body before it reads: the refusal, sent
    before the body was read, still reaches it (not a connection reset)."""
    body = json.dumps({"model": "tiny-llama", "prompt": "x" * (10 << 20)}).encode()
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    request = urllib.request.Request(f"{app.http_url}/v1/completions", body, headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(refused.value.read())["error"]
    if token == TENANT_A:
        assert refused.value.code == 413 and "max_request_bytes" in error["message"]
    else:
        assert refused.value.code == 401 and error["code"] == "unauthenticated"


def test_metrics_need_a_token_when_auth_is_on(app):
    bare = requests.get(f"{app.http_url}/metrics", timeout=30)
    assert bare.status_code == 401, bare.text
    with_token = requests.get(
        f"{app.http_url}/metrics", headers={"authorization": f"Bearer {TENANT_A}"}, timeout=30
    )
    assert with_token.status_code in (200, 404)  # 404: metrics are off in this app


# -------------------------------------------------------------- request ids
async def _first_delta_then_rest(call) -> list[int]:
    """The token ids of the rest of a stream read with `read()` (which cannot be mixed with
    iteration on one call)."""
    tokens = []
    while (delta := await call.read()) is not grpc.aio.EOF:
        tokens.extend(delta.token_ids)
    return tokens


def test_a_duplicate_request_id_is_refused_and_disturbs_nothing(app):
    async def main():
        async with grpc.aio.insecure_channel(app.grpc_address) as channel:
            stub = serving_pb2_grpc.GenerationStub(channel)
            alone = await _call(stub, greedy_request("dup", LONG), streaming=True)
            first = stub.GenerateStream(
                greedy_request("dup", LONG, "dup-1"), metadata=auth(), timeout=120
            )
            head = await first.read()  # in flight now
            second = await _call(stub, greedy_request("dup", LONG, "dup-1"), streaming=True)
            rest = await _first_delta_then_rest(first)
            return alone[3], list(head.token_ids) + rest, second

    alone, first_tokens, (code, details, _, _) = asyncio.run(main())
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "already in flight" in details
    assert first_tokens == alone, "the request already in flight ran on, untouched"


def test_two_racing_requests_with_one_id_give_one_refusal_and_one_whole_answer(app):
    async def main():
        async with grpc.aio.insecure_channel(app.grpc_address) as channel:
            stub = serving_pb2_grpc.GenerationStub(channel)
            alone = await _call(stub, greedy_request("race", 24), streaming=True)
            pairs = []
            for trial in range(5):
                request = greedy_request("race", 24, f"race-{trial}")
                pairs.append(
                    await asyncio.gather(
                        _call(stub, request, streaming=True), _call(stub, request, streaming=True)
                    )
                )
            return alone[3], pairs

    alone, pairs = asyncio.run(main())
    for pair in pairs:
        codes = sorted(code.name for code, *_ in pair)
        whole = [tokens for code, _, _, tokens in pair if code is grpc.StatusCode.OK]
        # Either both ran one after the other, or one was refused while the other ran.
        assert codes in (["OK", "OK"], ["INVALID_ARGUMENT", "OK"]), pair
        assert all(tokens == alone for tokens in whole), "no leg was cut off"


def test_tenants_can_neither_abort_nor_squat_each_others_request_ids(app):
    async def main():
        async with grpc.aio.insecure_channel(app.grpc_address) as channel:
            stub = serving_pb2_grpc.GenerationStub(channel)
            alone = await _call(stub, greedy_request("mine", LONG), streaming=True)
            a_call = stub.GenerateStream(
                greedy_request("mine", LONG, "shared-id"), metadata=auth(TENANT_A), timeout=120
            )
            head = await a_call.read()
            aborted = await stub.Abort(
                pb.AbortRequest(request_id="shared-id"), metadata=auth(TENANT_B), timeout=30
            )
            b_result = await _call(
                stub, greedy_request("theirs", 8, "shared-id"), streaming=True, token=TENANT_B
            )
            rest = await _first_delta_then_rest(a_call)
            return alone[3], list(head.token_ids) + rest, aborted.aborted, b_result

    alone, a_tokens, aborted, (b_code, b_details, _, b_tokens) = asyncio.run(main())
    assert aborted is False, "tenant B aborted tenant A's request"
    assert b_code is grpc.StatusCode.OK and len(b_tokens) == 8, (b_code, b_details)
    assert a_tokens == alone, "tenant A's request ran to its end, untouched"


def test_a_tenant_aborts_its_own_request(app):
    async def main():
        async with grpc.aio.insecure_channel(app.grpc_address) as channel:
            stub = serving_pb2_grpc.GenerationStub(channel)
            call = stub.GenerateStream(
                greedy_request("abort", LONG, "own-id"), metadata=auth(TENANT_B), timeout=120
            )
            await call.read()
            aborted = await stub.Abort(
                pb.AbortRequest(request_id="own-id"), metadata=auth(TENANT_B), timeout=30
            )
            finals = []
            while (delta := await call.read()) is not grpc.aio.EOF:
                finals += [delta.finish_reason] if delta.finish_reason else []
            return aborted.aborted, finals

    aborted, finals = asyncio.run(main())
    assert aborted is True and finals == ["abort"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_a_loopback_host_serves_every_local_address(app, host):
    """The app serves on loopback only (`--host 127.0.0.1`): calls from this machine, over
    IPv4, IPv6 or IPv4 mapped into IPv6, are all local and served."""
    channel = grpc.insecure_channel(f"{host}:{app.grpc_port}")
    stub = serving_pb2_grpc.GenerationStub(channel)
    response = stub.Generate(greedy_request("local", 3), metadata=auth(), timeout=60)
    assert len(response.completions[0].token_ids) == 3
    channel.close()
