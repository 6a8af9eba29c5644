"""What an engine checks and builds when a request arrives: its prompt tokenized and checked
against the vocabulary, the model's context and the KV pool, then one `Request` per branch
with its arrival number, generator and detokenizer. A fresh request and an adopted handoff
get their branches here alike."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from pagedserve.workers.engine.detokenizer import IncrementalDetokenizer
from pagedserve.workers.engine.request import Request
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.protocol.errors import RequestRejected, RequestTooLarge
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.sampling.sampler import make_generator
from pagedserve.workers.structured.masking import bad_word_token_ids


class RequestIntake:
    """Validates prompts and builds branches for one engine.

    Args:
        loaded: the engine's model (its tokenizer and vocabulary).
        device: where the engine samples (seeded rows' generators live there).
        max_model_len: the engine's context in tokens.
        kv: the engine's KV manager (whether a sequence can ever fit its pool).
    """

    def __init__(
        self, loaded: LoadedModel, device: torch.device, max_model_len: int, kv: KVCacheManager
    ) -> None:
        self.loaded = loaded
        self.device = device
        self.tokenizer = loaded.tokenizer
        self.max_model_len = max_model_len
        self.kv = kv
        self._arrivals = itertools.count()

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids) and token ids. Raises `RequestRejected`."""
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

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raises `RequestRejected` past the context, `RequestTooLarge` past the pool."""
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

    def check_token_ids(self, params: SamplingParams) -> None:
        """Raises `RequestRejected` naming the field whose token ids are outside the vocabulary."""
        vocab = self.loaded.vocab_size
        for name, ids in params.token_ids_to_check().items():
            bad = [t for t in ids if t >= vocab]
            if bad and name != "stop_token_ids":  # a stop id past the vocabulary never matches
                raise RequestRejected(
                    f"{name} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}"
                )
        if params.bad_words and self.tokenizer is None:
            raise RequestRejected("bad_words needs a model with a tokenizer")

    def new_branch(
        self, request_id, index, token_ids, params, priority, extra_keys, deadline, now
    ) -> Request:
        """Branch `index` of request `request_id`, arrived at `now`."""
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
            generator=make_generator(params.seed, self.device),
        )
        request.timings.arrival = now
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output
            )
            request.bad_words_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        return request

    def adopted_branch(self, handoff: RequestHandoff, now: float) -> Request:
        """The one branch of a request a peer handed off, as the peer left it: its tokens,
        timings, sampler state and deadline; what its client was already sent (the tokens,
        and part of their text) is not reported again."""
        request = self.new_branch(
            handoff.request_id,
            0,
            handoff.prompt_token_ids,
            handoff.params,
            handoff.priority,
            handoff.cache_extra_keys,
            None,
            now,
        )
        request.all_token_ids = handoff.all_token_ids
        request.tenant = handoff.tenant
        request.movable = True
        if handoff.timings is not None:  # timed from its arrival at the source
            handoff.timings.restore(request.timings, now)
        request.timings.num_preemptions = handoff.num_preemptions
        if request.generator is not None and handoff.generator_state is not None:
            request.generator.set_state(handoff.generator_state)
        request.num_reported_tokens = len(handoff.output_token_ids)
        if request.detokenizer is not None:
            request.detokenizer.resume(handoff.output_token_ids, handoff.emitted_text_chars)
        if handoff.deadline_remaining_s is not None:
            request.deadline = now + handoff.deadline_remaining_s
        return request
