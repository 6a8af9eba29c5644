"""The rest of the OpenAI surface end to end, through Serve's HTTP proxy: `/tokenize` and
`/detokenize`, `/v1/embeddings`, `/v1/responses`; with the official `openai` client where it
has the call, raw requests elsewhere. One app serves the whole module (auth on); the session's
leak check runs after every test."""

from __future__ import annotations

import openai
import pytest
import requests
from support.api_app import CONTEXT, VOCAB, running_app

TOKEN = "surface-test-token"
MODEL = "tiny-llama"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def app(serve_cluster):
    with running_app("api-surface", auth={"tokens": [TOKEN]}) as running:
        yield running


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def post(app, path: str, body: dict, headers: dict | None = None) -> requests.Response:
    return requests.post(app.http_url + path, json=body, headers=headers or HEADERS, timeout=60)


def assert_invalid(response: requests.Response, param: str, status: int = 400) -> str:
    """The response is an OpenAI-style error naming `param`; its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ------------------------------------------------------- tokenize / detokenize
def test_tokenize_counts_what_a_completion_is_charged(app, oai):
    tokenized = post(app, "/tokenize", {"model": MODEL, "prompt": "Paged attention"})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body == {"count": 15, "max_model_len": CONTEXT, "tokens": list(b"Paged attention")}
    completion = oai.completions.create(
        model=MODEL, prompt="Paged attention", max_tokens=1, **GREEDY
    )
    assert completion.usage.prompt_tokens == body["count"]
    with_strs = post(app, "/tokenize", {"prompt": "Hé", "return_token_strs": True}).json()
    assert with_strs["tokens"] == [72, 0xC3, 0xA9] and with_strs["token_strs"][0] == "H"


def test_tokenize_a_chat_with_the_template(app, oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turns = "<|system|>\nBe brief.\n<|user|>\nHi\n"
    chat = post(app, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == list((turns + "<|assistant|>\n").encode())
    completion = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **GREEDY)
    assert completion.usage.prompt_tokens == chat["count"]
    open_turn = post(app, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert open_turn.json()["tokens"] == list(turns.encode())


def test_detokenize_round_trips(app):
    tokens = post(app, "/tokenize", {"prompt": "KV blocks ✓"}).json()["tokens"]
    back = post(app, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert back.status_code == 200 and back.json() == {"prompt": "KV blocks ✓"}
    special = post(app, "/detokenize", {"tokens": [257, 72, 105, 258]}).json()
    assert special == {"prompt": "Hi"}, "special tokens are left out, as in completions' text"


def test_tokenize_refusals_name_the_field(app):
    assert_invalid(post(app, "/detokenize", {"tokens": [72, VOCAB]}), "tokens[1]")
    assert_invalid(post(app, "/detokenize", {"tokens": [72, -1]}), "tokens[1]")
    assert_invalid(post(app, "/detokenize", {"tokens": "72"}), "tokens")
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    assert_invalid(post(app, "/tokenize", both), "prompt")
    assert_invalid(post(app, "/tokenize", {}), "prompt")
    assert_invalid(post(app, "/tokenize", {"prompt": "a", "stream": True}), "stream")
    assert_invalid(post(app, "/tokenize", {"messages": []}), "messages")
    assert_invalid(post(app, "/tokenize", {"model": "gpt-4", "prompt": "a"}), "model", 404)
    anonymous = post(app, "/tokenize", {"prompt": "a"}, headers={"x": "y"})
    assert anonymous.status_code == 401
    assert post(app, "/detokenize", {"tokens": [1]}, headers={"x": "y"}).status_code == 401
