"""The rest of the OpenAI surface end to end, through Serve's HTTP proxy: `/tokenize` and
`/detokenize`, `/v1/embeddings`, `/v1/responses`; with the official `openai` client where it
has the call, raw requests elsewhere. One app serves the whole module (auth on); the session's
leak check runs after every test."""

from __future__ import annotations

import base64
import struct
from types import SimpleNamespace

import grpc
import openai
import pytest
import requests
import torch
import torch.nn.functional as F
from support.api_app import CONTEXT, VOCAB, assert_app_clean, running_app
from support.beam import hf_beams

from pagedserve.cluster.client import Client
from pagedserve.workers.beam.groups import decoder_for
from pagedserve.workers.model.loader import load_model

TOKEN = "surface-test-token"
MODEL = "tiny-llama"
HEADERS = {"authorization": f"Bearer {TOKEN}"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}


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


# ----------------------------------------------------------------- best_of
def cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_returns_the_best_of_the_sampled_branches(app, oai):
    """With a seed, branch i samples the same tokens whatever `n` is: `best_of=4, n=2` returns
    the two of the four branches of `n=4` with the highest cumulative log-probability, best
    first; usage counts all four."""
    fields = {"model": MODEL, "prompt": "Paged", "max_tokens": 6, "seed": 21, "logprobs": 0}
    fields |= {"temperature": 1.0, **IGNORE_EOS}
    every = oai.completions.create(n=4, **fields)
    best = oai.completions.create(n=2, best_of=4, **fields)
    ranked = sorted(every.choices, key=lambda c: (-cumulative(c), c.index))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens == 24
    quiet = oai.completions.create(n=1, best_of=4, **{**fields, "logprobs": None})
    assert quiet.choices[0].text == ranked[0].text and quiet.choices[0].logprobs is None
    assert_app_clean(app)


def test_best_of_refusals_name_it(app):
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert ">= n" in assert_invalid(
        post(app, "/v1/completions", {**base, "n": 3, "best_of": 2}), "best_of"
    )
    streamed = {**base, "best_of": 2, "stream": True}
    assert "streamed" in assert_invalid(post(app, "/v1/completions", streamed), "best_of")
    assert_invalid(post(app, "/v1/completions", {**base, "best_of": 100}), "best_of")
    assert_app_clean(app)


# ------------------------------------------------------------- beam search
BEAM = {"model": MODEL, "prompt": "Paged", "max_tokens": 8, "n": 4}


def hf_texts(model, prompt_ids: list[int], max_tokens: int) -> list[str]:
    """HF's `generate(num_beams=4, num_return_sequences=4)` of a prompt, as the texts the
    server's detokenizer makes of them (a stopped beam ends at its stop token), best first."""
    generation = model.generation_config
    ids, _ = hf_beams(SimpleNamespace(model=model), prompt_ids, 4, max_tokens)
    fill = {generation.eos_token_id, generation.pad_token_id} - {None}
    decode = decoder_for(load_model(MODEL).tokenizer)
    ended = [next((i + 1 for i, t in enumerate(b) if t in fill), len(b)) for b in ids]
    return [decode(beam[:end]) for beam, end in zip(ids, ended, strict=True)]


@pytest.fixture(scope="module")
def hf_beam_texts(tiny_llama_model):
    return hf_texts(tiny_llama_model, list(b"Paged"), 8)


def test_beam_search_with_the_openai_client_equals_hf(app, oai, hf_beam_texts, tiny_llama_model):
    """vLLM's extra parameters through `extra_body`, on completions and chat: `n` is the width;
    the choices are HF's beams, best first; an unset temperature is 0 under beam search."""
    fields = {k: v for k, v in BEAM.items() if k != "n"}
    beams = oai.completions.create(n=4, extra_body={"use_beam_search": True}, **fields)
    assert [c.index for c in beams.choices] == [0, 1, 2, 3]
    assert [c.text for c in beams.choices] == hf_beam_texts
    penalised = {"use_beam_search": True, "length_penalty": 1.0, "early_stopping": False}
    again = oai.completions.create(n=4, extra_body=penalised, **fields)
    assert [c.text for c in again.choices] == hf_beam_texts
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        n=4,
        max_tokens=6,
        extra_body={"use_beam_search": True},
    )
    expected = hf_texts(tiny_llama_model, list(CHAT_TEXT.encode()), 6)
    assert [c.message.content for c in chat.choices] == expected
    assert_app_clean(app)


