"""The single-worker engine: add requests, step, get outputs. Synchronous, no Ray.

One `step()` plans a batch (Scheduler), moves blocks (swap, copy-on-write), runs the packed
forward (ModelRunner), samples one token per finished row (Sampler), and retires sequences that
stopped. Finished, aborted and timed-out sequences free their blocks in the same step.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels import get_kernel_ops
from pagedserve.workers.batch import build_batch
from pagedserve.workers.detokenizer import IncrementalDetokenizer
from pagedserve.workers.engine_config import (
    CUDA_KV_MEMORY_FRACTION,
    DEFAULT_CPU_KV_CACHE_BYTES,
    EngineConfig,
)
from pagedserve.workers.errors import Overloaded, RequestRejected, RequestTooLarge
from pagedserve.workers.handoff import RequestHandoff, adopt_kv
from pagedserve.workers.kv_cache import KVCache
from pagedserve.workers.kv_cache_manager import KVCacheManager, KVUsage
from pagedserve.workers.logprobs import (
    completion_logprobs,
    raw_logits,
    record_sample_logprobs,
    request_prompt_logprobs,
    take_prompt_logprobs,
)
from pagedserve.workers.model_loader import LoadedModel, load_model
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.workers.request import Request, RequestStatus
from pagedserve.workers.sampler import (
    Sampler,
    apply_penalties,
    make_generator,
    suppress_stop_tokens,
)
from pagedserve.workers.sampling_params import SamplingParams
from pagedserve.workers.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.workers.stop_checker import FinishReason, check_stop


@dataclass
class _RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    branches: list[Request]
    arrival: float
    deadline: float | None
    handoff: RequestHandoff | None = None

    @property
    def finished(self) -> bool:
        return all(branch.is_finished for branch in self.branches)


class Engine:
    """One worker's engine: model, KV pool, scheduler and sampler behind three calls.

    Args:
        config: the engine's config.
        loaded: an already loaded model (tests share one); loaded from `config` when None.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(
            config.model, dtype=config.dtype, device=config.device, seed=config.seed
        )
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off"
            )
        ops = get_kernel_ops(config.attention_backend, self.loaded.device)
        num_blocks = self._num_kv_blocks()
        num_swap = config.num_swap_blocks
        if num_swap is None:
            num_swap = num_blocks if config.preemption_mode == "swap" else 0
        self.kv_cache = KVCache(
            num_layers=self.loaded.num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=self.loaded.num_kv_heads,
            head_dim=self.loaded.head_dim,
            dtype=self.loaded.dtype,
            device=self.loaded.device,
            num_swap_blocks=num_swap,
            ops=ops,
        )
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            allocation_mode=config.kv_allocation,
            watermark=config.watermark,
            num_swap_blocks=num_swap,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
                max_waiting=config.max_waiting,
            ),
            self.kv,
        )
        self.runner = ModelRunner(self.loaded, self.kv_cache, ops)
        self.sampler = Sampler(config.seed)
        self._groups: dict[str, _RequestGroup] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_handoffs = 0

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_bytes
        if budget is None:
            if self.loaded.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.loaded.device)
                budget = int(free * CUDA_KV_MEMORY_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        return KVCache.num_blocks_for_budget(
            budget,
            block_size=self.config.block_size,
            num_layers=self.loaded.num_layers,
            num_kv_heads=self.loaded.num_kv_heads,
            head_dim=self.loaded.head_dim,
            dtype=self.loaded.dtype,
        )

    # -------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Queue a request. Raises `RequestRejected` naming the problem if it can never run."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise RequestRejected(f"request_id {request_id!r} is already in flight")
        if self.scheduler.waiting_full():
            raise Overloaded(f"the engine's waiting queue is full ({self.config.max_waiting})")
        prompt_text, token_ids = self._tokenize(prompt)
        self._check_fits(len(token_ids), params)
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        extra_keys = (self.loaded.name,) + (() if cache_salt is None else (cache_salt,))
        branches = [
            self._new_branch(
                request_id, j, token_ids, params.for_branch(j), priority, extra_keys, deadline, now
            )
            for j in range(params.n)
        ]
        first, *others = branches
        first.pending_branches = others
        first.movable = params.n == 1 and params.prompt_logprobs is None  # scored here
        self._groups[request_id] = _RequestGroup(
            request_id, prompt_text, list(token_ids), branches, now, deadline
        )
        self.scheduler.add(first)

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("prompt is empty")
            if self.tokenizer is None:
                raise RequestRejected(
                    "prompt is text but the model has no tokenizer; pass prompt_token_ids"
                )
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise RequestRejected("prompt encodes to no tokens")
            return prompt, token_ids
        token_ids = list(prompt)
        if not token_ids:
            raise RequestRejected("prompt_token_ids is empty")
        vocab = self.loaded.vocab_size
        bad = [
            t
            for t in token_ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise RequestRejected(
                f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        return None, token_ids

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if not self.kv.can_fit_ever(total):
            raise RequestTooLarge(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) can never fit "
                f"in the KV pool ({self.kv.pool.num_blocks} blocks of {self.kv.block_size} "
                f"tokens, {self.kv.reserve_blocks} kept in reserve)"
            )

    def _new_branch(
        self, request_id, index, token_ids, params, priority, extra_keys, deadline, now
    ) -> Request:
        request = Request(
            request_id=f"{request_id}#{index}",
            group_id=request_id,
            branch_index=index,
            prompt_len=len(token_ids),
            all_token_ids=list(token_ids),
            params=params,
            cache_extra_keys=extra_keys,
            priority=priority,
            arrival_order=next(self._arrivals),
            deadline=deadline,
            generator=make_generator(params.seed, self.loaded.device),
        )
        request.timings.arrival = now
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output
            )
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks. None when it is unknown or already done."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._end_group(group, FinishReason.ABORT)
        return self._pop_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + sampling step; outputs of requests it touched."""
        touched: dict[str, _RequestGroup] = {}
        self._expire_deadlines(touched)
        plan = self.scheduler.schedule()
        if plan.swap_out:
            self.kv_cache.swap_out(plan.swap_out)
        for victim, block_ids in plan.moved:  # before anything writes into their blocks
            self._hand_off(victim, block_ids, touched)
        # Swap-ins land even in a step that schedules nothing (a request swapped in is first
        # scheduled in the next step, which would otherwise read blocks never filled).
        self._move_blocks(plan)
        if plan.scheduled:
            self.num_steps += 1
            self._run(plan, touched)
        return [self._output_for(group) for group in touched.values()]

    def _expire_deadlines(self, touched: dict[str, _RequestGroup]) -> None:
        now = time.monotonic()
        for group in list(self._groups.values()):
            if group.deadline is not None and now >= group.deadline:
                self._end_group(group, FinishReason.TIMEOUT)
                touched[group.request_id] = group

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        # Swapped-out and moved KV left in `step` already, before these writes.
        if plan.swap_in:
            self.kv_cache.swap_in(plan.swap_in)
        copies = plan.all_copies()
        if copies:
            self.kv_cache.copy_blocks(copies)

    def _run(self, plan: SchedulerOutput, touched: dict[str, _RequestGroup]) -> None:
        batch = build_batch(plan.scheduled, self.kv, self.loaded.device)
        logits = self.runner.execute(
            batch.input_ids, batch.positions, batch.metadata, batch.logits_indices
        )
        logits = take_prompt_logprobs(batch, logits, self.tokenizer)
        for request, num_new in plan.scheduled.items():
            request.num_computed_tokens += num_new
        rows = list(batch.sampled)
        row_logits = list(range(len(rows)))
        for row, request in enumerate(batch.sampled):
            for branch in self._fork_pending(request):
                rows.append(branch)
                row_logits.append(row)
        if len(rows) > len(batch.sampled):
            logits = logits[torch.tensor(row_logits, device=logits.device)]
        params = [r.params for r in rows]
        raw = raw_logits(logits, params)  # log-probabilities are of the model's own logits
        suppress_stop_tokens(
            logits, params, [r.num_output_tokens for r in rows], self.loaded.eos_token_ids
        )
        apply_penalties(
            logits, params, [r.all_token_ids for r in rows], [r.prompt_len for r in rows]
        )
        tokens = self.sampler.sample(logits, params, [r.generator for r in rows]).tolist()
        record_sample_logprobs(rows, raw, tokens, self.tokenizer)
        now = time.monotonic()
        for request, token in zip(rows, tokens, strict=True):
            self._append_token(request, token, now)
            touched[request.group_id] = self._groups[request.group_id]

    def _hand_off(self, victim: Request, block_ids: list[int], touched) -> None:
        """Pack a preempted sequence for a peer and end it here with finish reason `moved`."""
        group = self._groups[victim.group_id]
        packed = self.kv_cache.export_blocks(block_ids) if block_ids else None
        now = time.monotonic()
        group.handoff = RequestHandoff(
            request_id=group.request_id,
            prompt_token_ids=list(group.prompt_token_ids),
            output_token_ids=list(victim.output_token_ids),
            num_computed_tokens=victim.num_computed_tokens if packed is not None else 0,
            params=victim.params,
            priority=victim.priority,
            cache_extra_keys=victim.cache_extra_keys,
            block_size=self.kv.block_size,
            packed_kv=packed,
            generator_state=None if victim.generator is None else victim.generator.get_state(),
            num_preemptions=victim.timings.num_preemptions,
            deadline_remaining_s=None if group.deadline is None else group.deadline - now,
            emitted_text_chars=len(victim.detokenizer.emitted_text) if victim.detokenizer else 0,
        )
        victim.finish_reason = FinishReason.MOVED
        victim.timings.finished = now
        touched[group.request_id] = group
        self.num_handoffs += 1

    def adopt(self, handoff: RequestHandoff) -> None:
        """Continue a sequence a peer handed off: reuse cached blocks, write back its KV, go on.

        Without room for its KV the sequence recomputes it from its tokens (same output).
        """
        handoff.check_compatible(self.kv.block_size, self.loaded.name)
        if handoff.request_id in self._groups:
            raise RequestRejected(f"request_id {handoff.request_id!r} is already in flight")
        now = time.monotonic()
        prompt = handoff.prompt_token_ids
        request = self._new_branch(
            handoff.request_id,
            0,
            prompt,
            handoff.params,
            handoff.priority,
            handoff.cache_extra_keys,
            None,
            now,
        )
        request.all_token_ids = handoff.all_token_ids
        request.movable = True
        request.timings.num_preemptions = handoff.num_preemptions
        if request.generator is not None and handoff.generator_state is not None:
            request.generator.set_state(handoff.generator_state)
        if request.detokenizer is not None:
            request.detokenizer.append(handoff.output_token_ids)
        deadline = None
        if handoff.deadline_remaining_s is not None:
            deadline = now + handoff.deadline_remaining_s
        request.deadline = deadline
        self._groups[handoff.request_id] = _RequestGroup(
            handoff.request_id, None, list(prompt), [request], now, deadline
        )
        if not adopt_kv(self.kv, self.kv_cache, request, handoff):
            self.scheduler.add(request)  # no room for its KV: recompute it from the tokens
            return
        request.timings.first_scheduled = now
        self.scheduler.add_running(request)

    def _fork_pending(self, request: Request) -> list[Request]:
        """Once a prompt is computed, its sibling branches share its blocks (no re-prefill)."""
        branches, request.pending_branches = request.pending_branches, []
        for branch in branches:
            self.kv.fork(request.request_id, branch.request_id)
            branch.all_token_ids = list(request.all_token_ids)
            branch.num_computed_tokens = request.num_computed_tokens
            branch.num_cached_tokens = request.num_cached_tokens
            branch.timings.first_scheduled = request.timings.first_scheduled
            self.scheduler.add_running(branch)
        return branches

    def _append_token(self, request: Request, token: int, now: float) -> None:
        request.all_token_ids.append(token)
        request.timings.on_token(now)
        stop_hit = False
        if request.detokenizer is not None:
            request.detokenizer.append([token])
            stop_hit = request.detokenizer.stopped_by is not None
        reason = check_stop(
            request.params,
            request.output_token_ids,
            self.loaded.eos_token_ids,
            stop_hit,
            max_model_len_hit=len(request.all_token_ids) >= self.max_model_len,
        )
        if reason is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        self.scheduler.finish(request)
        request.finish_reason = reason
        request.timings.finished = time.monotonic()
        if request.detokenizer is not None:
            request.detokenizer.flush()

    def _end_group(self, group: _RequestGroup, reason: FinishReason) -> None:
        for branch in group.branches:
            self._finish(branch, reason)

    # --------------------------------------------------------------- outputs
    def _output_for(self, group: _RequestGroup) -> RequestOutput:
        if group.finished:
            return self._pop_output(group)
        return self._make_output(group)

    def _pop_output(self, group: _RequestGroup) -> RequestOutput:
        self._groups.pop(group.request_id, None)
        return self._make_output(group)

    def _make_output(self, group: _RequestGroup) -> RequestOutput:
        outputs = []
        for branch in group.branches:
            # Only emitted text: a tail that may still become a stop string is held back.
            text = branch.detokenizer.emitted_text if branch.detokenizer is not None else ""
            reason = branch.finish_reason
            outputs.append(
                CompletionOutput(
                    index=branch.branch_index,
                    text=text,
                    token_ids=list(branch.output_token_ids),
                    finish_reason=None if reason is None else str(reason),
                    stop_reason=branch.detokenizer.stopped_by if branch.detokenizer else None,
                    logprobs=completion_logprobs(branch),
                )
            )
        first = group.branches[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=_metrics(group),
            handoff=group.handoff,
            prompt_logprobs=request_prompt_logprobs(first),
        )

    # ----------------------------------------------------------------- stats
    def usage(self) -> KVUsage:
        return self.kv.usage()

    def stats(self) -> dict:
        usage = self.kv.usage()
        return {
            "kv": usage,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_swapped": len(self.scheduler.swapped),
            "num_steps": self.num_steps,
            "num_handoffs": self.num_handoffs,
            "kv_cache_device_bytes": self.kv_cache.device_bytes,
            "kv_cache_swap_bytes": self.kv_cache.swap_bytes,
        }


def _metrics(group: _RequestGroup) -> RequestMetrics:
    first = group.branches[0].timings
    metrics = RequestMetrics(num_preemptions=sum(b.timings.num_preemptions for b in group.branches))
    if first.first_scheduled is not None:
        metrics.queue_time = first.first_scheduled - group.arrival
    if first.first_token is not None:
        metrics.ttft = first.first_token - group.arrival
        metrics.inter_token_latencies = list(first.inter_token_latencies)
        if first.inter_token_latencies:
            metrics.tpot = sum(first.inter_token_latencies) / len(first.inter_token_latencies)
    finished = [b.timings.finished for b in group.branches if b.timings.finished is not None]
    if group.finished and finished:
        metrics.e2e = max(finished) - group.arrival
    return metrics


__all__ = [
    "Engine",
    "EngineConfig",
    "Overloaded",
    "RequestRejected",
    "RequestStatus",
    "RequestTooLarge",
]
