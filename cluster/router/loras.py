"""The router's side of LoRA adapters (a mixin of `RouterCore`): which adapters the cluster
serves, their keys (what a request's blocks hash with, `workers/kv/block_hash.py`), and loading
or unloading one on every worker at run time.

The adapters are the workers' own: every worker reports its loaded adapters (name and key) in
its stats, and a router reads them from the last poll, so every replica converges on the same
list without a registry of its own. A load or unload through one replica goes to every worker
and then re-polls them, so that replica serves the change as soon as it answers; the others
see it at their next poll.

A worker that joins later (the pool scales up or replaces one; Ray restarts one) starts with
`lora_modules` only, so each router keeps the adapters the cluster serves (`lora_known`: name
-> key and path, `WorkerStats.lora_paths`) from every poll: what a worker reports is served;
what a worker reported and no longer does at the same epoch was unloaded; a worker lost or
replaced unloads nothing, so the adapters outlive every worker that had them. The first time
a router polls a worker incarnation (worker id and epoch: `follow_loras`) it loads the known
adapters that worker lacks from their paths: one counts there only once it loaded under the
key the cluster serves (other files at that path now: unloaded again), and a failure is
logged and counted (`lora.heal_failures`), never raised into a request. Only a new
incarnation is healed, so an unload is never undone on a worker the router has seen; and one
that ran while a heal was loading is caught: the others are polled again after the load, and
an adapter no longer known is unloaded from the new worker. Several replicas may heal the same
worker at once: loading a name again with the same files is a no-op there
(`LoraRegistry.load`). A router that starts while no worker reports an adapter does not know
it (the adapters are the workers', not a store of their own).
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import LoraLoadError, UnknownLora
from pagedserve.workers.protocol.stats import LoraLoadResult

logger = logging.getLogger(__name__)
# Reading and checking an adapter's files takes a worker well under a second at the ranks
# served; a loaded machine is given far more.
LOAD_TIMEOUT_S = 120.0


class RouterLoras:
    """LoRA adapters as this router sees them (needs `workers`, `liveness`, `counters`,
    `lora_known`: name -> (key, path) of every adapter served, and `lora_seen`: worker id ->
    the epoch and adapters (name -> key) `follow_loras` last noted there)."""

    def lora_adapters(self) -> dict[str, str]:
        """Adapter name -> key, over every live worker's last stats."""
        adapters: dict[str, str] = {}
        for worker in self.workers.values():
            if worker.alive and worker.stats is not None:
                adapters.update(worker.stats.lora_adapters)
        return adapters

    async def served_loras(self) -> dict[str, str]:
        """`lora_adapters`, once the workers have been polled (the first call waits for a
        poll of each: an adapter loaded at start is served from the first request on)."""
        await self.start()
        unpolled = [w for w in self.workers.values() if w.alive and w.stats is None]
        if unpolled:
            await self._repoll(unpolled)
        return self.lora_adapters()

    def resident_loras(self) -> dict[str, tuple[str, ...]]:
        """Worker id -> the adapters in its device slots now."""
        return {
            w.worker_id: w.stats.resident_loras
            for w in self.workers.values()
            if w.alive and w.stats is not None
        }

    def lora_key(self, name: str | None) -> str | None:
        """The key of adapter ``name`` (None for the base). Raises `UnknownLora` naming it."""
        if name is None:
            return None
        key = self.lora_adapters().get(name)
        if key is None:
            raise UnknownLora(f"model: {name!r} is neither the served model nor a LoRA adapter")
        return key

    def lora_candidates(
        self,
        key: str,
        others: list | None,
        exclude: frozenset[str],
        extra_blocks: dict[str, float],
    ) -> tuple[list, dict[str, float]]:
        """The workers a request on adapter ``key`` may go to (routable, not excluded, the
        adapter loaded under that key; those not polled yet only when no polled one has it)
        and the extra prefill blocks each costs: `tier_load`'s (``extra_blocks``) plus
        `lora_load_block_cost` where the adapter is not in a device slot. The caller scores
        them with `choose` (the ranked path assumes that a worker holding nothing of the
        prompt costs no more than its load).

        Raises:
            UnknownLora: no routable worker has it.
        """
        name = key.rsplit("@", 1)[0]
        pool = (
            others
            if others is not None
            else [w for w in self.workers.values() if w.routable and w.worker_id not in exclude]
        )
        fit = [w for w in pool if w.stats is not None and (name, key) in w.stats.lora_adapters]
        if not fit:  # a worker not polled yet may have it; one that just joined may not yet
            fit = [w for w in pool if w.stats is None]
        if not fit:
            raise UnknownLora(f"LoRA adapter {name!r} is on no worker that admits requests")
        cost = self.config.routing.lora_load_block_cost
        costs = dict(extra_blocks)
        for worker in fit:
            if cost and (worker.stats is None or name not in worker.stats.resident_loras):
                costs[worker.worker_id] = costs.get(worker.worker_id, 0.0) + cost
        return fit, costs

    async def load_lora(self, name: str, path: str) -> str:
        """Load adapter ``name`` from ``path`` on every live worker; all or none.

        Returns:
            Its key.

        Raises:
            LoraLoadError: a worker refused it (the message names why); the workers that had
                taken it unload it again.
        """
        await self.start()
        before = self.lora_adapters()
        workers = [w for w in self.workers.values() if w.alive]
        results: list[LoraLoadResult] = await asyncio.gather(
            *(within(w.handle.load_lora.remote(name, path), LOAD_TIMEOUT_S) for w in workers)
        )
        failed = [r for r in results if r.error is not None]
        if failed:
            if name not in before:
                taken = [w for w, r in zip(workers, results, strict=True) if r.error is None]
                await asyncio.gather(*(w.handle.unload_lora.remote(name) for w in taken))
            await self._repoll(workers)
            raise LoraLoadError(failed[0].error)
        await self._repoll(workers)
        return results[0].key

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` everywhere: new requests on it get 404 at once; requests
        already running on it finish on it. Raises `UnknownLora`."""
        await self.start()
        self.lora_key(name)
        workers = [w for w in self.workers.values() if w.alive]
        await asyncio.gather(
            *(within(w.handle.unload_lora.remote(name), LOAD_TIMEOUT_S) for w in workers)
        )
        self.lora_known.pop(name, None)  # no worker that joins later gets it
        await self._repoll(workers)

    async def _repoll(self, workers) -> None:
        await asyncio.gather(*(self.liveness.poll(w) for w in workers))

    # ------------------------------------------------------------ later workers
    async def follow_loras(self, worker: WorkerState) -> None:
        """After each poll of a live worker: note its adapters (`lora_known`), and give it the
        known adapters it lacks if this is the first look at its incarnation."""
        stats = worker.stats
        if stats is None or not worker.alive:
            return
        last = self.lora_seen.get(worker.worker_id)
        self._note_loras(worker)
        if last is None or last[0] != stats.epoch:
            await self._heal_loras(worker)

    def _note_loras(self, worker: WorkerState) -> None:
        """What ``worker`` reports is served (`lora_known` gains it, with its path); what it
        reported at the same epoch and no longer does was unloaded (`lora_known` loses it). A
        worker lost or replaced unloads nothing: the adapters outlive every worker that had
        them, for the next one to join."""
        for gone in [w for w in self.lora_seen if w not in self.workers]:
            del self.lora_seen[gone]
        stats = worker.stats
        now, paths = dict(stats.lora_adapters), dict(stats.lora_paths)
        last = self.lora_seen.get(worker.worker_id)
        if last is not None and last[0] == stats.epoch:
            for name, key in last[1].items():
                if now.get(name) != key and self.lora_known.get(name, ("",))[0] == key:
                    del self.lora_known[name]
        for name, key in now.items():
            if name in paths:
                self.lora_known[name] = (key, paths[name])
        self.lora_seen[worker.worker_id] = (stats.epoch, now)

    async def _heal_loras(self, worker: WorkerState) -> None:
        """Load onto ``worker`` the known adapters it lacks; then re-poll it."""
        have = dict(worker.stats.lora_adapters)
        missing = {n: src for n, src in self.lora_known.items() if n not in have}
        if not missing:
            return
        loaded = await asyncio.gather(
            *(self._heal_one(worker, name, key, path) for name, (key, path) in missing.items())
        )
        healed = {name: missing[name][0] for name, ok in zip(missing, loaded, strict=True) if ok}
        if healed:
            await self._undo_unloaded(worker, healed)
        await self.liveness.poll(worker)
        if worker.stats is not None:
            self._note_loras(worker)

    async def _heal_one(self, worker: WorkerState, name: str, key: str, path: str) -> bool:
        """Load adapter ``name`` onto ``worker``; True once it serves it under ``key``."""
        try:
            result = await within(worker.handle.load_lora.remote(name, path), LOAD_TIMEOUT_S)
        except (*WORKER_LOST_ERRORS, TimeoutError) as error:
            why = f"no answer ({type(error).__name__})"
        else:
            if result.error is None and result.key == key:
                self.counters.lora_healed += 1
                return True
            why = result.error
            if result.error is None:  # other files at that path now: not what the others serve
                why = f"its files changed (key {result.key}; the other workers serve {key})"
                await self._unload_quietly(worker, name)
        self.counters.lora_heal_failures += 1
        logger.warning(
            "worker %s joined without LoRA adapter %r and could not load it from %r: %s; "
            "it serves no request on it",
            worker.worker_id,
            name,
            path,
            why,
        )
        return False

    async def _undo_unloaded(self, worker: WorkerState, healed: dict[str, str]) -> None:
        """An unload that ran while ``healed`` (name -> key) were loading missed ``worker``:
        poll the others again, and unload from it what is no longer known under that key."""
        others = [w for w in self.workers.values() if w is not worker and w.alive]
        await self._repoll(others)
        for other in others:
            if other.alive and other.stats is not None:
                self._note_loras(other)
        for name, key in healed.items():
            if self.lora_known.get(name, ("",))[0] != key:
                logger.warning(
                    "LoRA adapter %r was unloaded while worker %s loaded it; unloading it there",
                    name,
                    worker.worker_id,
                )
                await self._unload_quietly(worker, name)

    async def _unload_quietly(self, worker: WorkerState, name: str) -> None:
        try:
            await within(worker.handle.unload_lora.remote(name), LOAD_TIMEOUT_S)
        except (*WORKER_LOST_ERRORS, TimeoutError):
            logger.warning("worker %s did not unload LoRA adapter %r", worker.worker_id, name)
