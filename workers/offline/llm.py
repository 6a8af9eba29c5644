"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.engine.outputs import OutputBuilder, RequestOutput
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stats import KVUsage, SpecStats
from pagedserve.workers.scheduler.policy import PreemptionMode

Prompt = str | Sequence[int]


class LLM:
    """Generate offline with one engine in this process.

    Args:
        model: a built-in name ("smollm2-135m", the default when None; "tiny-llama" for fast
            tests), a local checkpoint directory or a ".gguf" file.
        loaded_model: an already loaded model to reuse (tests share one across engines).
        **config: any `EngineConfig` field (block_size, num_kv_blocks, kv_cache_bytes,
            attention_backend, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
            preemption_mode, kv_allocation, dtype, seed, speculative, ...).
    """

    def __init__(
        self, model: str | None = None, *, loaded_model: LoadedModel | None = None, **config
    ) -> None:
        engine_config = EngineConfig(model=model, **config)
        if engine_config.preemption_mode is PreemptionMode.MOVE:
            raise ValueError(
                "preemption_mode='move' hands requests to peer workers and needs a cluster "
                "(pagedserve serve); offline, use 'recompute' or 'swap'"
            )
        self.engine = Engine(engine_config, loaded=loaded_model)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        priority: int | Sequence[int] = 0,
        timeout_s: float | None = None,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        `lora`: the LoRA adapter (loaded by `lora_modules` or `engine.load_lora`) of every
        prompt, or one per prompt (None: the base model); prompts of several adapters run in
        the same batches (`docs/lora.md`).

        A prompt that can never be served (bad input, or too large for the context or pool)
        gets an output with `error` set and no completions; the others run.
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"lora: {len(loras)} given for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        builders: dict[str, OutputBuilder] = {}
        order: list[str] = []
        for prompt, param, prio, adapter in zip(prompts, params, priorities, loras, strict=True):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    param,
                    priority=prio,
                    cache_salt=cache_salt,
                    timeout_s=timeout_s,
                    lora=adapter,
                )
                builders[request_id] = OutputBuilder(request_id)
            except RequestRejected as error:
                results[request_id] = _rejected(request_id, prompt, str(error))
        # The engine reports deltas; this is the one place offline that adds them up.
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                builder = builders.get(delta.request_id)
                if builder is None:  # not one of ours (someone else shares the engine)
                    continue
                builder.add(delta)
                if delta.finished:
                    results[delta.request_id] = builders.pop(delta.request_id).build()
        return [results[request_id] for request_id in order]

    def stats(self) -> KVUsage:
        """The KV pool's usage breakdown."""
        return self.engine.usage()

    def spec_stats(self) -> SpecStats:
        """Speculative decoding so far: acceptance rate, mean accepted length, draft and
        verify time per step (all zero when `speculative` is off)."""
        return self.engine.spec_stats()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _rejected(request_id: str, prompt: Prompt, message: str) -> RequestOutput:
    is_text = isinstance(prompt, str)
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if is_text else None,
        prompt_token_ids=[] if is_text else list(prompt),
        outputs=[],
        finished=True,
        error=message,
    )
