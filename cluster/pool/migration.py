"""KV migration between workers: pull, push and move. This docstring is the map of all three.

Every KV transfer runs through one routine, `Migrations.transfer`: the target worker fetches
blocks from the source (`Worker.pull_prefix` → source `Worker.export_prefix` → target
`WorkerCore.import_prefix`, which reserves with `PrefixTransfer.reserve_for_import` and
commits with `commit_import` only once the KV has arrived), under one deadline and one
`migration.<kind>` span. Nothing is held while bytes are in flight, so a missed deadline
leaves both pools as they were; the receiver's KV events put the blocks in the index.

- **pull** (on the request path, `RouterCore.route` → `Migrations.maybe_pull`): the worker
  chosen for a request fetches the prefix a peer holds when the peer holds at least
  `pull_min_blocks` more of it than the chosen one (below that, prefill is cheaper).
- **push** (off the request path, after each stats poll: `WorkerLiveness.poll` →
  `Migrations.push_if_under_pressure`): a worker short of free blocks whose cached prefixes are
  about to be evicted (`Worker.push_candidates`: whole chains ending in the next evictions)
  hands those no one else holds (`PrefixIndex.match`) to the worker with the most free blocks.
- **move** (a preemption that keeps the work): the scheduler picks a victim as usual
  (`Scheduler._preempt`, mode `move`); the engine packs its tokens, sampler state and computed
  KV into a `RequestHandoff` and frees its blocks (`Engine._hand_off`); the worker puts the
  KV in Ray's object store and ends that branch's stream with `RequestMoved` whose handoff
  carries only the `ObjectRef` (`workers/transfer/handoff_ref.py`, `Worker.channel`); the router
  sends `WorkerRequest.moved(handoff)` to `Migrations.move_target(source)`, which fetches the KV by
  the ref from the source directly (the router never resolves it: the bytes go worker to
  worker) and whose engine adopts it (`Engine.adopt`, `handoff.adopt_kv`: cached prefix
  blocks reused, the rest imported, or recomputed when there is no room, or when the ref is
  lost because the source died) and streams on from where the request stopped.
- **P/D handoff** (prefill/decode disaggregation, `cluster/routing/worker_roles.py`): the same move,
  started by the end of a prefill instead of a preemption. A fresh request is routed among
  the workers that prefill; on a `prefill` worker, once its first token went out, the engine
  hands each branch off (`Engine._hand_off_prefilled` → `_hand_off`, reason `PREFILLED`),
  keeping the prompt's full blocks cached there. The router sends it to
  `move_target(source)`, which picks among the workers that decode (`DECODE_PHASE`: least
  loaded, most free blocks), under a `pd.transfer` span, counted as `pd.handoffs`. A failed
  fetch (ref lost, deadline) or no room on the decode side recomputes, as for any move.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pagedserve.cluster.config import RoutingConfig
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.tracing import migration_span, pd_transfer_span
from pagedserve.cluster.router.types import MigrationKind, RouterCounters
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.worker_roles import DECODE_PHASE, RoleFilter
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.protocol.handoff import HandoffReason, RequestHandoff
from pagedserve.workers.telemetry.telemetry import Tracing

logger = logging.getLogger(__name__)


class Migrations:
    """Decides and runs the router's side of pull, push and move.

    Args:
        config: the pull and push settings (thresholds, the pull's deadline).
        rpc_timeout_s: the deadline of a control call (`FailureConfig`).
        disaggregated: whether P/D is on (a move that falls back is then counted).
        index: the prefix index actor (who else holds a chain).
        workers: the router's `WorkerState`s, by id (shared with the router).
        tracing: where migration spans go.
        counters: where migrations are counted.
        metrics: where migrations are recorded for Prometheus.
    """

    def __init__(
        self,
        config: RoutingConfig,
        rpc_timeout_s: float,
        disaggregated: bool,
        index: Any,
        workers: dict[str, WorkerState],
        tracing: Tracing,
        counters: RouterCounters,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.rpc_timeout_s = rpc_timeout_s
        self.disaggregated = disaggregated
        self.index = index
        self.workers = workers
        self.tracing = tracing
        self.counters = counters
        self.metrics = metrics
        # A transfer has its own deadline inside the target; this one covers a stuck target.
        self.deadline_s = config.pull_timeout_s + rpc_timeout_s

    async def transfer(
        self,
        kind: MigrationKind,
        source: WorkerState,
        target: WorkerState,
        block_hashes: Sequence[bytes],
        parent: Any = None,
    ) -> int:
        """Copy the cached prefix `block_hashes` from `source` into `target`'s cache.

        Returns the blocks `target` took (0 when it timed out, had no room or a worker was
        lost); counts and traces the transfer as `kind` (`pull` or `push`).
        """
        span = migration_span(self.tracing, parent, kind, source.worker_id, target)
        moved = 0
        try:
            moved = await within(
                target.handle.pull_prefix.remote(
                    source.handle,
                    list(block_hashes),
                    self.config.pull_timeout_s,
                    self.tracing.inject(span),
                ),
                self.deadline_s,
            )
        except (*WORKER_LOST_ERRORS, TimeoutError):
            logger.warning("%s %s → %s failed", kind, source.worker_id, target.worker_id)
        finally:
            span.set_attribute("pagedserve.migration.blocks", moved)
            span.end()
        self._count(kind, moved)
        return moved

    # ------------------------------------------------------------------ pull
    async def maybe_pull(
        self,
        chosen: WorkerState,
        block_hashes: Sequence[bytes],
        matches: dict[str, int],
        matched: int,
        parent: Any = None,
    ) -> int:
        """Pull the prompt's prefix into `chosen` from the alive peer holding most of it, when
        that peer holds `pull_min_blocks` more. Returns the blocks `chosen` now holds."""
        # `.get`: the view may still list a worker that just left the pool.
        holders = [
            (n, wid)
            for wid, n in matches.items()
            if wid != chosen.worker_id and (w := self.workers.get(wid)) is not None and w.alive
        ]
        if not holders:
            return matched
        best, holder_id = max(holders)
        if best - matched < self.config.pull_min_blocks:
            return matched
        holder = self.workers[holder_id]
        pulled = await self.transfer(
            MigrationKind.PULL, holder, chosen, block_hashes[:best], parent
        )
        return max(matched, best) if pulled else matched

    # ------------------------------------------------------------------ push
    def under_pressure(self, worker: WorkerState) -> bool:
        """Few uncached free blocks left, and cached ones next in line for eviction."""
        if worker.stats is None:
            return False
        kv = worker.stats.kv
        low_water = self.config.push_free_fraction * kv.total_blocks
        return kv.free_blocks < low_water and kv.cached_free_blocks > 0

    async def push_if_under_pressure(self, source: WorkerState) -> None:
        """Hand the cached prefixes `source` is about to evict, and no one else holds, to the
        routable worker with the most free blocks."""
        if not (self.config.enable_push and self.under_pressure(source)):
            return
        targets = [w for w in self.workers.values() if w.routable and w is not source]
        if not targets:
            return
        target = max(targets, key=lambda w: (w.load().free_blocks, w.worker_id))
        timeout = self.rpc_timeout_s
        try:
            chains = await within(
                source.handle.push_candidates.remote(self.config.push_max_chains), timeout
            )
            for chain in chains:
                matches = await within(self.index.match.remote(chain), timeout)
                if any(n == len(chain) for wid, n in matches.items() if wid != source.worker_id):
                    continue  # someone else holds it already
                if not await self.transfer(MigrationKind.PUSH, source, target, chain):
                    break  # the target took nothing: no more chains to it this round
        except (*WORKER_LOST_ERRORS, TimeoutError):
            logger.warning("push from %s failed", source.worker_id, exc_info=True)

    # ------------------------------------------------------------------ move
    def move_target(
        self,
        source_id: str | None,
        exclude: frozenset[str] = frozenset(),
        phase: RoleFilter = DECODE_PHASE,
    ) -> WorkerState:
        """Where a moved (or, under P/D, handed-off) request goes: among the routable workers
        whose role `phase` admits (a decode worker or a mixed one; any routable worker when
        none is), the least loaded, then the one with most free blocks, other than its source
        (the source itself only when it is the one left) and the workers in `exclude` (they
        refused it already)."""
        candidates = (w for w in self.workers.values() if w.worker_id not in exclude)
        alive, fell_back = phase.split(candidates)
        if not alive:
            raise NoWorkerAvailable("no worker is alive to continue a moved request")
        self.counters.pd_fallbacks += fell_back and self.disaggregated
        others = [w for w in alive if w.worker_id != source_id] or alive
        return min(others, key=_move_order)

    def move_span(self, parent: Any, handoff: RequestHandoff, source: str | None, target) -> Any:
        """The span of a move leg: `pd.transfer` for a handoff after its prefill (P/D),
        `migration.move` for a preemption's."""
        tokens = len(handoff.all_token_ids)
        if handoff.reason is HandoffReason.PREFILLED:
            return pd_transfer_span(self.tracing, parent, handoff, source, target)
        return migration_span(self.tracing, parent, MigrationKind.MOVE, source, target, tokens)

    def on_moved(self, handoff: RequestHandoff) -> None:
        """The router follows a `RequestMoved`: count it as a P/D handoff or a move."""
        if handoff.reason is HandoffReason.PREFILLED:
            self.counters.pd_handoffs += 1
            self.counters.pd_handoff_tokens += handoff.num_computed_tokens
            self.metrics.on_pd_handoff(handoff.num_computed_tokens)
            return
        self.counters.moves += 1
        self.metrics.on_migration(MigrationKind.MOVE)

    def _count(self, kind: MigrationKind, blocks: int) -> None:
        if not blocks:
            return
        if kind is MigrationKind.PULL:
            self.counters.pulls += 1
            self.counters.pull_blocks += blocks
        else:
            self.counters.pushes += 1
            self.counters.push_blocks += blocks
        self.metrics.on_migration(kind, blocks)


def _move_order(worker: WorkerState) -> tuple:
    """Fewest requests first, then most free blocks (the KV must fit), then by id."""
    load = worker.load()
    return (load.num_requests, -load.free_blocks, worker.worker_id)
