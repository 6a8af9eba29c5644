"""Requests and responses of both front ends, converted without Ray or a network."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

import pytest

from pagedserve.cluster import client_cli
from pagedserve.cluster.api.common import (
    CompletionCollector,
    chat_prompt,
    find_malformed_text,
    merge_streams,
    sampling_params,
)
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.grpc.convert import (
    delta_to_proto,
    request_from_proto,
    response_to_proto,
    stats_to_proto,
)
from pagedserve.cluster.api.openai.api import (
    ChatChunks,
    CompletionChunks,
    error_json,
)
from pagedserve.cluster.api.openai.logprobs import CompletionExtras, echoed_prompts
from pagedserve.cluster.api.openai.models import ChatCompletionBody, CompletionBody, parse_body
from pagedserve.cluster.client import build_request
from pagedserve.cluster.index.stats import IndexStats
from pagedserve.cluster.router.types import (
    BackpressureLimits,
    ClusterStats,
    RouterCounters,
    WorkerView,
)
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.protocol.stats import KVUsage, WorkerStats
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMetrics,
    StreamDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)


# ----------------------------------------------------------------- gRPC in
def test_unset_sampling_fields_take_the_defaults():
    request = request_from_proto(pb.GenerateRequest(prompt="hi"))
    assert request.prompt == "hi" and request.prompt_token_ids is None
    assert (request.params.max_tokens, request.params.temperature, request.params.n) == (16, 1.0, 1)
    assert request.request_id is None and request.cache_salt is None and request.timeout_s is None


def test_every_field_reaches_the_router():
    sampling = pb.SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=7, stop=["x"], n=2,
        ignore_eos=True, stop_token_ids=[9], min_tokens=1, include_stop_str_in_output=True,
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.1,
    )  # fmt: skip
    message = pb.GenerateRequest(
        prompt_token_ids=[1, 2], sampling=sampling, priority=-1, cache_salt="tenant",
        request_id="r1", timeout_s=2.5,
    )  # fmt: skip
    request = request_from_proto(message)
    params = request.params
    assert request.prompt_token_ids == [1, 2] and request.prompt is None
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.0, 0.5, 3)
    assert (params.seed, params.stop, params.n, params.ignore_eos) == (7, ["x"], 2, True)
    assert (params.stop_token_ids, params.min_tokens) == ([9], 1)
    assert params.include_stop_str_in_output
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        -1.0,
        1.1,
    )
    unset = request_from_proto(pb.GenerateRequest(prompt="a")).params
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0, 0, 1)
    assert (request.priority, request.cache_salt, request.request_id) == (-1, "tenant", "r1")
    assert request.timeout_s == 2.5


@pytest.mark.parametrize(
    "message, field",
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), "prompt"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=0)), "top_p"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(n=0)), "n"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(n=65)), "n"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_k=-2)), "top_k"),
        (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(stop=[""])), "stop[0]"),
        (pb.GenerateRequest(prompt="a", timeout_s=-1), "timeout_s"),
        (
            pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(repetition_penalty=0)),
            "repetition_penalty",
        ),
    ],
)
def test_bad_fields_are_invalid_argument_naming_the_field(message, field):
    with pytest.raises(ApiError) as raised:
        request_from_proto(message)
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT
    assert raised.value.param == field and raised.value.message.startswith(field)


# ---------------------------------------------------------------- gRPC out
def final_delta(index: int, text: str, ids: list[int], **changes) -> StreamDelta:
    delta = StreamDelta(
        "r1",
        index,
        ids,
        text,
        finish_reason=FinishReason.LENGTH,
        worker_id="w0",
        usage=Usage(3, len(ids), 2),
        metrics=RequestMetrics(queue_time=0.1, ttft=0.2, e2e=0.5),
    )
    return dataclasses.replace(delta, **changes)


def test_deltas_and_whole_responses():
    first = StreamDelta("r1", 0, [65], "A", worker_id="w0")
    message = delta_to_proto(first)
    assert (message.text, list(message.token_ids), message.finish_reason) == ("A", [65], "")
    assert not message.HasField("usage")
    last = delta_to_proto(
        final_delta(0, "B", [66], finish_reason=FinishReason.STOP, stop_reason="B")
    )
    assert last.stop_string == "B" and last.usage.cached_tokens == 2
    assert delta_to_proto(final_delta(0, "", [258], stop_reason=258)).stop_token_id == 258

    collector = CompletionCollector()
    for delta in (first, final_delta(1, "xy", [120, 121]), final_delta(0, "B", [66])):
        collector.add(delta)
    response = response_to_proto(collector)
    assert [c.text for c in response.completions] == ["AB", "xy"]
    assert [list(c.token_ids) for c in response.completions] == [[65, 66], [120, 121]]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 3)
    assert response.request_id == "r1" and response.metrics.ttft_s == 0.2


def kv_usage(**counts) -> KVUsage:
    fields = {f.name: 0 for f in dataclasses.fields(KVUsage)}
    return KVUsage(**{**fields, "block_size": 8, "total_blocks": 10, "used_blocks": 4, **counts})


def worker_view(worker_id: str, alive: bool, inflight: int, kv: KVUsage, **counts) -> WorkerView:
    stats = WorkerStats(worker_id=worker_id, epoch="e", kv=kv, **counts)
    return WorkerView(worker_id, alive, inflight, None, stats)


def test_stats_sum_alive_workers_and_leave_dead_ones_out():
    stats = ClusterStats(
        workers={
            "w1": worker_view(
                "w1", True, 1, kv_usage(prefix_queries_tokens=10, prefix_hits_tokens=5),
                num_waiting=2, num_running=1, blocks_imported=3,
            ),
            "w0": worker_view("w0", True, 0, kv_usage(prefix_queries_tokens=10)),
            "w2": worker_view("w2", False, 0, kv_usage()),
        },
        router=RouterCounters(
            routed={"kv_aware": 9}, pulls=2, pull_blocks=6, pushes=1, push_blocks=4, moves=5
        ),
        limits=BackpressureLimits(None, None, 1.0),
        index=IndexStats(entries=4, max_entries=100, workers={"w0": 1, "w1": 3}),
        policy="kv_aware",
    )  # fmt: skip
    message = stats_to_proto(stats)
    assert [w.worker_id for w in message.workers] == ["w0", "w1", "w2"]
    assert (message.kv.total_blocks, message.kv.used_blocks, message.kv.block_size) == (20, 8, 8)
    assert message.prefix_hit_rate == 0.25 and message.num_alive_workers == 2
    assert (message.num_waiting, message.num_running) == (2, 1)
    assert (message.migrations.pulls, message.migrations.pulled_blocks) == (2, 6)
    assert message.migrations.blocks_imported == 3
    assert (message.migrations.pushes, message.migrations.pushed_blocks) == (1, 4)
    assert message.migrations.moves == 5
    assert message.router_counters["routed.kv_aware"] == 9
    assert dict(message.index.worker_blocks) == {"w0": 1, "w1": 3}
    table = client_cli.format_status(message)
    assert "w2" in table and "NO" in table and "25.0%" in table and "2/3" in table


# --------------------------------------------------------------- OpenAI in
MODEL = {"model": "tiny-llama"}


def bad_body(model, data) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_body(model, data)
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT
    return raised.value


@pytest.mark.parametrize(
    "data, param",
    [
        ({**MODEL, "prompt": "a", "tools": []}, "tools"),
        ({**MODEL, "prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({**MODEL, "prompt": "a", "max_tokens": 1.5}, "max_tokens"),
        ({**MODEL, "prompt": "a", "temperature": "hot"}, "temperature"),
        ({**MODEL, "prompt": "a", "n": True}, "n"),
        ({**MODEL, "prompt": {"text": "a"}}, "prompt"),
        ({**MODEL, "prompt": "a", "echo": "yes"}, "echo"),
        ({**MODEL, "prompt": "a", "logprobs": True}, "logprobs"),
        ({**MODEL, "prompt": "a", "repetition_penalty": "high"}, "repetition_penalty"),
        ({"prompt": "a"}, "model"),
        ({**MODEL}, "prompt"),
    ],
)
def test_completion_bodies_name_the_bad_field(data, param):
    assert bad_body(CompletionBody, data).param == param


@pytest.mark.parametrize(
    "data, param",
    [
        ({**MODEL, "messages": []}, "messages"),
        ({**MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({**MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**MODEL, "messages": [{"role": "user", "content": "a", "x": 1}]}, "messages[0].x"),
        ({**MODEL, "messages": [{"role": "user"}], "logprobs": 5}, "logprobs"),
        ({**MODEL, "messages": [{"role": "user"}], "top_logprobs": "2"}, "top_logprobs"),
    ],
)
def test_chat_bodies_name_the_bad_field(data, param):
    assert bad_body(ChatCompletionBody, data).param == param


def test_penalties_reach_the_sampling_params():
    body = parse_body(
        ChatCompletionBody,
        {**MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5,
         "frequency_penalty": -0.25, "repetition_penalty": 1.2},
    )  # fmt: skip
    params = sampling_params(max_tokens=4, **body.sampling_kwargs())
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.repetition_penalty == 1.2
    body = parse_body(CompletionBody, {**MODEL, "prompt": "a", "frequency_penalty": 2.5})
    with pytest.raises(ApiError, match=r"frequency_penalty must be in \[-2, 2\]") as raised:
        sampling_params(max_tokens=4, **body.sampling_kwargs())
    assert raised.value.param == "frequency_penalty"


def test_prompts_of_a_completion():
    def prompts(prompt):
        return parse_body(CompletionBody, {**MODEL, "prompt": prompt}).prompts()

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(ApiError, match="prompt is empty"):
        prompts([])


def test_sampling_fields_pass_through_only_when_given():
    body = parse_body(CompletionBody, {**MODEL, "prompt": "a", "top_k": 4, "stop": "x"})
    kwargs = body.sampling_kwargs()
    assert kwargs["top_k"] == 4 and kwargs["stop"] == "x" and "temperature" not in kwargs
    chat = parse_body(
        ChatCompletionBody,
        {**MODEL, "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 3},
    )
    assert chat.max_output_tokens() == 3


def test_malformed_text_is_found_by_path():
    assert find_malformed_text({"messages": [{"content": "ok"}, {"content": "\udcff"}]}, "") == (
        "messages[1].content"
    )
    assert find_malformed_text({"prompt": ["a", "\ud800"]}, "") == "prompt[1]"
    assert find_malformed_text({"prompt": "fine é"}, "") is None


def test_chat_without_a_template_uses_role_markers():
    body = parse_body(
        ChatCompletionBody,
        {**MODEL, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]},
    )  # fmt: skip
    prompt = chat_prompt(body.turns(), ByteTokenizer())
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


class _NoTemplate:
    """An HF-style tokenizer wrapper whose model has no chat template."""

    has_chat_template = False

    def apply_chat_template(self, messages):
        raise AssertionError("never called without a template")


@pytest.mark.parametrize("tokenizer", [None, _NoTemplate()])
def test_chat_for_a_model_without_a_template_is_invalid_argument(tokenizer):
    body = parse_body(ChatCompletionBody, {**MODEL, "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ApiError, match="messages: this model has no chat template") as caught:
        chat_prompt(body.turns(), tokenizer)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT and caught.value.param == "messages"
    message = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")])
    with pytest.raises(ApiError, match="no chat template") as caught:
        request_from_proto(message, tokenizer=tokenizer)
    assert caught.value.param == "messages"


def test_grpc_chat_is_rendered_by_the_router_s_tokenizer():
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    message = build_request(messages=turns, max_tokens=3)
    request = request_from_proto(message, tokenizer=ByteTokenizer())
    assert request.prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert request.prompt_token_ids is None and request.params.max_tokens == 3


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"prompt": "a"}, "set messages or a prompt, not both"),
        ({"prompt_token_ids": [1]}, "set messages or a prompt, not both"),
        ({"role": "wizard"}, r"messages\[0\].role must be one of"),
    ],
)
def test_bad_grpc_chats_name_the_field(fields, match):
    role = fields.pop("role", "user")
    message = pb.GenerateRequest(messages=[pb.ChatMessage(role=role, content="x")], **fields)
    with pytest.raises(ApiError, match=match) as caught:
        request_from_proto(message, tokenizer=ByteTokenizer())
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT


# -------------------------------------------------------------- OpenAI out
def test_completion_and_chat_bodies():
    collectors = [CompletionCollector(), CompletionCollector()]
    collectors[0].add(final_delta(0, "ab", [97, 98]))
    collectors[0].add(final_delta(1, "c", [99]))
    collectors[1].add(final_delta(0, "d", [100]))
    whole = CompletionChunks("cmpl-1", 7, "tiny-llama", n=2).whole(collectors)
    assert [(c.index, c.text) for c in whole.choices] == [(0, "ab"), (1, "c"), (2, "d")]
    assert whole.usage.prompt_tokens == 6 and whole.usage.completion_tokens == 4
    assert whole.usage.total_tokens == 10
    assert whole.usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 4}

    chat = ChatChunks("chatcmpl-1", 7, "tiny-llama", n=1)
    body = chat.whole(collectors[:1])
    assert body.object == "chat.completion"
    assert body.choices[0].message.model_dump() == {"role": "assistant", "content": "ab"}
    (start,) = chat.start()
    assert start.object == "chat.completion.chunk"
    assert start.choices[0].delta.model_dump() == {"role": "assistant", "content": ""}
    chunk = chat.chunk(0, final_delta(0, "z", [122], finish_reason=FinishReason.STOP))
    assert chunk.choices[0].delta.model_dump() == {"content": "z"}
    assert chunk.choices[0].finish_reason == "stop"


def test_error_json_uses_the_openai_shape():
    error = ApiError(ErrorCode.INVALID_ARGUMENT, "prompt_token_ids holds ids outside [0, 259)")
    assert error_json(error).model_dump() == {
        "error": {
            "message": "prompt_token_ids holds ids outside [0, 259)",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_argument",
        }
    }


def test_merge_streams_interleaves_and_fails_with_the_first_error():
    async def stream(tag: str, n: int, fail: bool = False):
        for i in range(n):
            await asyncio.sleep(0)
            yield StreamDelta(tag, i, [i], tag)
        if fail:
            raise ApiError.invalid("prompt is empty")

    async def run(*streams):
        return [(i, d.request_id) async for i, d in merge_streams(list(streams))]

    got = asyncio.run(run(stream("a", 2), stream("b", 3)))
    assert sorted(got) == [(0, "a"), (0, "a"), (1, "b"), (1, "b"), (1, "b")]
    with pytest.raises(ApiError, match="prompt is empty"):
        asyncio.run(run(stream("a", 100), stream("b", 1, fail=True)))


# ------------------------------------------------------------ client + CLI
def test_build_request_from_keywords():
    request = build_request("hi", max_tokens=4, stop="x", seed=None, n=2, request_id="r")
    assert request.prompt == "hi" and request.request_id == "r"
    assert request.sampling.max_tokens == 4 and list(request.sampling.stop) == ["x"]
    assert not request.sampling.HasField("seed") and request.sampling.n == 2
    assert list(build_request(prompt_token_ids=[1, 2]).prompt_token_ids) == [1, 2]
    with pytest.raises(TypeError, match="temprature"):
        build_request("hi", temprature=0.5)


def parse_cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client_cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_cli_generate_talks_to_the_cluster_by_default():
    args = parse_cli("generate", "hello", "--stream", "--max-tokens", "8")
    assert args.func is client_cli.run_generate
    assert (args.prompts, args.stream, args.max_tokens, args.offline) == (["hello"], True, 8, False)
    assert args.address == "localhost:9000"
    offline = parse_cli("generate", "hi", "--offline", "--block-size", "8")
    assert offline.offline and offline.block_size == 8
    status = parse_cli("status", "--address", "h:1", "--json")
    assert status.func is client_cli.run_status and status.address == "h:1" and status.json


def test_cli_chat_sends_a_user_turn_or_renders_it_offline(capsys):
    from pagedserve.cli import main

    assert client_cli._request_of("Hi", chat=True) == {
        "messages": [{"role": "user", "content": "Hi"}]
    }
    assert client_cli._request_of("Hi", chat=False) == {"prompt": "Hi"}
    argv = ["generate", "Hi", "--chat", "--offline", "--model", "tiny-llama", "--max-tokens", "3"]
    assert main([*argv, "--num-kv-blocks", "16", "--json"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert json.loads(line)["prompt"] == "<|user|>\nHi\n<|assistant|>\n"  # the template's


def test_cli_reports_an_unreachable_cluster(capsys):
    from pagedserve.cli import main

    code = main(["generate", "hi", "--address", "127.0.0.1:9", "--timeout", "5"])
    assert code == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "is `pagedserve serve` running at 127.0.0.1:9?" in err


def test_cli_status_json_round_trips():
    empty = ClusterStats(
        {}, RouterCounters(), BackpressureLimits(None, None, 1.0), None, "kv_aware"
    )
    message = stats_to_proto(empty)
    assert json.loads(client_cli._to_json(message))["routing_policy"] == "kv_aware"


def test_serve_flags_turn_auth_and_the_model_name_on(tmp_path):
    from pagedserve.cli import build_parser
    from pagedserve.cluster.app import build_app
    from pagedserve.cluster.serve.cli import cluster_config_from_args

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n", encoding="utf-8")
    args = build_parser().parse_args(
        ["serve", "--auth-tokens-file", str(tokens), "--served-model-name", "tiny"]
    )
    data = cluster_config_from_args(args, num_gpus=0)
    assert data["auth"] == {"tokens_file": str(tokens)} and data["served_model_name"] == "tiny"
    assert build_app(data) is not None


# ------------------------------------------------------------- log-probabilities
def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    text = ByteTokenizer().token_text
    alternatives = tuple(TopLogprob(t, v, text(t)) for t, v in top)
    return TokenLogprob(token_id, logprob, 1, text(token_id), alternatives)


def test_logprob_fields_reach_the_sampling_params():
    completion = parse_body(CompletionBody, {**MODEL, "prompt": "a", "logprobs": 2, "echo": True})
    assert completion.sampling_kwargs()["logprobs"] == 2
    assert completion.sampling_kwargs()["prompt_logprobs"] == 2  # echo + logprobs: the prompt's
    plain = parse_body(CompletionBody, {**MODEL, "prompt": "a", "logprobs": 0})
    assert plain.sampling_kwargs()["prompt_logprobs"] is None
    chat = {**MODEL, "messages": [{"role": "user", "content": "hi"}]}
    kwargs = parse_body(ChatCompletionBody, {**chat, "logprobs": True, "top_logprobs": 3})
    assert kwargs.sampling_kwargs()["logprobs"] == 3
    assert (
        parse_body(ChatCompletionBody, {**chat, "logprobs": True}).sampling_kwargs()["logprobs"]
        == 0
    )
    assert parse_body(ChatCompletionBody, chat).sampling_kwargs()["logprobs"] is None
    with pytest.raises(ApiError, match="top_logprobs: needs logprobs: true"):
        parse_body(ChatCompletionBody, {**chat, "top_logprobs": 3}).sampling_kwargs()
    with pytest.raises(ApiError, match=r"logprobs must be in \[0, 20\]"):
        sampling_params(
            max_tokens=1,
            **parse_body(
                CompletionBody, {**MODEL, "prompt": "a", "logprobs": 21}
            ).sampling_kwargs(),
        )


def test_completion_logprobs_and_echo_in_the_legacy_shape():
    """One request scores a text: echo + logprobs gives the prompt's log-probabilities too."""
    chunks = CompletionChunks("cmpl-1", 7, "tiny-llama", n=1)
    chunks.extras = CompletionExtras(echoed_prompts(["hi"], ByteTokenizer()), logprobs=True)
    delta = final_delta(
        0,
        "!",
        [33],
        logprobs=[lp(33, -0.5, (33, -0.5), (63, -1.5))],
        prompt_logprobs=[None, lp(105, -2.0, (101, -1.0))],
    )
    collector = CompletionCollector()
    collector.add(delta)
    (choice,) = chunks.whole([collector]).choices
    assert choice.text == "hi!"
    assert choice.logprobs.model_dump() == {
        "tokens": ["h", "i", "!"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"e": -1.0}, {"!": -0.5, "?": -1.5}],
        "text_offset": [0, 1, 2],
    }
    streamed = CompletionChunks("cmpl-1", 7, "tiny-llama", n=1)
    streamed.extras = CompletionExtras(echoed_prompts([[104, 105]], ByteTokenizer()), False)
    first = streamed.chunk(0, StreamDelta("r1", 0, [33], "!"))
    later = streamed.chunk(0, StreamDelta("r1", 0, [33], "!"))
    assert first.choices[0].text == "hi!" and later.choices[0].text == "!"
    assert first.choices[0].logprobs is None


