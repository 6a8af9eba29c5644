"""Conversions between `pagedserve.v1` messages and the router's own types."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Literal, get_args

from pagedserve.cluster.api.auth import ANONYMOUS, Caller
from pagedserve.cluster.api.common import chat_prompt, sampling_params
from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.guided import guided_spec
from pagedserve.cluster.router.types import ClusterStats, WorkerView
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.engine.outputs import CompletionCollector
from pagedserve.workers.model.tokenizer import Tokenizer
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.guided import GuidedKind
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingKwargs, SamplingParams
from pagedserve.workers.protocol.stream import (
    FinishReason,
    RequestMetrics,
    StreamDelta,
    TokenLogprob,
    Usage,
)

# Sampling fields declared `optional`: unset means the SamplingParams default, not zero.
_OptionalSampling = Literal[
    "max_tokens", "temperature", "top_p", "top_k", "seed", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "prompt_logprobs",
]  # fmt: skip
_OPTIONAL_SAMPLING: tuple[_OptionalSampling, ...] = get_args(_OptionalSampling)
_KV_FIELDS = tuple(f.name for f in pb.KVUsage.DESCRIPTOR.fields)
# `WorkerStats` counts the proto carries as they are.
_WORKER_COUNTS = (
    "num_waiting",
    "num_running",
    "num_swapped",
    "num_steps",
    "events_published",
    "blocks_imported",
    "blocks_exported",
    "adopted_with_kv",
    "adopted_recomputed",
)


# ------------------------------------------------------------------ requests
def request_from_proto(
    message: pb.GenerateRequest, caller: Caller = ANONYMOUS, tokenizer: Tokenizer | None = None
) -> GenerateRequest:
    """The router's request for a `GenerateRequest`; raises `ApiError` naming a bad field.

    A chat (`messages`) becomes its prompt text by the chat template of `tokenizer`.
    """
    if message.messages and (message.prompt or message.prompt_token_ids):
        raise ApiError.invalid("messages: set messages or a prompt, not both", "messages")
    if not message.prompt and not message.prompt_token_ids and not message.messages:
        raise ApiError.invalid("prompt is empty: set prompt, prompt_token_ids or messages")
    prompt = message.prompt or None
    if message.messages:
        prompt = chat_prompt(_turns(message.messages), tokenizer)
    params = params_from_proto(message.sampling)
    try:
        return GenerateRequest(
            params=params,
            prompt=prompt,
            prompt_token_ids=list(message.prompt_token_ids) or None,
            request_id=message.request_id or None,
            priority=message.priority,
            cache_salt=message.cache_salt or None,
            timeout_s=message.timeout_s or None,  # 0: none (proto3's unset); checked there
            tenant=caller.tenant,
            cache_scope=caller.cache_scope,
            lora=message.model or None,
        )
    except RequestRejected as error:  # a field the request checks itself (prompt, timeout_s)
        raise ApiError.invalid(str(error)) from None


def _turns(messages: Iterable[pb.ChatMessage]) -> list[dict[str, str]]:
    """The chat as the template takes it; INVALID_ARGUMENT naming a message without content."""
    turns = []
    for i, message in enumerate(messages):
        if not message.HasField("content"):
            param = f"messages[{i}].content"
            raise ApiError.invalid(
                f"{param}: field required (role {message.role!r} needs content)", param
            )
        turns.append({"role": message.role, "content": message.content})
    return turns


def params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    kwargs = SamplingKwargs(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        include_stop_str_in_output=message.include_stop_str_in_output,
    )
    for name in _OPTIONAL_SAMPLING:
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    kwargs["guided"] = guided_spec(_guided_fields(message))
    kwargs["logit_bias"] = dict(message.logit_bias)
    kwargs["bad_words"] = list(message.bad_words)
    if message.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(message.allowed_token_ids)
    _beam_fields(message, kwargs)
    return sampling_params(**kwargs)


_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def _beam_fields(message: pb.SamplingParams, kwargs: SamplingKwargs) -> None:
    """Beam search's fields (an unset temperature is 0 with `use_beam_search`)."""
    if message.use_beam_search:
        kwargs["use_beam_search"] = True
        kwargs.setdefault("temperature", 0.0)
    if message.HasField("length_penalty"):
        kwargs["length_penalty"] = message.length_penalty
    if message.HasField("early_stopping"):
        value = message.early_stopping
        if value not in _EARLY_STOPPING:
            raise ApiError.invalid(
                f"early_stopping must be 'true', 'false' or 'never', got {value!r}"
            )
        kwargs["early_stopping"] = _EARLY_STOPPING[value]