def test_beam_search_refusals_name_the_field(app):
    def beam(**fields) -> requests.Response:
        return post(app, "/v1/completions", {**BEAM, "use_beam_search": True, **fields})

    assert "beam width" in assert_invalid(beam(n=1), "n")
    assert "max_beam_width" in assert_invalid(beam(n=9), "n")
    assert_invalid(beam(temperature=0.7), "temperature")
    assert_invalid(beam(top_p=0.5), "top_p")
    assert_invalid(beam(seed=1), "seed")
    assert_invalid(beam(logprobs=1), "logprobs")
    assert_invalid(beam(stop=["x"]), "stop")
    assert_invalid(beam(early_stopping="sometimes"), "early_stopping")
    plain = {k: v for k, v in BEAM.items() if k != "n"}
    only_beam = post(app, "/v1/completions", {**plain, "length_penalty": 0.5})
    assert "only used with use_beam_search" in assert_invalid(only_beam, "length_penalty")
    assert_app_clean(app)


def test_a_client_leaving_a_beam_search_frees_its_blocks(app):
    body = {**BEAM, "use_beam_search": True, "max_tokens": 400, "ignore_eos": True}
    with requests.post(
        app.http_url + "/v1/completions",
        json={**body, "stream": True},
        headers=HEADERS,
        stream=True,
        timeout=60,
    ) as response:
        assert response.status_code == 200
    assert_app_clean(app)


def test_grpc_beam_search_as_http_does(app, hf_beam_texts):
    with Client(app.grpc_address, token=TOKEN, timeout=60) as client:
        response = client.generate(
            "Paged", n=4, max_tokens=8, use_beam_search=True, early_stopping=False
        )
        with pytest.raises(grpc.RpcError) as caught:
            client.generate("Paged", n=4, max_tokens=8, use_beam_search=True, temperature=0.5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("temperature")
        with pytest.raises(grpc.RpcError, match="early_stopping"):
            client.generate("Paged", n=4, use_beam_search=True, early_stopping="sometimes")
    assert [c.index for c in response.completions] == [0, 1, 2, 3]
    assert [c.text for c in response.completions] == hf_beam_texts
    scores = [c.cumulative_logprob / len(c.token_ids) for c in response.completions]
    assert all(c.HasField("cumulative_logprob") for c in response.completions)
    assert scores == sorted(scores, reverse=True)
    assert_app_clean(app)


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
    # batch shapes its matmuls' rounding). As text, the same ids again: the same vector to
    # that rounding too, since either of the app's two workers may compute it, with or without
    # the prefix cached there (a full run saw 3e-8 apart).
    assert len(one.data) == 1
    assert_vector(one.data[0].embedding, batch.data[0].embedding, atol=1e-6)
    text = post(app, "/v1/embeddings", {"model": MODEL, "input": "Token ids"}).json()
    assert_vector(text["data"][0]["embedding"], one.data[0].embedding, atol=1e-6)
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


def test_grpc_embeds_as_http_does(app, oai, tiny_llama_model):
    texts = ["gRPC embeddings", "KV"]
    http = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    with Client(app.grpc_address, token=TOKEN, timeout=60) as client:
        response = client.embed(texts)
        ids = client.embed(token_ids=[list(b"KV")])
        for fields, field in (({}, "texts"), ({"texts": ["a", ""]}, "texts[1]")):
            with pytest.raises(grpc.RpcError) as caught:
                client.embed(**fields)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(field)
        with pytest.raises(grpc.RpcError, match="not both"):
            client.embed(["a"], token_ids=[[72]])
        with pytest.raises(grpc.RpcError, match="token_ids holds ids outside"):
            client.embed(token_ids=[[72, VOCAB]])
    assert [e.index for e in response.embeddings] == [0, 1]
    for grpc_vector, http_vector, text in zip(response.embeddings, http.data, texts, strict=True):
        assert_vector(grpc_vector.values, http_vector.embedding, atol=1e-6)
        assert_vector(grpc_vector.values, hf_embedding(tiny_llama_model, list(text.encode())))
    assert response.usage.prompt_tokens == len(texts[0]) + len(texts[1])
    assert list(ids.embeddings[0].values) == list(response.embeddings[1].values)
    with Client(app.grpc_address, timeout=60) as anonymous:
        with pytest.raises(grpc.RpcError) as caught:
            anonymous.embed(["a"])
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ----------------------------------------------------------------- responses
QUESTION = "Paged attention"
CHAT_TEXT = f"<|user|>\n{QUESTION}\n<|assistant|>\n"  # tiny-llama's template of one user turn
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
END_EVENTS = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_responses_with_the_openai_client(oai):
    response = oai.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0.0, **IGNORE_EOS
    )
    assert response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.store is False
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, **GREEDY
    )
    assert message.content[0].text == chat.choices[0].message.content
    usage = response.usage
    assert usage.input_tokens == len(CHAT_TEXT) and usage.output_tokens == 8
    assert usage.total_tokens == len(CHAT_TEXT) + 8
    assert usage.input_tokens_details.cached_tokens >= 0