def test_chat_logprobs_in_the_chat_shape():
    chat = ChatChunks("chatcmpl-1", 7, "tiny-llama", n=1)
    delta = final_delta(0, "é", [195, 169], logprobs=[lp(195, -0.1, (195, -0.1)), lp(169, -0.2)])
    chunk = chat.chunk(0, delta)
    content = chunk.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.1, -0.2]
    assert [t.model_dump() for t in content[0].top_logprobs] == [
        {"token": "\ufffd", "logprob": -0.1, "bytes": [239, 191, 189]}
    ]
    assert chat.chunk(0, final_delta(0, "z", [122])).choices[0].logprobs is None


def test_grpc_carries_logprobs_and_prompt_logprobs():
    delta = final_delta(
        0, "!", [33], logprobs=[lp(33, -0.5, (33, -0.5))], prompt_logprobs=[None, lp(105, -2.0)]
    )
    message = delta_to_proto(delta)
    (item,) = message.logprobs
    assert (item.token_id, item.token, item.logprob, item.rank) == (33, "!", -0.5, 1)
    assert [(t.token_id, t.token, t.logprob) for t in item.top] == [(33, "!", -0.5)]
    first, second = message.prompt_logprobs
    assert not first.HasField("logprob") and second.logprob == -2.0
    collector = CompletionCollector()
    collector.add(delta)
    (completion,) = response_to_proto(collector).completions
    assert len(completion.logprobs) == 1 and len(completion.prompt_logprobs) == 2
    sampling = pb.SamplingParams(logprobs=3, prompt_logprobs=0)
    params = request_from_proto(pb.GenerateRequest(prompt="a", sampling=sampling)).params
    assert (params.logprobs, params.prompt_logprobs) == (3, 0)
    unset = request_from_proto(pb.GenerateRequest(prompt="a")).params
    assert (unset.logprobs, unset.prompt_logprobs) == (None, None)


def test_stats_carry_each_worker_s_pd_role_and_the_handoff_counters():
    from pagedserve.workers.protocol.role import WorkerRole

    stats = ClusterStats(
        workers={
            "p": worker_view("p", True, 0, kv_usage(), role=WorkerRole.PREFILL),
            "d": worker_view(
                "d", True, 0, kv_usage(), role=WorkerRole.DECODE, adopted_with_kv=4,
                adopted_recomputed=1,
            ),
        },
        router=RouterCounters(pd_handoffs=5, pd_handoff_tokens=90, pd_fallbacks=1),
        limits=BackpressureLimits(None, None, 1.0),
        index=None,
        policy="kv_aware",
    )  # fmt: skip
    message = stats_to_proto(stats)
    decode, prefill = message.workers
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (decode.adopted_with_kv, decode.adopted_recomputed) == (4, 1)
    counters = message.router_counters
    assert (counters["pd.handoffs"], counters["pd.handoff_tokens"], counters["pd.fallbacks"]) == (
        5,
        90,
        1,
    )
