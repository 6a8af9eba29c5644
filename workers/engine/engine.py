"""The single-worker engine: add requests, step, get deltas. Synchronous, no Ray.

One `step()` plans a batch (Scheduler), moves blocks (swap, copy-on-write), runs the packed
forward (ModelRunner), samples one token per finished row (Sampler), and retires sequences that
stopped. Finished, aborted and timed-out sequences free their blocks in the same step.

With speculative decoding on (`EngineConfig.speculative`), a step first takes drafts for its
decoding sequences and verifies them after the forward (`workers/spec/decoding.py`).

A request comes in through `add_request` (`admission.py`). One with a grammar
(`SamplingParams.guided`) waits outside the queues until its grammar is compiled off the step
(`structured/guided_requests.py`); its tokens are masked in the sampler and advance its matcher
in `_append_token` (`docs/structured_outputs.md`).

A step returns deltas (`RequestDelta`, see `outputs.py`): per request it touched, only the new
tokens and final text of each branch. Each `Request` keeps what it has not yet reported, so a
step costs O(new tokens), never a copy of the whole output.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.kernels import get_kernel_ops
from pagedserve.workers.beam.groups import BeamSearch, decoder_for
from pagedserve.workers.beam.moves import EngineBeamMoves
from pagedserve.workers.engine.admission import EngineAdmission
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.executor import build_model_executor
from pagedserve.workers.engine.handoffs import EngineHandoffs
from pagedserve.workers.engine.intake import RequestIntake
from pagedserve.workers.engine.outputs import RequestDelta
from pagedserve.workers.engine.pausing import EnginePausing
from pagedserve.workers.engine.request import Request, RequestGroup, RequestStatus
from pagedserve.workers.engine.sizing import kv_layout, load_device, num_kv_blocks, serving_device
from pagedserve.workers.engine.stats import EngineReporting
from pagedserve.workers.engine.stop_checker import check_stop
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.kv.tier_load import build_tier_store, load_waiting_prefixes
from pagedserve.workers.kv.tiers import StepTierLoad
from pagedserve.workers.lora.engine_loras import EngineLoras
from pagedserve.workers.model.batch import Batch, build_batch
from pagedserve.workers.model.loader import LoadedModel, load_model, release_weights
from pagedserve.workers.protocol.errors import Overloaded, RequestRejected, RequestTooLarge
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stream import FinishReason
from pagedserve.workers.sampling.logprobs import take_prompt_logprobs
from pagedserve.workers.sampling.sampler import Sampler, sample_rows
from pagedserve.workers.scheduler.policy import PreemptionMode
from pagedserve.workers.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.workers.spec.decoding import SpecDecoding
from pagedserve.workers.spec.proposer import Proposer, make_proposer
from pagedserve.workers.spec.stats import SpecCounters
from pagedserve.workers.structured.guided_requests import GuidedRequests, guided_stop

_log = logging.getLogger(__name__)


class Engine(
    EngineAdmission, EngineHandoffs, EngineBeamMoves, EngineReporting, EngineLoras, EnginePausing
):
    """One worker's engine: model, KV pool, scheduler and sampler behind three calls.

    Args:
        config: the engine's config.
        loaded: an already loaded model (tests share one; the caller's, never released);
            loaded from `config` when None. Under tensor parallelism the engine loads it on
            the host, slices every rank's shard from it, then releases its weights: rank 0
            keeps its config, tokenizer and numbers (`docs/tensor-parallel.md`).
        role: its worker's role (`workers/protocol/role.py`): a `prefill` engine hands each
            fresh request off once its first token went out.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        role: WorkerRole = WorkerRole.MIXED,
    ) -> None:
        self.config = config
        self.role = role
        self.loaded = loaded or load_model(
            config.model, dtype=config.dtype, device=load_device(config), seed=config.seed
        )
        # Where the forward, the pool and sampling run; not where the model was loaded.
        self.device = serving_device(config, self.loaded)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off"
            )
        backend = config.attention_backend
        ops = get_kernel_ops(backend, self.device, split_decodes=config.split_decodes)
        num_blocks = num_kv_blocks(config, self.loaded)
        num_swap = config.num_swap_blocks
        if num_swap is None:
            num_swap = num_blocks if config.preemption_mode is PreemptionMode.SWAP else 0
        release_model = loaded is None and config.tensor_parallel_size > 1  # ours to drop
        self.kv_cache, self.runner = build_model_executor(
            config, self.loaded, self.device, ops, num_blocks, num_swap, release_model=release_model
        )
        if release_model:
            self.loaded = release_weights(self.loaded)  # every rank holds its shard now
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            allocation_mode=config.kv_allocation,
            watermark=config.watermark,
            num_swap_blocks=num_swap,
        )
        self.intake = RequestIntake(self.loaded, self.device, self.max_model_len, self.kv)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
                max_waiting=config.max_waiting,
                fair_share=config.fair_share,
                max_loras=config.max_loras,
            ),
            self.kv,
        )
        self._init_loras()
        self.sampler = Sampler(config.seed)
        self.beams = BeamSearch(self.scheduler, self.kv, decoder_for(self.tokenizer))
        self.guided = GuidedRequests(self.loaded, config.grammar_compile_timeout_s)
        self.proposer: Proposer | None = None
        if config.speculative is not None:
            self.proposer = make_proposer(
                config.speculative,
                target=self.loaded,
                device=self.device,
                ops=ops,
                target_model=config.model,
                target_seed=config.seed,
                block_size=config.block_size,
                num_blocks=num_blocks,
                max_model_len=self.max_model_len,
            )
        self.tiers = build_tier_store(
            self.kv_cache,
            kv_layout(config, self.loaded),
            host_bytes=config.kv_host_tier_bytes,
            disk_dir=config.kv_disk_tier_dir,
            disk_bytes=config.kv_disk_tier_bytes,
        )
        if self.tiers is not None:
            self.kv.pool.attach_lower_tiers(self.tiers)
        self.spec_counters = SpecCounters()
        self.speculation: SpecDecoding | None = None
        if self.proposer is not None:
            self.speculation = SpecDecoding(
                self.proposer,
                config.speculative.num_tokens,
                self.max_model_len,
                self.kv,
                self.sampler,
                self.loaded.eos_token_ids,
                self.spec_counters,
                self.guided,
            )
        self._groups: dict[str, RequestGroup] = {}
        self._paused: set[str] = set()  # ids of paused groups (see `pause`)
        self.num_steps = 0
        self.num_handoffs = 0
        # Adopted handoffs whose KV came with them, and those recomputed from their tokens.
        self.num_adopted_with_kv = 0
        self.num_adopted_recomputed = 0
        self.step_tier_loads: list[StepTierLoad] = []  # the last step's loads (for spans)
        # The name its deltas carry (set by the worker that runs it; None offline).
        self.worker_id: str | None = None

    def close(self) -> None:
        """Finish the disk tier's queued writes and release its directory."""
        self.guided.close()
        if self.tiers is not None:
            self.tiers.close()
        self.runner.close()

    # -------------------------------------------------------------- requests
    def abort(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestDelta | None:
        """End a request now (finish reason `reason`) and free its blocks.

        Returns:
            Its last delta, or None when it is unknown or already done.
        """
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._end_group(group, reason)
        return self._delta_for(group)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestDelta]:
        """Run one scheduling + forward + sampling step; the deltas of requests it touched."""
        touched: dict[str, RequestGroup] = {}
        self._expire_deadlines(touched)
        self._admit_compiled(touched)
        self._hand_off_prefilled(touched)
        drafted = []
        if self.speculation is not None:
            drafted = self.speculation.propose(self.scheduler.running, self._groups)
        self._load_from_tiers()
        plan = self.scheduler.schedule()
        self.beams.regroup(plan.preempted)
        self._end_unfittable(plan, touched)
        # Even in a step that runs no forward: a sequence swapped in now is running from here
        # on, and the next step reads its blocks as holding its KV. (When its swap-in was the
        # step's only work, skipping this left it reading whatever those blocks held before.)
        self._move_blocks(plan, touched)
        if plan.scheduled:
            self.num_steps += 1
            self._run(plan, touched)
        for request in drafted:  # drafts the plan had no room for
            request.draft_token_ids = []
        deltas = [self._delta_for(group) for group in touched.values()]
        self._drop_unloaded_loras()  # once the groups that finished here left
        return deltas

    def _end_unfittable(self, plan: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        """End (finish reason `error`) the groups that need more KV blocks than the pool holds
        even alone: a beam search whose diverged beams outgrew it."""
        for group_id in dict.fromkeys(request.group_id for request in plan.unfittable):
            group = self._groups.get(group_id)
            if group is None:
                continue
            _log.warning(
                "request %s: its %d beams need more KV blocks than the pool's %d; ended",
                group.request_id,
                len(group.branches),
                self.kv.pool.num_blocks,
            )
            self._end_group(group, FinishReason.ERROR)
            touched[group.request_id] = group

    def _load_from_tiers(self) -> None:
        """Before admission: the waiting requests' lower-tier prefixes, back into the pool."""
        if self.tiers is None:
            return
        slots = self.config.max_num_seqs - self.scheduler.num_active
        self.step_tier_loads = load_waiting_prefixes(
            self.kv, self.kv_cache, self.tiers, self.scheduler.waiting, slots
        )

    def _expire_deadlines(self, touched: dict[str, RequestGroup]) -> None:
        now = time.monotonic()
        for group in list(self._groups.values()):
            if group.deadline is not None and now >= group.deadline:
                self._end_group(group, FinishReason.TIMEOUT)
                touched[group.request_id] = group

    def _move_blocks(self, plan: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        """The step's KV copies, before its forward, in the one order that keeps every block's
        content (`SchedulerOutput` says why each holds):

            swap-ins    into blocks that were free when the plan took them; a swap slot one
                        reads may go to a swap-out planned later in the same step
            victims     swapped out or handed off: each reads its blocks before anything below
                        writes into them (one swapped in by this step takes what that brought)
            copies      copy-on-write, into new blocks (maybe a victim's, given up above)
        """
        if plan.swap_in:
            self.kv_cache.swap_in(plan.swap_in)
        if plan.swap_out:
            self.kv_cache.swap_out(plan.swap_out)
        for victim, block_ids in plan.moved:
            self._hand_off(victim, block_ids, touched)
        copies = plan.all_copies()
        if copies:
            self.kv_cache.copy_blocks(copies)

    def _run(self, plan: SchedulerOutput, touched: dict[str, RequestGroup]) -> None:
        started = time.perf_counter()
        batch = build_batch(plan.scheduled, self.kv, self.device)
        logits, hidden = self.runner.execute_pooling(
            batch.input_ids,
            batch.positions,
            batch.metadata,
            batch.logits_indices,
            batch.hidden_indices,
            self._lora_batch(plan.scheduled),
        )
        if batch.verified:
            num_other = logits.shape[0] - batch.num_verify_rows
            logits, verify_logits = logits[:num_other], logits[num_other:]
        logits = take_prompt_logprobs(batch, logits, self.tokenizer)
        for request, num_new in plan.scheduled.items():
            request.num_computed_tokens += num_new - len(request.draft_token_ids)
        if batch.pooled:
            self._pool(batch, hidden, touched)
        if batch.verified:
            now = time.monotonic()
            self.speculation.verify(batch.verified, verify_logits, self._append_token, now)
            for request in batch.verified:
                touched[request.group_id] = self._groups[request.group_id]
            self.spec_counters.verify_time_s += time.perf_counter() - started
            self.spec_counters.num_steps += 1
        if not batch.sampled:
            return
        sampled, logits = self.beams.take_rows(list(batch.sampled), logits, touched)
        rows = list(sampled)
        row_logits = list(range(len(rows)))
        for row, request in enumerate(sampled):
            for branch in self._fork_pending(request):
                rows.append(branch)
                row_logits.append(row)
        if not rows:
            return
        if len(rows) > len(sampled):
            logits = logits[torch.tensor(row_logits, device=logits.device)]
        eos_ids, backend = self.loaded.eos_token_ids, self.guided.backend
        tokens = sample_rows(self.sampler, logits, rows, eos_ids, self.tokenizer, backend)
        now = time.monotonic()
        for request, token in zip(rows, tokens, strict=True):
            self._append_token(request, token, now)
            touched[request.group_id] = self._groups[request.group_id]

    def _pool(self, batch: Batch, hidden: torch.Tensor, touched) -> None:
        """Embedding requests add this step's hidden rows; one whose prompt is done ends here
        with its embedding (finish reason `stop`), freeing its blocks (`engine/pooling.py`)."""
        row = 0
        for request, positions in batch.pooled:
            rows = hidden[row : row + len(positions)]
            row += len(positions)
            if request.pooling.add(rows, positions, request.prompt_len):
                self._finish(request, FinishReason.STOP)
                touched[request.group_id] = self._groups[request.group_id]

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
            request.unreported_text += request.detokenizer.append([token])
            stop_hit = request.detokenizer.stopped_by is not None
        reason = check_stop(
            request.params,
            request.num_output_tokens,
            token,
            self.loaded.eos_token_ids,
            stop_hit,
            max_model_len_hit=len(request.all_token_ids) >= self.max_model_len,
        )
        reason = guided_stop(request, token) or reason
        if reason is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        self.scheduler.finish(request)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        request.finish_reason = reason
        request.timings.finished = time.monotonic()
        if request.detokenizer is not None:
            request.unreported_text += request.detokenizer.flush()

    def _end_group(self, group: RequestGroup, reason: FinishReason) -> None:
        self.guided.drop(group.request_id)
        for branch in group.branches:
            self._finish(branch, reason)

    # ---------------------------------------------------------------- deltas
    def _delta_for(self, group: RequestGroup) -> RequestDelta:
        """What `group` has not reported yet; a finished group leaves the engine here."""
        if group.finished:
            self._groups.pop(group.request_id, None)
            self._paused.discard(group.request_id)
        return group.take_delta(self.worker_id)


__all__ = [
    "Engine",
    "EngineConfig",
    "Overloaded",
    "RequestRejected",
    "RequestStatus",
    "RequestTooLarge",
]
