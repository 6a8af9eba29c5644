"""The rest of the OpenAI surface end to end, through Serve's HTTP proxy: `/tokenize` and
`/detokenize`, `/v1/embeddings`, `/v1/responses`; with the official `openai` client where it
has the call, raw requests elsewhere. One app serves the whole module (auth on); the session's
leak check runs after every test."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import requests
import torch
import torch.nn.functional as F
from support.api_app import CONTEXT, VOCAB, running_app

from pagedserve.workers.model_loader import load_model

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


# ---------------------------------------------------------------- embeddings
@pytest.fixture(scope="module")
def tiny_llama_model():
    """The served model's weights in this process (tiny-llama is built from a fixed seed)."""
    return load_model(MODEL).model


def hf_embedding(model, token_ids: list[int]) -> list[float]:
    """HF's last hidden state (after the final norm) of the last token, L2-normalised."""
    with torch.inference_mode():
        states = model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    return F.normalize(states[-1], dim=0).tolist()


def assert_vector(vector, expected: list[float], atol: float = 2e-5) -> None:
    torch.testing.assert_close(
        torch.tensor(list(vector)), torch.tensor(list(expected)), atol=atol, rtol=1e-5
    )


def test_embeddings_with_the_openai_client(oai, tiny_llama_model):
    texts = ["Paged attention shares blocks.", "KV"]
    as_sent = oai.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    as_floats = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert as_sent.object == "list" and as_sent.model == MODEL
    assert [d.index for d in as_sent.data] == [0, 1]
    for sent, floats, text in zip(as_sent.data, as_floats.data, texts, strict=True):
        assert sent.object == "embedding" and len(sent.embedding) == len(floats.embedding)
        assert list(sent.embedding) == floats.embedding, "base64 decodes to the float vector"
        assert_vector(floats.embedding, hf_embedding(tiny_llama_model, list(text.encode())))
    tokens = len(texts[0]) + len(texts[1])
    assert as_sent.usage.prompt_tokens == as_sent.usage.total_tokens == tokens


def test_embeddings_of_token_ids_and_of_one_text(app, oai, tiny_llama_model):
    ids = [list(b"Token ids"), list(b"in a batch")]
    batch = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for item, token_ids in zip(batch.data, ids, strict=True):
        assert_vector(item.embedding, hf_embedding(tiny_llama_model, token_ids))
    one = oai.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    # Alone, its prefix cached by the batch: the batch's vector to float rounding (a step's
    # batch shapes its matmuls' rounding); as text, the same ids again: the very same vector.
    assert len(one.data) == 1
    assert_vector(one.data[0].embedding, batch.data[0].embedding, atol=1e-6)
    text = post(app, "/v1/embeddings", {"model": MODEL, "input": "Token ids"}).json()
    assert text["data"][0]["embedding"] == one.data[0].embedding
    assert text["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    raw = post(app, "/v1/embeddings", {"model": MODEL, "input": "KV", "encoding_format": "base64"})
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(packed) // 4}f", packed)  # little-endian float32
    assert_vector(vector, hf_embedding(tiny_llama_model, list(b"KV")))


def test_embedding_refusals_name_the_field(app, oai):
    def embed(**fields) -> requests.Response:
        return post(app, "/v1/embeddings", {"model": MODEL, **fields})

    assert "input is empty" in assert_invalid(embed(input=[]), "input")
    assert "input is empty" in assert_invalid(embed(input=""), "input")
    assert_invalid(embed(input=["a", ""]), "input[1]")
    assert_invalid(embed(input=[[72], []]), "input[1]")
    assert_invalid(embed(), "input")
    assert_invalid(embed(input="a", encoding_format="binary"), "encoding_format")
    assert "not supported" in assert_invalid(embed(input="a", dimensions=8), "dimensions")
    assert "input holds ids outside" in assert_invalid(embed(input=[72, VOCAB]), "input")
    assert "input is 1,000,001" in assert_invalid(embed(input=["a", "b" * 1_000_001]), "input")
    assert_invalid(post(app, "/v1/embeddings", {"model": "x", "input": "a"}), "model", 404)
    assert (
        post(app, "/v1/embeddings", {"model": MODEL, "input": "a"}, {"x": "y"}).status_code == 401
    )
    with pytest.raises(openai.BadRequestError, match="input is empty"):
        oai.embeddings.create(model=MODEL, input=[])