def _guided_fields(message: pb.SamplingParams) -> dict[str, tuple[GuidedKind, Any, bool]]:
    """The structured-output fields the message set (`guided_spec` refuses more than one)."""
    sent: dict[str, tuple[GuidedKind, Any, bool]] = {}
    strict = message.guided_json_strict
    if message.HasField("guided_json"):
        sent["guided_json"] = (GuidedKind.JSON_SCHEMA, message.guided_json, strict)
    if message.HasField("guided_regex"):
        sent["guided_regex"] = (GuidedKind.REGEX, message.guided_regex, False)
    if message.guided_choice:
        sent["guided_choice"] = (GuidedKind.CHOICE, list(message.guided_choice), False)
    if message.HasField("guided_grammar"):
        sent["guided_grammar"] = (GuidedKind.GRAMMAR, message.guided_grammar, False)
    if message.guided_json_object:
        sent["guided_json_object"] = (GuidedKind.JSON_OBJECT, None, False)
    return sent


# ----------------------------------------------------------------- responses
def delta_to_proto(delta: StreamDelta) -> pb.GenerateStreamResponse:
    message = pb.GenerateStreamResponse(
        request_id=delta.request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=_reason(delta.finish_reason),
        worker_id=delta.worker_id or "",
    )
    _set_stop_reason(message, delta.stop_reason)
    if delta.usage is not None:
        message.usage.CopyFrom(usage_to_proto(delta.usage))
    if delta.metrics is not None:
        message.metrics.CopyFrom(metrics_to_proto(delta.metrics))
    message.logprobs.extend(logprobs_to_proto(delta.logprobs))
    message.prompt_logprobs.extend(logprobs_to_proto(delta.prompt_logprobs))
    return message


def response_to_proto(collector: CompletionCollector) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=collector.request_id,
        usage=usage_to_proto(collector.usage()),
        worker_id=collector.worker_id,
    )
    for result in collector.completions:
        completion = message.completions.add(
            index=result.index,
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=_reason(result.finish_reason),
        )
        _set_stop_reason(completion, result.stop_reason)
        if result.usage is not None:
            completion.usage.CopyFrom(usage_to_proto(result.usage))
        completion.logprobs.extend(logprobs_to_proto(result.logprobs))
        completion.prompt_logprobs.extend(logprobs_to_proto(result.prompt_logprobs))
        if result.cumulative_logprob is not None:
            completion.cumulative_logprob = result.cumulative_logprob
    first = collector.completions[0].metrics if collector.num_branches else None
    if first is not None:
        message.metrics.CopyFrom(metrics_to_proto(first))
    return message


def _reason(reason: FinishReason | None) -> str:
    """A finish reason as the wire spells it ("" while the branch runs)."""
    return "" if reason is None else str(reason)


def logprobs_to_proto(items: list[TokenLogprob | None] | None) -> list[pb.TokenLogprob]:
    """Log-probabilities as messages; a missing one (the first prompt token) has no logprob."""
    messages = []
    for item in items or ():
        if item is None:
            messages.append(pb.TokenLogprob())
            continue
        top = [
            pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in item.top
        ]
        messages.append(
            pb.TokenLogprob(
                token_id=item.token_id,
                token=item.token,
                logprob=item.logprob,
                rank=item.rank,
                top=top,
            )
        )
    return messages


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


def metrics_to_proto(metrics: RequestMetrics) -> pb.Metrics:
    return pb.Metrics(
        queue_time_s=metrics.queue_time or 0.0,
        ttft_s=metrics.ttft or 0.0,
        tpot_s=metrics.tpot or 0.0,
        e2e_s=metrics.e2e or 0.0,
        num_preemptions=metrics.num_preemptions,
    )


def _set_stop_reason(message: Any, stop_reason: str | int | None) -> None:
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        message.stop_token_id = stop_reason


