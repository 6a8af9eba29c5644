"""The OpenAI-compatible HTTP API end to end, through Serve's HTTP proxy, with the official
`openai` client and with raw requests. One app serves the whole module (auth on)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import openai
import pytest
import requests
from support.api_app import (
    CONTEXT,
    POOL_TOKENS,
    VOCAB,
    assert_app_clean,
    running_app,
    view_entries,
    wait_viewed,
)

from pagedserve.cluster.client import Client

TOKEN = "http-test-token"
OTHER_TENANT = "another-tenant-token"
TEAM = ("team-token-1", "team-token-2")  # two tokens of one cache group
MODEL = "tiny-llama"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
LONG = 900  # tokens: several seconds of decoding on a CPU, yet it fits the pool


@pytest.fixture(scope="module")
def app(serve_cluster):
    tokens = [TOKEN, OTHER_TENANT, *(f"{token} team" for token in TEAM)]
    with running_app("api-http", auth={"tokens": tokens}) as running:
        yield running


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(app):
    with Client(app.grpc_address, token=TOKEN, timeout=30) as client:
        yield client


def cached_tokens(app, token: str, prompt: list[int]) -> int:
    """Send `prompt` as the tenant of `token`; the prompt tokens its worker found cached."""
    client = openai.OpenAI(base_url=f"{app.http_url}/v1", api_key=token, max_retries=0, timeout=60)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    return completion.usage.prompt_tokens_details.cached_tokens


# ------------------------------------------------------ the openai client
def test_models_and_health(app, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    response = requests.get(f"{app.http_url}/health", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_completions(oai, grpc_client):
    completion = oai.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=8, **GREEDY
    )
    (choice,) = completion.choices
    assert completion.object == "text_completion" and completion.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0
    assert completion.usage.prompt_tokens == len("Paged attention")
    assert completion.usage.completion_tokens == 8 and completion.usage.total_tokens == 23
    same = grpc_client.generate("Paged attention", max_tokens=8, temperature=0.0, ignore_eos=True)
    assert choice.text == same.completions[0].text, "HTTP and gRPC serve the same model"

    ids = oai.completions.create(model=MODEL, prompt=[257, 80, 97], max_tokens=3, **GREEDY)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_completions_stream(oai):
    whole = oai.completions.create(model=MODEL, prompt="stream me", max_tokens=12, **GREEDY)
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="stream me",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "tokens arrive as they are sampled"
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_batch_prompts_and_n(oai):
    completion = oai.completions.create(
        model=MODEL, prompt=["first", "second"], n=2, max_tokens=4, seed=3, **GREEDY
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert completion.usage.prompt_tokens == len("first") + len("second")
    assert completion.usage.completion_tokens == 16


def test_chat(oai):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    (choice,) = chat.choices
    assert chat.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens > 20

    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 6

    two = oai.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_completion_tokens=3, seed=5, temperature=1.0
    )
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens <= 6


def test_openai_client_errors(app, oai):
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert raised.value.body["param"] == "temperature"
    assert raised.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt="x")
    stranger = openai.OpenAI(base_url=f"{app.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


# ------------------------------------------------------------- bad input
def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "abc", **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
INVALID = (400, "invalid_argument")
NEVER_FITS = (400, "resource_exhausted")
RAW_BAD_UTF8 = b'{"model": "tiny-llama", "prompt": "ab\xff"}'
RAW_SURROGATE = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}'
WIZARD = [{"role": "wizard", "content": "x"}]
BAD_HTTP = [
    # (case, path, body: dict or raw bytes, (status, code), param or None, text in message)
    ("not JSON", COMPLETIONS, b"{model", INVALID, None, "not valid JSON"),
    ("not an object", COMPLETIONS, b"[1, 2]", INVALID, None, "JSON object"),
    ("bad UTF-8 bytes", COMPLETIONS, RAW_BAD_UTF8, INVALID, "prompt", "prompt is not valid UTF-8"),
    ("lone surrogate", CHAT, RAW_SURROGATE, INVALID, "messages[0].content", "not valid UTF-8"),
    ("unknown field", COMPLETIONS, completion(frobnicate=1), INVALID, "frobnicate", "unknown"),
    ("wrong type", COMPLETIONS, completion(max_tokens="ten"), INVALID, "max_tokens", ""),
    ("empty prompt", COMPLETIONS, completion(prompt=""), INVALID, "prompt", "empty"),
    ("empty batch", COMPLETIONS, completion(prompt=[]), INVALID, "prompt", "empty"),
    ("id past vocab", COMPLETIONS, completion(prompt=[1, VOCAB]), INVALID, "prompt", "vocabulary"),
    ("max_tokens 0", COMPLETIONS, completion(max_tokens=0), INVALID, "max_tokens", ">= 1"),
    ("past context", COMPLETIONS, completion(max_tokens=CONTEXT), INVALID, None, "context"),
    ("temperature < 0", COMPLETIONS, completion(temperature=-1), INVALID, "temperature", ">= 0"),
    ("top_p 0", COMPLETIONS, completion(top_p=0), INVALID, "top_p", "(0, 1]"),
    ("n 0", COMPLETIONS, completion(n=0), INVALID, "n", "[1, 64]"),
    ("n too large", CHAT, chat(n=100), INVALID, "n", "[1, 64]"),
    ("stream, bad top_p", COMPLETIONS, completion(stream=True, top_p=2), INVALID, "top_p", ""),
    ("never fits", COMPLETIONS, completion(max_tokens=POOL_TOKENS), NEVER_FITS, None, "never fit"),
    ("stream, never fits", CHAT, chat(stream=True, max_tokens=POOL_TOKENS), NEVER_FITS, None, ""),
    ("unknown model", CHAT, chat(model="gpt-4o"), (404, "not_found"), "model", "not served"),
    ("no messages", CHAT, chat(messages=[]), INVALID, "messages", ""),
    ("bad role", CHAT, chat(messages=WIZARD), INVALID, "messages[0].role", ""),
    ("no tools", CHAT, chat(tools=[]), INVALID, "tools", "at least 1"),
    ("choice, no tools", CHAT, chat(tool_choice="auto"), INVALID, "tool_choice", "needs tools"),
]


def post(app, path: str, body, headers=HEADERS, **kwargs) -> requests.Response:
    if isinstance(body, bytes):
        headers = {**headers, "content-type": "application/json"}
        return requests.post(app.http_url + path, data=body, headers=headers, timeout=30, **kwargs)
    return requests.post(app.http_url + path, json=body, headers=headers, timeout=30, **kwargs)


def check_error(response: requests.Response, expected, param, text) -> str | None:
    """None when the response is the expected JSON error, else what is wrong."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError):
        return f"status {response.status_code}, body {response.text[:200]!r}"
    got = (response.status_code, error.get("code"), error.get("param"))
    if got != (*expected, param) or text not in error.get("message", ""):
        return f"got {got} {error.get('message')!r}"
    return None


