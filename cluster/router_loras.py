"""The router's side of LoRA adapters (a mixin of `RouterCore`): which adapters the cluster
serves, their keys (what a request's blocks hash with, `workers/block_hash.py`), and loading
or unloading one on every worker at run time.

The adapters are the workers' own: every worker reports its loaded adapters (name and key) in
its stats, and a router reads them from the last poll, so every replica converges on the same
list without a registry of its own. A load or unload through one replica goes to every worker
and then re-polls them, so that replica serves the change as soon as it answers; the others
see it at their next poll.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.workers.deadline import within
from pagedserve.workers.errors import LoraLoadError, UnknownLora
from pagedserve.workers.worker_types import LoraLoadResult

logger = logging.getLogger(__name__)
# Reading and checking an adapter's files takes a worker well under a second at the ranks
# served; a loaded machine is given far more.
LOAD_TIMEOUT_S = 120.0


class RouterLoras:
    """LoRA adapters as this router sees them (needs `workers` and `liveness`)."""

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
        adapter loaded under that key) and the extra prefill blocks each costs: `tier_load`'s
        (``extra_blocks``) plus `lora_load_block_cost` where the adapter is not in a device
        slot. The caller scores them with `choose` (the ranked path assumes that a worker
        holding nothing of the prompt costs no more than its load).

        Raises:
            UnknownLora: no routable worker has it.
        """
        name = key.rsplit("@", 1)[0]
        pool = (
            others
            if others is not None
            else [w for w in self.workers.values() if w.routable and w.worker_id not in exclude]
        )
        fit = [w for w in pool if w.stats is None or (name, key) in w.stats.lora_adapters]
        if not fit:
            raise UnknownLora(f"LoRA adapter {name!r} is on no worker that admits requests")
        cost = self.config.lora_load_block_cost
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
        await self._repoll(workers)

    async def _repoll(self, workers) -> None:
        await asyncio.gather(*(self.liveness.poll(w) for w in workers))
