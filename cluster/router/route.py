"""Where a prompt goes (a mixin of `RouterCore`): its size checked before any work, tokenized
off the event loop, its full blocks hashed with its cache key, matched against this router's
prefix view, and a worker picked by the routing policy among the routable ones (P/D roles,
LoRA residency and tier costs weighed); its prefix pulled from a peer when that beats
computing it (`cluster/pool/migration.py`).

Routing makes no remote call: each `RouterCore` keeps its own copy of the prefix index
(`PrefixView`, `cluster/index/view.py`), and a background task follows the index actor's change
feed into it (`cluster/router/router.py`). Load is counted by the router as well as reported by
workers: every request sent to a worker counts in its `inflight` until its stream ends, so the
policy sees a burst before any report shows it (`cluster/router/worker_state.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedserve.cluster.router.tracing import record_decision
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.worker_roles import PREFILL_PHASE, RoleFilter
from pagedserve.workers.kv.block_hash import cache_key, hash_full_blocks
from pagedserve.workers.protocol.errors import NoWorkerAvailable, RequestRejected
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams


class RouterRouting:
    """The routing endpoints `RouterCore` inherits. Owns nothing of its own: it uses the
    core's `config`, `tokenizer`, `model_name`, `block_size`, `workers`, `routable`, `policy`,
    `view`, `tier_costs`, `counters`, `metrics`, `migrations` and `lora_candidates`."""

    async def _tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; text is measured first, then tokenized off the event loop."""
        if request.prompt_token_ids is not None:  # not both: `GenerateRequest` checked it
            check_prompt_size(len(request.prompt_token_ids), self.config.limits.max_prompt_chars)
            return list(request.prompt_token_ids)
        if not request.prompt:
            raise RequestRejected("prompt is empty")
        if self.tokenizer is None:
            raise RequestRejected("the model has no tokenizer; send prompt_token_ids")
        check_prompt_size(len(request.prompt), self.config.limits.max_prompt_chars)
        return await asyncio.to_thread(self.tokenizer.encode, request.prompt)

    async def prompt_length(self, prompt: str | list[int]) -> int:
        """Tokens in a prompt, checked for size first and tokenized off the event loop."""
        if isinstance(prompt, str):
            request = GenerateRequest(params=SamplingParams(), prompt=prompt)
        else:
            request = GenerateRequest(params=SamplingParams(), prompt_token_ids=prompt)
        return len(await self._tokenize(request))

    async def route(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        span: Any = None,
        exclude: frozenset[str] = frozenset(),
        lora_key: str | None = None,
    ) -> tuple[WorkerState, int]:
        """Pick a worker for a prompt; pull its prefix from a peer when that beats prefill.

        `span`: the `route` span, given the decision (and parent of a pull), if traced.
        `exclude`: workers not to pick (they refused this request already).
        `lora_key`: the request's LoRA adapter key (its blocks hash with it).
        """
        ranking = self.routable.current()  # loads kept current per worker change
        if self.config.disaggregated:  # P/D: a fresh prompt goes to a worker that prefills
            exclude |= self._unfit(PREFILL_PHASE, exclude)
        others = None  # a retry after refusals (rare) scores the workers not excluded in full
        if exclude:
            others = [w for w in self.workers.values() if w.routable and w.worker_id not in exclude]
        if not (ranking if others is None else others):
            raise NoWorkerAvailable("no worker is alive and admitting")
        key = cache_key(self.model_name, cache_salt, lora_key)
        hashes = hash_full_blocks(token_ids, self.block_size, key)
        matches = self.view.match(hashes)  # local: no remote call on the request path
        tier_hits = self.view.tier_hits(hashes, matches)
        tier_load = self.tier_costs.per_worker(tier_hits)
        if lora_key is not None:  # only workers with the adapter; a load where not resident
            others, tier_load = self.lora_candidates(lora_key, others, exclude, tier_load)
        if others is None:
            decision = self.policy.choose_ranked(len(hashes), matches, ranking, tier_load)
        else:
            loads = [w.load() for w in others]
            decision = self.policy.choose(len(hashes), matches, loads, tier_load)
        chosen = self.workers[decision.worker_id]
        matched = matches.get(chosen.worker_id, 0)
        self.counters.count_routed(decision.policy)
        outcome = "prefix_hit" if matched else "prefix_miss"
        if matched:
            self.counters.prefix_hits += 1
        else:
            self.counters.prefix_misses += 1
        self.metrics.on_routed(decision.policy, outcome)
        if span is not None:
            record_decision(span, decision, len(hashes), matched)
        if self.config.routing.enable_pull:
            exportable = {w: hits.device_prefix for w, hits in tier_hits.items()}
            peers = {**matches, **exportable}  # a peer exports only what is on its device
            matched = await self.migrations.maybe_pull(chosen, hashes, peers, matched, span)
        return chosen, matched

    def _unfit(self, phase: RoleFilter, exclude: frozenset[str]) -> frozenset[str]:
        """The workers (not in `exclude`) of a role `phase` should not go to; none when no
        worker of a fitting role is routable (counted as a P/D fallback)."""
        candidates = (w for w in self.workers.values() if w.worker_id not in exclude)
        unfit, fell_back = phase.unfit(candidates)
        self.counters.pd_fallbacks += fell_back
        return unfit


def check_prompt_size(size: int, limit: int) -> None:
    """Refuse a prompt longer than `limit` characters (or token ids) before any work on it."""
    if size > limit:
        raise RequestRejected(
            f"prompt is {size:,} characters or tokens long; the limit is {limit:,} "
            "(max_prompt_chars)"
        )