def test_bad_inputs_get_their_errors_while_a_good_request_completes(app, oai):
    """Every bad input is answered while a good stream is open, and the good one's text is
    what it is alone. The good stream's reader stops after its first chunk until the bad ones
    are answered, so the stream is open throughout by construction, not by a race between
    400 tokens and the bad requests (the router may meanwhile buffer or pause it)."""
    good = completion(prompt="the good request", max_tokens=400, temperature=0.0, ignore_eos=True)
    reference = post(app, COMPLETIONS, good).json()["choices"][0]["text"]
    result: dict[str, object] = {}
    first_chunk = threading.Event()
    bad_ones_answered = threading.Event()

    def run_good():
        text = []
        with post(app, COMPLETIONS, {**good, "stream": True}, stream=True) as response:
            for line in response.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    text.append(chunk["choices"][0]["text"])
                    result["finish_reason"] = chunk["choices"][0]["finish_reason"]
                    if not first_chunk.is_set():
                        first_chunk.set()
                        bad_ones_answered.wait(120)
                elif line == "data: [DONE]":
                    result["done"] = True
        result["text"] = "".join(text)

    thread = threading.Thread(target=run_good)
    thread.start()
    try:
        assert first_chunk.wait(30), "the good request never started"
        failures = []
        for case, path, body, expected, param, text in BAD_HTTP:
            problem = check_error(post(app, path, body), expected, param, text)
            if problem:
                failures.append(f"{case}: {problem}")
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            response = post(app, COMPLETIONS, completion(), headers=headers)
            problem = check_error(response, (401, "unauthenticated"), "authorization", "")
            if problem or response.headers.get("www-authenticate") != "Bearer":
                failures.append(f"auth {headers}: {problem or response.headers}")
    finally:
        bad_ones_answered.set()
        thread.join(60)
    assert not failures, "\n".join(failures)
    assert result.get("done") and result.get("finish_reason") == "length"
    assert result["text"] == reference, "the good request was disturbed"


