"""LoRA adapters over the real cluster (two tiny-llama workers behind Serve's HTTP proxy):
one loaded at start (`lora_modules`), one loaded and unloaded at run time through vLLM's
endpoints; `model: <adapter>` selects it; `/v1/models` lists adapters with their parent; an
unknown adapter is a 404 naming it, a bad adapter a 400 naming the problem, with nothing else
disturbed. Adapters are made by `peft` in the test; their outputs equal an in-process engine's
on the same adapter (which equals HF + PEFT's merged model: tests/unit/workers/lora)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
import requests
from support.api_app import ENGINE, assert_app_clean, held_workers, running_app
from support.engine import Stepper, finish_clean, load
from support.lora import make_adapter

from pagedserve import LLM, SamplingParams
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

MODEL = "tiny-llama"
PROMPT = list(range(30, 45))
MAX_TOKENS = 8
LONG = 200  # tokens: the stream still runs for many steps after the unload


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    directory = tmp_path_factory.mktemp("api-loras")
    return {
        "sql": make_adapter(directory, "sql", 4, ("q_proj", "v_proj"), seed=11),
        "chat": make_adapter(directory, "chat", 8, ("gate_proj", "down_proj"), seed=12),
    }


@pytest.fixture(scope="module")
def app(serve_cluster, adapters):
    engine = {**ENGINE, "lora_modules": [f"sql={adapters['sql'].path}"]}
    with running_app("api-lora", engine=engine) as running:
        yield running


@pytest.fixture(scope="module")
def expected(adapters):
    """Each model's greedy text from an in-process engine (same tokenizer, same adapters)."""
    llm = LLM(
        loaded_model=load(MODEL),
        lora_modules=[f"{a.name}={a.path}" for a in adapters.values()],
        **ENGINE,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    texts = {}
    for name in (None, "sql", "chat"):
        llm.engine.add_request(name or "base", PROMPT, params, lora=name)
        texts[name] = Stepper(llm.engine).run_to_end()[name or "base"].outputs[0].text
    finish_clean(llm)
    return texts


@pytest.fixture(scope="module")
def long_expected(adapters):
    """`chat`'s greedy text of `LONG` tokens from an in-process engine."""
    llm = LLM(loaded_model=load(MODEL), lora_modules=[f"chat={adapters['chat'].path}"], **ENGINE)
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("r", PROMPT, params, lora="chat")
    text = Stepper(llm.engine).run_to_end()["r"].outputs[0].text
    finish_clean(llm)
    return text


def complete(app, model: str) -> requests.Response:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return requests.post(f"{app.http_url}/v1/completions", json=body, timeout=120)


def models(app) -> dict[str, str | None]:
    listed = requests.get(f"{app.http_url}/v1/models", timeout=60).json()["data"]
    return {card["id"]: card["parent"] for card in listed}


def worker_adapters(app) -> list[set[str]]:
    config = app.config
    handles = [
        ray.get_actor(config.actors.worker_name(i), namespace=config.namespace)
        for i in range(config.scaling.num_workers)
    ]
    stats = ray.get([h.stats.remote() for h in handles], timeout=60)
    return [{name for name, _ in s.lora_adapters} for s in stats]


def test_an_adapter_loaded_at_start_is_listed_and_served(app, expected):
    assert models(app) == {MODEL: None, "sql": MODEL}
    assert worker_adapters(app) == [{"sql"}, {"sql"}]
    base, sql = complete(app, MODEL), complete(app, "sql")
    assert base.status_code == sql.status_code == 200, (base.text, sql.text)
    assert base.json()["choices"][0]["text"] == expected[None]
    assert sql.json()["choices"][0]["text"] == expected["sql"]
    assert sql.json()["model"] == "sql"
    assert expected["sql"] != expected[None]
    assert_app_clean(app)


def test_load_serve_unload_at_run_time(app, adapters, expected):
    load_url = f"{app.http_url}/v1/load_lora_adapter"
    unload_url = f"{app.http_url}/v1/unload_lora_adapter"
    body = {"lora_name": "chat", "lora_path": adapters["chat"].path}
    assert requests.post(load_url, json=body, timeout=120).status_code == 200
    assert models(app) == {MODEL: None, "sql": MODEL, "chat": MODEL}
    assert worker_adapters(app) == [{"sql", "chat"}] * 2
    chat = complete(app, "chat")
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["text"] == expected["chat"]
    assert requests.post(unload_url, json={"lora_name": "chat"}, timeout=120).status_code == 200
    gone = complete(app, "chat")
    assert gone.status_code == 404 and "'chat'" in gone.json()["error"]["message"]
    assert models(app) == {MODEL: None, "sql": MODEL}
    again = requests.post(unload_url, json={"lora_name": "chat"}, timeout=120)
    assert again.status_code == 404 and "'chat'" in again.json()["error"]["message"]
    assert_app_clean(app)


def test_bad_adapters_are_refused_and_disturb_nothing(app, adapters, tmp_path, expected):
    too_big = tmp_path / "big"
    shutil.copytree(adapters["chat"].path, too_big)
    config = json.loads((too_big / "adapter_config.json").read_text())
    config["r"] = 64
    (too_big / "adapter_config.json").write_text(json.dumps(config))
    load_url = f"{app.http_url}/v1/load_lora_adapter"
    refused = requests.post(
        load_url, json={"lora_name": "big", "lora_path": str(too_big)}, timeout=120
    )
    assert refused.status_code == 400
    assert "rank 64 is over max_lora_rank 16" in refused.json()["error"]["message"]
    missing = requests.post(
        load_url, json={"lora_name": "nodir", "lora_path": str(tmp_path / "none")}, timeout=120
    )
    assert missing.status_code == 400 and "no adapter_config.json" in missing.text
    unknown = complete(app, "nope")
    assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]["message"]
    assert models(app) == {MODEL: None, "sql": MODEL}
    assert complete(app, "sql").json()["choices"][0]["text"] == expected["sql"]
    assert_app_clean(app)


