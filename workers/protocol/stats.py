"""What a worker reports about itself: who it is (`WorkerInfo`, from `Worker.ready`), its load
and KV breakdown (`WorkerStats`, from `Worker.stats`, with the engine's parts it holds: KV
usage, lower tiers, scheduler, speculative decoding, tenants), and the answers of its admin
calls (`LoraLoadResult`, `PoolCheck`, `DrainResult`).

    router ── Worker.ready() / stats() ───► WorkerInfo / WorkerStats
    router ── Worker.load_lora / check_pool / drain ──► LoraLoadResult / PoolCheck / DrainResult
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.workers.protocol.role import WorkerRole


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Where every block and position of the pool is, for stats and leak checks."""

    block_size: int
    total_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int  # free and holding nothing cached
    reserve_blocks: int
    useful_tokens: int
    allocated_positions: int
    wasted_positions: int  # allocated but unfilled: tail waste (paged) or reservation (reserve-max)
    block_table_entries: int
    block_table_bytes: int
    swap_blocks_used: int
    swap_blocks_total: int
    num_requests: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int

    @property
    def utilization(self) -> float:
        return self.useful_tokens / self.allocated_positions if self.allocated_positions else 1.0


@dataclass(frozen=True)
class TierUsage:
    """One lower tier's occupancy and traffic since the engine started.

    Attributes:
        tier: `host` or `disk`.
        blocks: blocks it holds now.
        bytes: bytes they take (KV bytes in memory; file bytes on disk).
        capacity_bytes: its bound.
        stored_blocks: blocks written into it (spilled from the device, or demoted).
        hit_blocks: blocks loaded from it back into the device pool.
        evicted_blocks: blocks its LRU bound pushed out (demoted to disk, or dropped).
        bytes_in: KV bytes written into it.
        bytes_out: KV bytes loaded from it into the device pool.
        load_time_s: time spent reading its blocks for loads.
        dropped_blocks: blocks it refused (disk: the write queue was full).
        corrupt_skipped: files found corrupt or foreign and skipped (disk).
    """

    tier: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    stored_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    load_time_s: float = 0.0
    dropped_blocks: int = 0
    corrupt_skipped: int = 0


@dataclass(frozen=True)
class TierStats:
    """The lower tiers of one engine (empty when none is configured)."""

    tiers: tuple[TierUsage, ...] = ()
    loads: int = 0  # requests whose prefix was (partly) loaded from a lower tier
    loaded_blocks: int = 0
    load_time_s: float = 0.0  # reading plus writing into the device pool

    def of(self, tier: str) -> TierUsage | None:
        return next((usage for usage in self.tiers if usage.tier == tier), None)