def test_client_disconnect_mid_stream_frees_the_blocks(app, grpc_client):
    steps = {w.worker_id: w.num_steps for w in grpc_client.stats().workers}
    body = completion(prompt="walk away", max_tokens=LONG, ignore_eos=True, stream=True)
    with post(app, COMPLETIONS, body, stream=True) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert sum(w.kv.used_blocks for w in grpc_client.stats().workers) > 0
    assert_app_clean(app)  # request, stream and blocks all gone
    # And it did not run on to its end unread: that takes LONG steps of its worker.
    after = {w.worker_id: w.num_steps for w in grpc_client.stats().workers}
    assert max(after[w] - steps[w] for w in after) < LONG, (steps, after)


def test_a_half_sent_request_is_closed_at_its_deadline_while_others_are_served(app, oai):
    """Serve's proxy carries the connection bounds (`cluster/api/http_connections.py`): a client
    that never finishes its headers is closed at the default deadline; a stream opened before
    it and a request after it are served whole."""
    half = socket.create_connection(("127.0.0.1", app.http_port), timeout=120)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    stream = oai.completions.create(model=MODEL, prompt="before", max_tokens=16, stream=True)
    chunks = iter(stream)
    next(chunks)
    with contextlib.suppress(ConnectionResetError):
        assert half.recv(1) == b""  # the server closed it (waits for that)
    half.close()
    *_, last = chunks
    assert last.choices[0].finish_reason in ("length", "stop")
    after = oai.completions.create(model=MODEL, prompt="after", max_tokens=4, **GREEDY)
    assert after.usage.completion_tokens == 4


# --------------------------------------------------------------- tenants
def test_tenants_never_hit_each_others_prefix_cache(app, grpc_client):
    """With auth on, a prompt one token sent is cached for that token only (no cross-tenant
    hit, so no timing side channel); tokens of one cache group share their cache."""
    full_blocks = 8
    prompt = [(7 * i + 3) % 250 for i in range(full_blocks * 8 + 1)]  # block_size 8
    entries = view_entries(app)
    assert cached_tokens(app, TOKEN, prompt) == 0
    entries = wait_viewed(app, entries, full_blocks)
    assert cached_tokens(app, TOKEN, prompt) == full_blocks * 8, "a tenant hits its own cache"
    assert cached_tokens(app, OTHER_TENANT, prompt) == 0, "another tenant must not hit it"
    assert cached_tokens(app, TEAM[0], prompt) == 0
    wait_viewed(app, entries, 2 * full_blocks)  # the other tenant's and the team's
    assert cached_tokens(app, TEAM[1], prompt) == full_blocks * 8, "a cache group shares"
    assert cached_tokens(app, OTHER_TENANT, prompt) == full_blocks * 8