def test_grpc_loads_serves_and_unloads_an_adapter(app, adapters, expected):
    """The same through gRPC: `LoadLoraAdapter`, `Generate` with `model`, `UnloadLoraAdapter`;
    `GetStats` shows each worker's adapters."""
    channel = grpc.insecure_channel(app.grpc_address)
    stub = serving_pb2_grpc.GenerationStub(channel)
    loaded = stub.LoadLoraAdapter(
        pb.LoadLoraAdapterRequest(lora_name="chat", lora_path=adapters["chat"].path), timeout=120
    )
    assert loaded.key.startswith("chat@")
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling, model="chat")
    answer = stub.Generate(request, timeout=120)
    assert answer.completions[0].text == expected["chat"]
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=60)
    assert [sorted(w.lora_adapters) for w in stats.workers] == [["chat", "sql"]] * 2
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="chat"), timeout=120)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(request, timeout=120)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'chat'" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        stub.LoadLoraAdapter(
            pb.LoadLoraAdapterRequest(lora_name="x", lora_path="/nope"), timeout=120
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    assert_app_clean(app)


def test_unloading_waits_for_the_request_in_flight_on_it(app, adapters, long_expected):
    """A stream on `chat` is open (its worker held after its first steps) when `chat` is
    unloaded: the unload answers once the worker is between steps, a new request on `chat` is
    then a 404, and the open stream runs to its end on `chat`, its text unchanged."""
    load_url = f"{app.http_url}/v1/load_lora_adapter"
    body = {"lora_name": "chat", "lora_path": adapters["chat"].path}
    assert requests.post(load_url, json=body, timeout=120).status_code == 200
    stream_body = {
        "model": "chat",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    unload_url = f"{app.http_url}/v1/unload_lora_adapter"
    with ThreadPoolExecutor(1) as pool:
        with held_workers(app, after_steps=2):
            stream = requests.post(
                f"{app.http_url}/v1/completions", json=stream_body, stream=True, timeout=120
            )
            assert stream.status_code == 200
            unloading = pool.submit(
                requests.post, unload_url, json={"lora_name": "chat"}, timeout=120
            )
        assert unloading.result(timeout=120).status_code == 200
    gone = complete(app, "chat")
    assert gone.status_code == 404 and "'chat'" in gone.json()["error"]["message"]
    text = ""
    for line in stream.iter_lines():
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
    assert text == long_expected
    assert_app_clean(app)