@dataclass
class SchedulerCounters:
    """What one scheduler did since it started (read through `Worker.stats().scheduler`).

    Attributes:
        prefill_tokens: tokens scheduled for sequences that had more than their newest token
            to compute: prompt chunks, and a recomputed victim's whole sequence. A decode's one
            token is not counted, nor is any token whose KV a cache hit, a pull or a moved
            request's handoff brought.
        swapped_out: victims whose KV went to the swap area.
        swapped_in: swapped-out sequences brought back.
        recomputed: victims whose KV was dropped, to be computed again (in swap mode: the swap
            area had no room for them; in move mode: they could not move).
        moved: victims handed to a peer with their KV.
        prefill_handoffs: P/D, on a prefill worker: sequences handed to a decode worker once
            their first token went out.
        newcomer_steps: steps that computed only the prompts of tenants with nothing running
            (`FairShareConfig.newcomer_steps`).
    """

    prefill_tokens: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    recomputed: int = 0
    moved: int = 0
    prefill_handoffs: int = 0
    newcomer_steps: int = 0


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding since the engine started (all zero when it is off).

    Attributes:
        num_verified: request-steps that verified drafts (one per request per step).
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: draft tokens the target accepted.
        num_emitted_tokens: tokens those steps produced (accepted drafts plus the target's own).
        draft_time_s: seconds spent proposing.
        verify_time_s: seconds spent in forwards that verified drafts.
        num_steps: engine steps that verified drafts.
    """

    num_verified: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    num_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified request-step, the target's own included (1 = no gain)."""
        return self.num_emitted_tokens / self.num_verified if self.num_verified else 0.0

    @property
    def draft_time_per_step_s(self) -> float:
        return self.draft_time_s / self.num_steps if self.num_steps else 0.0

    @property
    def verify_time_per_step_s(self) -> float:
        return self.verify_time_s / self.num_steps if self.num_steps else 0.0


@dataclass
class TenantService:
    """One tenant's service on this worker (read through `Worker.stats().tenants`).

    Attributes:
        prompt_tokens: prompt positions computed for it.
        output_tokens: positions past the prompt computed for it.
        counter: its virtual token counter (weighted service / its weight, lifts included).
        sequences: its sequences queued or running here now.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    counter: float = 0.0
    sequences: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """What the router needs to hash and validate exactly as a worker does (`Worker.ready`)."""

    worker_id: str
    epoch: str  # one per incarnation: a restarted worker has a new one
    model: str
    block_size: int
    vocab_size: int
    max_model_len: int
    num_blocks: int
    num_threads: int = 1  # torch intra-op threads of its engine (`PlacementConfig.worker_threads`)
    pid: int = 0  # its process (placement pins the control plane around it)
    cpus: tuple[int, ...] = ()  # the cores its process may run on (`PlacementConfig.worker_cpus`)
    nice: int = 0  # its niceness (`PlacementConfig.worker_nice`; Ray's default is 15)
    config_fingerprint: str = ""  # of the spec it was built from (`cluster/pool/spec.py`)
    role: WorkerRole = WorkerRole.MIXED  # P/D: what it takes (`workers/protocol/role.py`)
    # Tensor parallelism: the processes of ranks 1..k-1 beside `pid` (rank 0); () when k = 1.
    rank_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerStats:
    """A worker's load and KV breakdown (`Worker.stats`); counters count since it started."""

    worker_id: str
    epoch: str
    kv: KVUsage
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_paused: int = 0
    num_steps: int = 0
    num_handoffs: int = 0
    # Handoffs it adopted with their KV (imported), and those it recomputed from their tokens
    # (no KV: a replay, a lost ref, a failed fetch; or no room for it).
    adopted_with_kv: int = 0
    adopted_recomputed: int = 0
    role: WorkerRole = WorkerRole.MIXED
    kv_held: int = 0  # KV objects handed off from here that no target fetched yet
    num_streams: int = 0
    events_published: int = 0
    blocks_imported: int = 0
    blocks_exported: int = 0
    event_batches_dropped: int = 0
    lease_expired: int = 0
    lease_owners: int = 0
    seconds_without_progress: float = 0.0  # runnable work, and no engine step for this long
    draining: bool = False
    # The polling owner's (router replica's) requests open here at this report: that router
    # counts the rest of what it sent as not yet reported (`WorkerState.unreported`).
    owned_requests: tuple[str, ...] = ()
    kv_cache_device_bytes: int = 0
    # LoRA adapters loaded (name, key) and those in device slots now (`workers/lora/`).
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # Each loaded adapter's directory (name, path): a router loads the cluster's adapters onto
    # a worker that joins later from there (`cluster/router/loras.py`, `follow_loras`).
    lora_paths: tuple[tuple[str, str], ...] = ()
    resident_loras: tuple[str, ...] = ()
    lora_requests: tuple[tuple[str, int], ...] = ()  # requests in the engine per adapter
    kv_cache_swap_bytes: int = 0
    scheduler: SchedulerCounters = field(default_factory=SchedulerCounters)  # a copy
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding (zero when off)
    tiers: TierStats = field(default_factory=TierStats)  # host and disk KV tiers (empty: off)
    # Tenant id → its service here and its virtual token counter
    # (`workers/scheduler/fair_share.py`).
    tenants: dict[str, TenantService] = field(default_factory=dict)  # copies

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.kv.prefix_queries_tokens
        return self.kv.prefix_hits_tokens / queries if queries else 0.0


@dataclass(frozen=True)
class LoraLoadResult:
    """`Worker.load_lora`: the adapter's key (what its blocks hash with), or why it failed."""

    name: str
    key: str | None
    error: str | None = None


@dataclass(frozen=True)
class PoolCheck:
    """`Worker.check_pool`: the pool's invariants hold (`ok`), and whether the worker is idle
    (no request, no stream: then every block must be free or cached)."""

    ok: bool
    idle: bool
    error: str | None = None

    @property
    def clean(self) -> bool:
        return self.ok and self.idle


@dataclass(frozen=True)
class DrainResult:
    """`Worker.drain`: streams that finished within the grace period, and those handed off."""

    finished: int
    handed_off: int
