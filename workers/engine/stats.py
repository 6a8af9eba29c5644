"""What an engine reports of itself: KV usage, queue lengths, counters, tiers, speculation
(a part of `Engine`, kept apart to keep `workers/engine/engine.py` to the step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.workers.protocol.stats import TierStats

if TYPE_CHECKING:
    from pagedserve.workers.protocol.stats import KVUsage, SpecStats


class EngineStats:
    """The stats calls of `Engine` (which owns every attribute they read)."""

    def usage(self) -> KVUsage:
        return self.kv.usage()

    def stats(self) -> dict:
        usage = self.kv.usage()
        return {
            "kv": usage,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_swapped": len(self.scheduler.swapped),
            "num_paused": len(self._paused),
            "num_steps": self.num_steps,
            "num_handoffs": self.num_handoffs,
            "adopted_with_kv": self.num_adopted_with_kv,
            "adopted_recomputed": self.num_adopted_recomputed,
            "role": self.role,
            "kv_cache_device_bytes": self.kv_cache.device_bytes,
            "kv_cache_swap_bytes": self.kv_cache.swap_bytes,
            "spec": self.spec_stats(),
            "tiers": self.tier_stats(),
            "lora_adapters": tuple(self.lora_adapters().items()),
            "lora_paths": tuple(self.lora_paths().items()),
            "resident_loras": tuple(self.loras.resident()) if self.loras is not None else (),
            "lora_requests": self.lora_requests(),
        }

    def tier_stats(self) -> TierStats:
        """The host and disk tiers' occupancy and traffic (empty when neither is on)."""
        return TierStats() if self.tiers is None else self.tiers.stats()

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counts so far (all zero when it is off)."""
        return self.spec_counters.snapshot()
