"""What crosses the boundary between a worker actor and its callers (router, peers, tests).

Each message is a frozen dataclass, validated once where it is built, never a dict read back
by string key:

    router ── WorkerRequest ──────────────► Worker.submit (admitted, or refused)
    router ◄── StepBatch ───────────────────  Worker.channel(owner): per engine step, every
               (StreamDelta | RequestMoved | RequestFailed) of that owner's requests
    router ── Worker.set_paused / abort ──►  flow control and cancel, by request id
    router ── Worker.ready() / stats() ───► WorkerInfo / WorkerStats (holding KVUsage)

(`Worker.generate` streams one request's messages by itself, for callers without a channel.)

`RequestMoved` is the control message that used to ride inside a data delta: a worker that
must preempt a request in `move` mode ends that branch's stream with it, and the router
continues the request on a peer from `handoff`. `RequestFailed` ends a request's stream with
the error its reader raises (a drain's cut-off), since a channel carries many requests and
cannot raise for one of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.workers.deadline import check_timeout_s
from pagedserve.workers.engine.role import WorkerRole
from pagedserve.workers.errors import RequestRejected
from pagedserve.workers.kv.manager import KVUsage
from pagedserve.workers.kv.tiers import TierStats
from pagedserve.workers.sampling.params import SamplingParams
from pagedserve.workers.scheduler.fair_share import TenantService
from pagedserve.workers.scheduler.scheduler import SchedulerCounters
from pagedserve.workers.spec.stats import SpecStats
from pagedserve.workers.transfer.handoff import RequestHandoff


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
    num_threads: int = 1  # torch intra-op threads of its engine (`ClusterConfig.worker_threads`)
    pid: int = 0  # its process (placement pins the control plane around it)
    cpus: tuple[int, ...] = ()  # the cores its process may run on (`ClusterConfig.worker_cpus`)
    nice: int = 0  # its niceness (`ClusterConfig.worker_nice`; Ray's default is 15)
    config_fingerprint: str = ""  # of the spec it was built from (`cluster/pool/spec.py`)
    role: WorkerRole = WorkerRole.MIXED  # P/D: what it takes (`workers/engine/role.py`)
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
class WorkerRequest:
    """One request as a worker takes it: a fresh prompt, or (`handoff`) a moved request.

    Attributes:
        request_id: the id the worker knows it by (the router's tenant-scoped id).
        params: sampling parameters (validated by `SamplingParams` itself).
        prompt: token ids, or text the worker tokenizes; empty when `handoff` is set.
        handoff: a request a peer moved here, to continue where it stopped.
        priority: lower runs first under the `priority` scheduling policy.
        tenant: who sent it: the worker's scheduler shares the engine fairly among tenants.
        cache_salt: isolates this request's prefix cache entries (e.g. per tenant).
        timeout_s: the request ends with finish reason `timeout` after this long.
        trace_context: the W3C carrier of the caller's span, if traced.
        owner_id: the router whose lease keeps this request alive (None: no lease).
        lora: the LoRA adapter it runs on (its name; None: the base model).
    """

    request_id: str
    params: SamplingParams
    prompt: str | tuple[int, ...] = ()
    handoff: RequestHandoff | None = None
    priority: int = 0
    tenant: str = ""
    cache_salt: str | None = None
    timeout_s: float | None = None
    trace_context: Mapping[str, str] | None = field(default=None, hash=False)
    owner_id: str | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise RequestRejected("request_id is empty")
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if (self.handoff is None) == (not self.prompt):
            raise RequestRejected("give a prompt or a handoff, not both or neither")
        check_timeout_s(self.timeout_s)

    @classmethod
    def fresh(
        cls, request_id: str, prompt: str | Sequence[int], params: SamplingParams, **kwargs
    ) -> WorkerRequest:
        return cls(
            request_id, params, prompt if isinstance(prompt, str) else tuple(prompt), **kwargs
        )

    @classmethod
    def moved(cls, handoff: RequestHandoff, **kwargs) -> WorkerRequest:
        return cls(handoff.request_id, handoff.params, handoff=handoff, **kwargs)

    @property
    def num_branches(self) -> int:
        return 1 if self.handoff is not None else self.params.n


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


@dataclass(frozen=True)
class RequestMoved:
    """A branch left this worker: continue it on a peer from `handoff` (never shown to the
    client; the router follows it)."""

    request_id: str
    index: int
    worker_id: str
    handoff: RequestHandoff


@dataclass(frozen=True)
class RequestFailed:
    """A request's stream ended with an error instead of its last delta: the reader raises
    `error` (today a drain's cut-off, `HandedOff`: the router replays the request on a peer).

    Attributes:
        request_id: the request whose stream ends.
        error: what its reader raises; a refusal type, so the front ends map it as they map
            the same error raised by `Worker.submit`.
    """

    request_id: str
    error: RequestRejected

    def __post_init__(self) -> None:
        if not isinstance(self.error, RequestRejected):
            raise TypeError(f"RequestFailed carries a RequestRejected, not {self.error!r}")
