"""A storm of hostile requests through Serve's real HTTP and gRPC proxies, while good greedy
requests keep running: every hostile one is refused (4xx / INVALID_ARGUMENT /
RESOURCE_EXHAUSTED) naming its problem, never 5xx / INTERNAL / UNKNOWN; the good ones' outputs
equal those of the same requests run alone; the workers stay alive, keep stepping, and end with
clean pools.

The unit-level fuzz (tests/unit/cluster/api/test_fuzz_inputs.py) covers the parsing with many
generated inputs; this test checks the same categories end to end, once each or a few times.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests
from support.api_app import VOCAB, assert_app_clean, running_app

from pagedserve.cluster.client import Client, build_request

MODEL = "tiny-llama"
TEN_MB = "x" * (10 * 1024 * 1024)
GOOD_PROMPTS = ["the first good request", "another good one, a little longer"]
GOOD_TOKENS = 48
FAILSAFE_S = 300  # bounded waits only as failsafes: nothing here is timed


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}).encode()


def _raw(tail: bytes) -> bytes:
    return b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, ' + tail + b"}"


# (path, body, what the error must name)
HTTP_HOSTILE: list[tuple[str, bytes, str]] = [
    *(
        ("/v1/completions", _body(**{name: value}), name)
        for name in ("n", "temperature", "top_p", "stop", "seed", "max_tokens", "top_k", "echo")
        for value in ({"a": 1}, "x" if name != "stop" else 5, [[1]])
    ),
    *(
        ("/v1/completions", _body(**{name: value}), name)
        for name in ("n", "max_tokens", "logprobs", "min_tokens", "top_k")
        for value in (-(2**63) - 1, -(10**100))
    ),
    ("/v1/completions", _body(n=10_000), "n"),
    ("/v1/completions", _body(n=10**100), "n"),
    ("/v1/completions", _body(temperature=10**100), "temperature"),
    ("/v1/completions", _body(stop=[f"s{i}" for i in range(5000)]), "stop"),
    ("/v1/completions", _body(stop=["x" * 5000]), "stop[0]"),
    ("/v1/completions", _body(stop_token_ids=list(range(5000))), "stop_token_ids"),
    ("/v1/completions", _body(logit_bias={"50": -101}), "logit_bias[50]"),
    ("/v1/completions", _body(best_of=10_000), "best_of"),
    ("/v1/completions", _body(tools=[]), "tools"),
    ("/v1/completions", _body(response_format={"type": "yaml"}), "response_format.type"),
    ("/v1/completions", _body(guided_regex="(" * 5000), "guided_regex"),
    ("/v1/completions", _body(prompt=[VOCAB + 10]), "prompt"),
    ("/v1/completions", _body(prompt=[-1]), "prompt"),
    ("/v1/completions", _body(prompt=[2**63]), "prompt"),
    ("/v1/completions", _body(prompt=[]), "prompt"),
    ("/v1/completions", _raw(b'"temperature": NaN'), "temperature"),
    ("/v1/completions", _raw(b'"top_p": Infinity'), "top_p"),
    ("/v1/completions", _raw(b'"presence_penalty": -Infinity'), "presence_penalty"),
    ("/v1/completions", _raw(b'"top_p": 1e400'), "top_p"),
    ("/v1/completions", _raw(b'"n": ' + b"1" * 5000), "n"),
    ("/v1/completions", _raw(b'"stop": "\xff\xfe"'), "stop"),
    ("/v1/completions", _raw(b'"\xff": 1'), "\\udcff"),
    ("/v1/completions", _raw(b'"user": "\\ud800"'), "user"),
    ("/v1/completions", _raw(b'"stop": ' + b"[" * 1000 + b"]" * 1000), "nests deeper"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    ("/v1/completions", b"not json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", _body(messages=[{"role": "root", "content": "x"}]), "messages"),
    ("/v1/chat/completions", _body(messages=[]), "messages"),
    ("/v1/chat/completions", _body(messages="hi"), "messages"),
]
HTTP_HUGE = ("/v1/completions", _body(prompt=TEN_MB), "max_request_bytes")


def _grpc(name: str, **kwargs) -> tuple[bytes, str]:
    return build_request(**kwargs).SerializeToString(), name


GRPC_HOSTILE: list[tuple[bytes, str]] = [
    _grpc("temperature", prompt="hi", temperature=float("nan")),
    _grpc("top_p", prompt="hi", top_p=float("inf")),
    _grpc("repetition_penalty", prompt="hi", repetition_penalty=-float("inf")),
    _grpc("n", prompt="hi", n=10_000),
    _grpc("max_tokens", prompt="hi", max_tokens=-(2**31)),
    _grpc("top_k", prompt="hi", top_k=-5),
    _grpc("stop", prompt="hi", stop=[f"s{i}" for i in range(5000)]),
    _grpc("stop[0]", prompt="hi", stop=["x" * 5000]),
    _grpc("stop_token_ids", prompt="hi", stop_token_ids=list(range(5000))),
    _grpc("guided_grammar", prompt="hi", guided_grammar="root ::= " * 1000),
    _grpc("stop_token_ids[0]", prompt="hi", stop_token_ids=[-(2**63)]),
    _grpc("timeout_s", prompt="hi", timeout_s=float("nan")),
    _grpc("prompt", prompt="hi", prompt_token_ids=[1]),
    _grpc("prompt", prompt_token_ids=[2**63 - 1]),
    _grpc("prompt", prompt_token_ids=[-5]),
    _grpc("prompt"),
    _grpc("messages", messages=[{"role": "root", "content": "x"}]),
    (b"\n\x02\xff\xfe", "prompt"),  # field 1 (prompt) holding invalid UTF-8
    (b"\x1a\x04\x32\x02\xc3\x28", "sampling.stop[0]"),
    (b"\xa8\x06\x01", "unknown field number 101"),
    (b"\x0a\xff\xff\xff\xff\x0f", "GenerateRequest"),  # a length past the end
]
GRPC_HUGE = (build_request(prompt=TEN_MB).SerializeToString(), "")
GOOD_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def app(serve_cluster):
    with running_app("api-fuzz") as running:
        yield running


def _http_good(app, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": GOOD_TOKENS, "temperature": 0}
    reply = requests.post(f"{app.http_url}/v1/completions", json=body, timeout=FAILSAFE_S)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _grpc_good(client: Client, prompt: str, started: threading.Event | None = None) -> list[int]:
    tokens: list[int] = []
    for delta in client.generate_stream(
        prompt, max_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True
    ):
        tokens.extend(delta.token_ids)
        if started is not None:
            started.set()
    return tokens


def _send_http(app, path: str, raw: bytes, named: str) -> str | None:
    """None when refused as it should be, else what went wrong."""
    reply = requests.post(
        app.http_url + path, data=raw, headers={"content-type": "application/json"}, timeout=60
    )
    if not 400 <= reply.status_code < 500:
        return f"HTTP {path} {raw[:80]!r}: {reply.status_code} {reply.text[:300]}"
    error = reply.json()["error"]
    if named not in error["message"] and named != error.get("param"):
        return f"HTTP {path} {raw[:80]!r}: {named!r} not named in {error}"
    return None


def _send_grpc(channel: grpc.Channel, raw: bytes, named: str) -> str | None:
    call = channel.unary_unary("/pagedserve.v1.Generation/Generate")  # bytes in, bytes out
    try:
        call(raw, timeout=60)
    except grpc.RpcError as error:
        if error.code() not in GOOD_CODES or named not in (error.details() or ""):
            return f"gRPC {raw[:80]!r}: {error.code()} {error.details()!r} (wanted {named!r})"
        return None
    return f"gRPC {raw[:80]!r}: accepted"


def _steps(client: Client) -> dict[str, int]:
    return {w.worker_id: w.num_steps for w in client.stats().workers if w.alive}


def test_hostile_storm_leaves_good_requests_untouched(app):
    with Client(app.grpc_address, timeout=FAILSAFE_S) as client:
        alone_grpc = [_grpc_good(client, p) for p in GOOD_PROMPTS]
        alone_http = [_http_good(app, p) for p in GOOD_PROMPTS]
        steps_before = _steps(client)
        assert len(steps_before) == app.config.scaling.num_workers

        storm_over = threading.Event()
        started = [threading.Event() for _ in GOOD_PROMPTS]
        mismatches: list[str] = []

        def good_loop(i: int, prompt: str) -> int:
            """Good requests back to back until the storm is over; each must match its run
            alone. Returns how many ran."""
            runs = 0
            while not storm_over.is_set() or runs == 0:
                if _grpc_good(client, prompt, started[i]) != alone_grpc[i]:
                    mismatches.append(f"gRPC {prompt!r} run {runs}")
                if _http_good(app, prompt) != alone_http[i]:
                    mismatches.append(f"HTTP {prompt!r} run {runs}")
                runs += 1
            return runs

        hostile = [*HTTP_HOSTILE] * 2 + [*GRPC_HOSTILE] * 3  # ~200
        with (
            ThreadPoolExecutor(len(GOOD_PROMPTS)) as good_pool,
            ThreadPoolExecutor(8) as storm_pool,
            grpc.insecure_channel(app.grpc_address) as raw_channel,
        ):
            good = [good_pool.submit(good_loop, i, p) for i, p in enumerate(GOOD_PROMPTS)]
            for event in started:
                assert event.wait(FAILSAFE_S), "a good request never started streaming"
            sends = [
                storm_pool.submit(_send_http, app, *case)
                if len(case) == 3
                else storm_pool.submit(_send_grpc, raw_channel, *case)
                for case in [*hostile, HTTP_HUGE, GRPC_HUGE]
            ]
            failures = [f for f in (s.result(timeout=FAILSAFE_S) for s in sends) if f]
            storm_over.set()
            runs = [g.result(timeout=FAILSAFE_S) for g in good]

        assert failures == [], "\n".join(failures)
        assert mismatches == [], mismatches
        assert all(r >= 1 for r in runs)
        steps_after = _steps(client)
        assert steps_after.keys() == steps_before.keys(), "a worker died"
        assert sum(steps_after.values()) > sum(steps_before.values())
        # None stalled: each worker steps again (concurrent requests spread over them).
        for _ in range(10):
            if all(_steps(client)[w] > steps_after[w] for w in steps_after):
                break
            with ThreadPoolExecutor(4) as pool:
                outputs = list(pool.map(lambda p: _grpc_good(client, p), ["a", "b", "c", "d"]))
            assert all(len(tokens) == GOOD_TOKENS for tokens in outputs)
        assert all(_steps(client)[w] > steps_after[w] for w in steps_after), "a worker stalled"
    assert_app_clean(app)