# --------------------------------------------------------------------- state
def stats_to_proto(stats: ClusterStats) -> pb.GetStatsResponse:
    """`GetStatsResponse` from `RouterCore.cluster_stats()`: cluster-wide, whichever replica
    answers (router counters and in-flight counts summed over every replica; only this
    replica's own when the index actor, which holds the others', did not answer)."""
    counters = stats.cluster.counters if stats.cluster is not None else stats.router
    message = pb.GetStatsResponse(routing_policy=stats.policy, router_counters=counters.as_dict())
    for worker_id, worker in sorted(stats.workers.items()):
        if stats.cluster is not None:
            worker = dataclasses.replace(worker, inflight=stats.cluster.inflight.get(worker_id, 0))
        message.workers.append(_worker_stats(worker_id, worker))
    alive = [w for w in message.workers if w.alive]
    for name in _KV_FIELDS:
        setattr(message.kv, name, sum(getattr(w.kv, name) for w in alive))
    message.kv.block_size = alive[0].kv.block_size if alive else 0
    queries = message.kv.prefix_queries_tokens
    message.prefix_hit_rate = message.kv.prefix_hits_tokens / queries if queries else 0.0
    message.num_waiting = sum(w.num_waiting for w in alive)
    message.num_running = sum(w.num_running for w in alive)
    message.num_alive_workers = len(alive)
    _sum_spec(message.spec, [w.spec for w in alive])
    message.migrations.pulls = counters.pulls
    message.migrations.pulled_blocks = counters.pull_blocks
    message.migrations.pushes = counters.pushes
    message.migrations.pushed_blocks = counters.push_blocks
    message.migrations.moves = counters.moves
    message.migrations.blocks_imported = sum(w.blocks_imported for w in message.workers)
    message.migrations.blocks_exported = sum(w.blocks_exported for w in message.workers)
    if (index := stats.index) is not None:
        message.index.entries = index.entries
        message.index.max_entries = index.max_entries
        message.index.worker_blocks.update(index.workers)
        message.index.stale_workers.extend(index.stale_workers)
        message.index.resyncs = index.resyncs
        message.index.events_applied = index.events_applied
    return message


def _worker_stats(worker_id: str, view: WorkerView) -> pb.WorkerStats:
    message = pb.WorkerStats(worker_id=worker_id, alive=view.alive, inflight=view.inflight)
    stats = view.stats
    if stats is None:  # never answered a poll yet
        return message
    message.kv.CopyFrom(pb.KVUsage(**{name: getattr(stats.kv, name) for name in _KV_FIELDS}))
    message.prefix_hit_rate = stats.prefix_hit_rate
    for name in _WORKER_COUNTS:
        setattr(message, name, getattr(stats, name))
    message.role = str(stats.role)
    message.lora_adapters.extend(name for name, _ in stats.lora_adapters)
    message.resident_loras.extend(stats.resident_loras)
    _sum_spec(message.spec, [stats.spec])
    return message


_SPEC_SUMS = (
    "num_verified",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_emitted_tokens",
    "draft_time_s",
    "verify_time_s",
)


def _sum_spec(message: pb.SpecDecodeStats, parts: list) -> None:
    """Speculative counts summed over `parts` (`SpecStats` or their messages), rates derived."""
    for name in _SPEC_SUMS:
        setattr(message, name, sum(getattr(part, name) for part in parts))
    drafts, verified = message.num_draft_tokens, message.num_verified
    message.acceptance_rate = message.num_accepted_tokens / drafts if drafts else 0.0
    message.mean_accepted_length = message.num_emitted_tokens / verified if verified else 0.0


def workers_to_proto(workers: list[WorkerState]) -> pb.ListWorkersResponse:
    message = pb.ListWorkersResponse()
    for worker in sorted(workers, key=lambda w: w.worker_id):
        entry = message.workers.add(worker_id=worker.worker_id, alive=worker.alive)
        if (info := worker.info) is not None:
            entry.model = info.model
            entry.block_size = info.block_size
            entry.vocab_size = info.vocab_size
            entry.max_model_len = info.max_model_len
            entry.num_blocks = info.num_blocks
            entry.epoch = info.epoch
            entry.role = str(info.role)
    return message