def test_responses_take_instructions_and_messages(oai):
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]},
    ]
    response = oai.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=turns,
        max_output_tokens=6,
        temperature=0.0,
        **IGNORE_EOS,
    )
    messages = [{"role": "system", "content": "Be brief."}]
    messages += [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    messages += [{"role": "user", "content": "More"}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "Be brief." and response.max_output_tokens == 6
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_stream_the_standard_events(app, oai):
    whole = oai.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0.0, **IGNORE_EOS
    )
    stream = oai.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=12,
        temperature=0.0,
        stream=True,
        **IGNORE_EOS,
    )
    events = list(stream)
    types = [event.type for event in events]
    assert types[:4] == STREAM_EVENTS and types[-4:] == [*END_EVENTS, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == whole.output_text
    assert final.usage.output_tokens == 12


def test_the_client_s_stream_helper_gets_the_completed_response(app, oai):
    """`responses.stream(...)` folds the events into its final Response; a stop token ends
    the answer, so its status is `completed` (`response.completed` last)."""
    with Client(app.grpc_address, token=TOKEN, timeout=60) as grpc_client:
        tokens = (
            grpc_client.generate(CHAT_TEXT, max_tokens=12, temperature=0.0, ignore_eos=True)
            .completions[0]
            .token_ids
        )
    tokens = list(tokens)
    stop_at = {"stop_token_ids": [tokens[5]], "ignore_eos": True}
    with oai.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0.0, extra_body=stop_at
    ) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(texts)
    assert final.usage.output_tokens == tokens.index(tokens[5]) + 1
    whole = oai.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0.0, extra_body=stop_at
    )
    assert whole.status == "completed" and whole.output_text == final.output_text


def test_a_client_leaving_a_response_stream_frees_its_blocks(app, oai):
    stream = oai.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=900, temperature=0.0, stream=True,
        **IGNORE_EOS,
    )  # fmt: skip
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert_app_clean(app)


def test_response_refusals_name_the_field(app, oai):
    def respond(**fields) -> requests.Response:
        return post(app, "/v1/responses", {"model": MODEL, "input": "Hi", **fields})

    assert "stateless" in assert_invalid(respond(store=True), "store")
    assert respond(store=False, max_output_tokens=1).json()["store"] is False
    assert_invalid(respond(previous_response_id="resp_1"), "previous_response_id")
    assert_invalid(respond(tools=[{"type": "web_search"}]), "tools[0].type")
    assert_invalid(respond(text={"format": {"type": "json_object"}}), "text.format.type")
    assert_invalid(respond(input=[]), "input")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    assert_invalid(respond(input=image), "input")
    assert_invalid(respond(max_output_tokens=0), "max_output_tokens")
    assert_invalid(respond(temperature=-1.0), "temperature")
    assert_invalid(respond(stream=True, top_p=0.0), "top_p")
    assert_invalid(respond(reasoning={"effort": "high"}), "reasoning")
    assert_invalid(post(app, "/v1/responses", {"model": "x", "input": "a"}), "model", 404)
    assert post(app, "/v1/responses", {"model": MODEL, "input": "a"}, {"x": "y"}).status_code == 401
    with pytest.raises(openai.BadRequestError, match="store"):
        oai.responses.create(model=MODEL, input="Hi", store=True)
