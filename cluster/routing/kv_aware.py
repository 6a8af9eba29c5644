"""The KV-aware routing policy (`kv_aware`, the default): the cheapest worker by prefill still
to do plus load, with an imbalance guard so that a hot prefix cannot pull every request to
one worker.

Two ways to ask it (`cluster/routing/policy.py`): `choose` scores every worker; `choose_ranked`
answers from the prefix holders plus the least-loaded workers in order, stopping at the first
it may choose: the same winner as `choose` over the same loads
(`tests/unit/cluster/routing/test_routing_ranked.py` checks it on randomized states), at a cost
that does not grow with the workers that hold nothing of the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pagedserve.cluster.routing.load_ranking import LoadRanking, RankKey
from pagedserve.cluster.routing.policy import (
    Candidate,
    RoutingDecision,
    RoutingPolicy,
    WorkerLoad,
    make_decision,
    prefix_split,
    sorted_loads,
    tier_load_of,
)

# A block still to prefill costs more than a block already resident on a busy worker: with
# weight 1 a holder serving one long request (whose blocks include the very prefix a new
# request would share) looked costlier than a cold idle worker, and hits were lost. The
# routing bench measured this; 4 keeps holders preferred while the imbalance guard still
# stops a hot prefix from piling onto one worker.
DEFAULT_PREFILL_WEIGHT = 4.0
# Workers holding nothing of the prompt that a ranked `kv_aware` decision lists beside the
# holders (the winner needs only the first it may choose; the rest are for traces and logs).
RANKED_LISTED = 4


class KvAwarePolicy(RoutingPolicy):
    """Cheapest worker by `cost = prefill_weight · (blocks_to_prefill + tier_load) + load`.

    Definitions, all in KV blocks:

    - `blocks_to_prefill = num_prompt_blocks − matched_blocks` (the prompt blocks it lacks);
    - `tier_load`: what loading its matched blocks from the host or disk tier is worth in
      prefilled blocks (`tier_load_blocks`; `TierCosts.load_blocks`);
    - `load = max(used_blocks, ⌈inflight_tokens / block_size⌉) + waiting_weight · num_waiting`.
      The first term is decode load: the worker's reported KV use, or the router's estimate of
      what it sent there when that is larger (the report has not caught up yet). Waiting
      requests add a queueing term on top.

    Imbalance guard: a worker whose `load > imbalance_factor · mean(load) + imbalance_slack` is
    excluded (`"overloaded"`), so a hot prefix cached on one worker cannot pull every request
    there; with `imbalance_factor >= 1` some worker is always under the bound. The guard only
    applies once the load is also a real share of that worker's pool
    (`> imbalance_pool_fraction · total_blocks`) or requests wait there: with few workers, one
    long request on a large pool is far above the mean but no pile-up worth a lost cache hit.
    Ties go to the lower load, then fewer in-flight requests, then the lower worker id.

    Packing (`pack_below_requests` > 0; `pagedserve serve` sets it where CPU workers share
    their machine's cores, `policies.options_of`): a worker holding fewer requests than that
    (`WorkerLoad.num_requests`) weighs `−load`, a busier one less; from that count on it weighs
    `load`. Light traffic then gathers on one worker, which runs on every core while the
    others idle, until it holds enough requests to be worth a worker of its own; an idle worker
    weighs 0, behind every busy one below the count and ahead of every one at it. Counted in
    requests, not blocks: a request's load in blocks holds its `max_tokens`, which an OpenAI
    client that sends none makes the whole context (hundreds of blocks), while what one engine
    on every core does better than two on a share of them is a batch of few sequences. The
    imbalance guard reads the load itself. `Candidate.load` and the tie order hold the
    weighed load.

    Args:
        prefill_weight: blocks of decode load one block of prefill is worth.
        block_size: tokens per KV block, to turn `inflight_tokens` into blocks.
        waiting_weight: load, in blocks, of each waiting request.
        imbalance_factor: how far above the mean load a worker may go (>= 1).
        imbalance_slack: absolute headroom in blocks, so that idle clusters are not guarded.
        imbalance_pool_fraction: share of its own pool a worker's load must pass before the
            guard may exclude it (unless requests wait there).
        pack_below_requests: the requests light traffic packs a worker to (0: none).
    """

    name = "kv_aware"
    takes_block_size = True

    def __init__(
        self,
        prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
        block_size: int = 16,
        waiting_weight: float = 1.0,
        imbalance_factor: float = 1.5,
        imbalance_slack: float = 16.0,
        imbalance_pool_fraction: float = 0.25,
        pack_below_requests: int = 0,
    ) -> None:
        weights = {
            "prefill_weight": prefill_weight,
            "waiting_weight": waiting_weight,
            "imbalance_factor": imbalance_factor,
            "imbalance_slack": imbalance_slack,
            "imbalance_pool_fraction": imbalance_pool_fraction,
        }
        for name, value in weights.items():
            if not math.isfinite(value):  # NaN would pass every range check below
                raise ValueError(f"{name} must be a finite number, got {value}")
        if min(prefill_weight, waiting_weight, imbalance_slack) < 0:
            raise ValueError("prefill_weight, waiting_weight and imbalance_slack must be >= 0")
        if isinstance(pack_below_requests, bool) or not isinstance(pack_below_requests, int):
            raise ValueError(f"pack_below_requests must be an integer, got {pack_below_requests!r}")
        if pack_below_requests < 0:
            raise ValueError(f"pack_below_requests must be >= 0, got {pack_below_requests}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if imbalance_factor < 1:
            raise ValueError(f"imbalance_factor must be >= 1, got {imbalance_factor}")
        self.prefill_weight = prefill_weight
        self.block_size = block_size
        self.waiting_weight = waiting_weight
        self.imbalance_factor = imbalance_factor
        self.imbalance_slack = imbalance_slack
        if not 0 <= imbalance_pool_fraction <= 1:
            raise ValueError(
                f"imbalance_pool_fraction must be in [0, 1], got {imbalance_pool_fraction}"
            )
        self.imbalance_pool_fraction = imbalance_pool_fraction
        self.pack_below_requests = pack_below_requests

    def guard_terms(self, load: WorkerLoad) -> tuple[int, int]:
        """(decode load in blocks, requests waiting): `load_of` is `first + waiting_weight ·
        second`; integers, so sums over workers are exact however they were kept."""
        inflight_blocks = -(-load.inflight_tokens // self.block_size)  # ceil, in integers
        return max(load.used_blocks, inflight_blocks), load.num_waiting

    def load_of(self, load: WorkerLoad) -> float:
        """The worker's load in blocks (see the class docstring)."""
        decode, waiting = self.guard_terms(load)
        return decode + self.waiting_weight * waiting

    def weighed(self, load: WorkerLoad, value: float) -> float:
        """The worker's load `value` as routing weighs it: negated while it holds fewer than
        `pack_below_requests` requests (packing, class docstring)."""
        return -value if load.num_requests < self.pack_below_requests else value

    def rank_key(self, load: WorkerLoad) -> RankKey:
        """Lower weighed load, then fewer in flight, then the lower id: `choose`'s tie order."""
        return (self.weighed(load, self.load_of(load)), load.inflight, load.worker_id)

    def guard_bound(self, decode_total: int, waiting_total: int, num_workers: int) -> float:
        """The load above which a worker is excluded as overloaded, from the totals of
        `guard_terms` over the `num_workers` alive workers (their mean load)."""
        mean = (decode_total + self.waiting_weight * waiting_total) / num_workers
        return self.imbalance_factor * mean + self.imbalance_slack

    def _saturating(self, load: WorkerLoad, value: float) -> bool:
        if load.num_waiting > 0 or load.total_blocks <= 0:
            return True
        return value > self.imbalance_pool_fraction * load.total_blocks

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        ordered = sorted_loads(loads)
        values = {w.worker_id: self.load_of(w) for w in ordered}
        terms = [self.guard_terms(w) for w in ordered]
        bound = self.guard_bound(sum(t[0] for t in terms), sum(t[1] for t in terms), len(ordered))
        over = {
            w.worker_id
            for w in ordered
            if values[w.worker_id] > bound and self._saturating(w, values[w.worker_id])
        }
        if len(over) == len(values):  # cannot happen with factor >= 1; never leave no one
            over = set()
        candidates = []
        for worker in ordered:
            matched, prefill = prefix_split(worker.worker_id, num_prompt_blocks, matches)
            value = self.weighed(worker, values[worker.worker_id])
            excluded = "overloaded" if worker.worker_id in over else None
            tier_load = tier_load_of(worker.worker_id, tier_load_blocks)
            cost = self.prefill_weight * (prefill + tier_load) + value
            candidates.append(
                Candidate(worker.worker_id, matched, prefill, value, cost, excluded, tier_load)
            )
        inflight = {w.worker_id: w.inflight for w in ordered}
        best = min(
            (c for c in candidates if c.excluded is None),
            key=lambda c: (c.cost, c.load, inflight[c.worker_id], c.worker_id),
        )
        return make_decision(best, self.name, candidates)

    def choose_ranked(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        ranking: LoadRanking,
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        """`choose`'s winner without scoring every worker.

        Why it is the same: a worker holding nothing of the prompt costs `prefill_weight ·
        num_prompt_blocks + weighed load`, one constant plus its weighed load, so among those
        the tie order (cost, weighed load, in flight, id) is the ranking's order (weighed
        load, in flight, id), and the best
        of them is the first in that order not excluded. The holders are scored one by one.
        The winner is the better of the two. (Only holders have lower-tier hits, so the tier
        term changes nothing of this.) The guard's mean comes from the ranking's exact
        integer totals. If every worker is excluded (rounding with `imbalance_factor` 1 and
        no slack), `choose` drops the guard; so does this, having then seen every worker.
        """
        if num_prompt_blocks < 0:
            raise ValueError(f"num_prompt_blocks must be >= 0, got {num_prompt_blocks}")
        if not len(ranking):
            raise ValueError("no alive workers to route to")
        bound = self.guard_bound(*ranking.totals, len(ranking))
        listed = self._scored_holders(num_prompt_blocks, matches, ranking, bound, tier_load_blocks)
        self._score_least_loaded(num_prompt_blocks, ranking, bound, listed)
        pool = [c for c, _ in listed.values() if c.excluded is None]
        if not pool:  # every worker was excluded, and every one was seen: drop the guard
            listed = {w: (replace(c, excluded=None), n) for w, (c, n) in listed.items()}
            pool = [c for c, _ in listed.values()]
        best = min(pool, key=lambda c: (c.cost, c.load, listed[c.worker_id][1], c.worker_id))
        return make_decision(best, self.name, [listed[w][0] for w in sorted(listed)])

    def _scored_holders(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        ranking: LoadRanking,
        bound: float,
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> dict[str, tuple[Candidate, int]]:
        """Worker id → (its candidate, its in-flight count), for each routable prefix holder."""
        listed = {}
        for worker_id, matched in matches.items():
            load = ranking.get(worker_id)
            matched = min(matched, num_prompt_blocks)
            if load is None or matched <= 0:
                continue
            value = self.load_of(load)
            prefill = num_prompt_blocks - matched
            tier_load = tier_load_of(worker_id, tier_load_blocks)
            excluded = self._excluded(load, value, bound)
            value = self.weighed(load, value)
            cost = self.prefill_weight * (prefill + tier_load) + value
            candidate = Candidate(worker_id, matched, prefill, value, cost, excluded, tier_load)
            listed[worker_id] = (candidate, load.inflight)
        return listed

    def _score_least_loaded(
        self,
        num_prompt_blocks: int,
        ranking: LoadRanking,
        bound: float,
        listed: dict[str, tuple[Candidate, int]],
    ) -> None:
        """Add to `listed` the workers holding nothing of the prompt, in load order, until
        one that is not excluded (none after it can beat it) and `RANKED_LISTED` of them."""
        fixed = self.prefill_weight * num_prompt_blocks
        holders = set(listed)
        found_free = False
        others = 0
        for value, inflight, worker_id in ranking.ordered():  # value: the weighed load
            if worker_id in holders:
                continue
            load = ranking.get(worker_id)
            excluded = self._excluded(load, self.load_of(load), bound)
            candidate = Candidate(worker_id, 0, num_prompt_blocks, value, fixed + value, excluded)
            listed[worker_id] = (candidate, inflight)
            others += 1
            found_free = found_free or excluded is None
            if found_free and others >= RANKED_LISTED:
                return

    def _excluded(self, load: WorkerLoad, value: float, bound: float) -> str | None:
        return "overloaded" if value > bound and self._saturating(load, value) else None
