"""What an engine reports of itself: KV usage, queue lengths, counters, tiers, speculation, LoRA
(a part of `Engine`, kept apart to keep `workers/engine/engine.py` to the step). `Engine.stats()`
returns them as one frozen `EngineStats`; the worker copies its fields into the `WorkerStats` it
sends (`workers/worker/core.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stats import KVUsage, SpecStats, TierStats


@dataclass(frozen=True)
class EngineStats:
    """One engine's state at one moment (the meaning of each field: `WorkerStats`)."""

    kv: KVUsage
    num_waiting: int
    num_running: int
    num_swapped: int
    num_paused: int
    num_steps: int
    num_handoffs: int
    adopted_with_kv: int
    adopted_recomputed: int
    role: WorkerRole
    kv_cache_device_bytes: int
    kv_cache_swap_bytes: int
    spec: SpecStats
    tiers: TierStats
    lora_adapters: tuple[tuple[str, str], ...]
    lora_paths: tuple[tuple[str, str], ...]
    resident_loras: tuple[str, ...]
    lora_requests: tuple[tuple[str, int], ...]


class EngineReporting:
    """The stats calls of `Engine` (which owns every attribute they read)."""

    def usage(self) -> KVUsage:
        return self.kv.usage()

    def stats(self) -> EngineStats:
        return EngineStats(
            kv=self.kv.usage(),
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_swapped=len(self.scheduler.swapped),
            num_paused=len(self._paused),
            num_steps=self.num_steps,
            num_handoffs=self.num_handoffs,
            adopted_with_kv=self.num_adopted_with_kv,
            adopted_recomputed=self.num_adopted_recomputed,
            role=self.role,
            kv_cache_device_bytes=self.kv_cache.device_bytes,
            kv_cache_swap_bytes=self.kv_cache.swap_bytes,
            spec=self.spec_stats(),
            tiers=self.tier_stats(),
            lora_adapters=tuple(self.lora_adapters().items()),
            lora_paths=tuple(self.lora_paths().items()),
            resident_loras=tuple(self.loras.resident()) if self.loras is not None else (),
            lora_requests=self.lora_requests(),
        )

    def tier_stats(self) -> TierStats:
        """The host and disk tiers' occupancy and traffic (empty when neither is on)."""
        return TierStats() if self.tiers is None else self.tiers.stats()

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counts so far (all zero when it is off)."""
        return self.spec_counters.snapshot()
