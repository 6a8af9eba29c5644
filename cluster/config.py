"""The cluster's one typed config: engine settings for every worker, plus routing and failure
handling. Built from flags or a YAML file (`pagedserve serve --config FILE`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from pagedserve.cluster.router.tenant_quotas import EVERY_TENANT, TenantPolicy, tenant_policies
from pagedserve.cluster.router.types import BackpressureLimits
from pagedserve.cluster.routing.policies import DEFAULT_POLICY, RoutingPolicy
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.process.cpu_placement import parse_cpu_list, worker_share


class FailureMode(StrEnum):
    """What a router does with the requests of a worker that died: `REPLAY` them on a peer
    from their tokens, or `FAIL` them (UNAVAILABLE / 503)."""

    REPLAY = "replay"
    FAIL = "fail"


FAILURE_MODES = tuple(mode.value for mode in FailureMode)


@dataclass(frozen=True)
class ClusterConfig:
    """Everything `build_app` needs.

    Attributes:
        engine: the config every worker's engine is built from.
        num_workers: worker actors the pool starts with. `pagedserve serve` without it
            sizes to the machine: one per GPU, else one per NUMA node
            (`cluster/serve/node_layout.py`).
        min_workers: the fewest workers the pool scales down to. None: `num_workers`.
        max_workers: the most workers the pool scales up to. None: `num_workers` (with both
            None the pool is fixed). A rolling replacement (reconcile, below) briefly runs one
            worker more than the pool holds.
        scale_up_waiting_per_worker: scale up (one worker at a time, up to `max_workers`) when
            the mean of the serving workers' waiting queues reaches this many requests ...
        scale_up_kv_usage: ... or when their mean KV usage (used / total blocks) reaches this
            fraction. The worker pool (`cluster/pool/pool.py`) judges both from each
            worker's own stats every `scale_interval_s`; a new worker is a new actor, so on
            KubeRay its resource demand is what makes the autoscaler add a pod.
        scale_down_idle_s: scale down (one worker at a time, down to `min_workers`) once a
            worker has had no request, running, waiting or streaming, for this long and no
            scale-up signal holds. The newest idle worker leaves: out of routing on every
            router first, its hot cached prefixes pushed to peers with free blocks, then
            drained and stopped (see `cluster/pool/pool.py`).
        scale_interval_s: how often the pool looks at its workers' stats and decides.
        scale_down_grace_s: the drain grace of a worker leaving the pool: its open streams get
            this long to finish; the rest are handed back and replayed on peers.
        worker_num_gpus: GPUs per worker actor (1 on GPU machines, 0 on CPU).
        worker_num_cpus: CPUs per worker actor (what Ray reserves for it).
        worker_threads: torch intra-op threads of each worker's engine (its
            `OMP_NUM_THREADS`). None: Ray's default, which is `worker_num_cpus` rounded down
            (at least 1), so each worker keeps to the cores it reserved and the router, proxy
            and index keep the rest. `pagedserve serve` without it (and without
            `worker_cpus`) gives each CPU worker its share of the machine's cores.
        worker_cpus: cores the workers' engines run on, as a Linux CPU list (`"1"`, `"0-3"`,
            `"0,2-3"`); with several workers on one machine, worker i gets the i-th equal
            slice. Each worker pins its whole process there, and gets one torch thread per
            core of its slice unless `worker_threads` says otherwise. None: not pinned (the
            scheduler places every process anywhere). See `workers/process/cpu_placement.py`.
        control_cpus: cores of the control plane, as a CPU list: the router replica and the
            prefix index pin themselves there, and `pagedserve serve` pins the local Ray
            cluster it starts (Serve's proxy and controller, Ray's daemons) there too. None:
            not pinned. On 2 cores with one worker, `worker_cpus="1"`, `control_cpus="0"` is
            vLLM's CPU layout (engine on one core, front end on the other).
        worker_nice: niceness of each worker's process (-20..19). Ray starts every actor at
            15, below any ordinary process on the machine, so an engine left there gets the
            leftovers of whatever else runs (a peer server such as vLLM's runs at 0). 0: an
            ordinary server process. None: Ray's 15. Lowering it needs the privilege to (root
            or CAP_SYS_NICE); without it the worker logs a warning and runs on at 15 (start
            Ray with `RAY_worker_niceness=0` instead, as the KubeRay manifests do).
        control_nice: niceness of the router replica and the prefix index (and, under
            `pagedserve serve`, of Serve's proxy and controller). 5 by default: a little below
            the worker, so that where they share cores the engine's threads run first (a
            preempted OpenMP thread stalls its whole team at the next barrier) and the
            control plane's per-token work fills the gaps (on 2 shared cores: streamed TPOT
            p50 0.66x of 0's in two alternated pairs, bench/README.md). None: Ray's 15.
        worker_resources: custom Ray resources per worker actor (to pin workers to nodes).
        routing_policy: a registered routing policy (`cluster/routing/policies.py`).
        routing_options: keyword options of the policy (e.g. `prefill_weight`).
        on_worker_failure: `replay` a dead worker's requests on a peer from their tokens, or
            `fail` them with UNAVAILABLE.
        enable_pull: let the chosen worker fetch a prefix a peer holds instead of prefilling.
        pull_min_blocks: pull only when the holder has at least this many more blocks (below
            it, recomputing is cheaper than the transfer: `pagedserve bench pull` measured the
            crossover at 8 blocks of 16 tokens on CPU workers).
        pull_timeout_s: deadline of one pull; past it the request prefills as usual.
        tier_host_block_cost: what loading one matched block from a worker's host tier is
            worth in prefilled blocks, for `kv_aware` routing (`cluster/routing/tier_costs.py`): a
            device hit costs 0, a prefill 1. `pagedserve bench tier-cost` measured, on CPU
            workers at 16 tokens a block, a host load at 0.05 of a prefill per block with
            tiny-llama (0.05 ms vs 1.06 ms) and 0.03 with SmolLM2-135M (0.58 ms vs 18.4 ms).
        tier_disk_block_cost: the same for a block loaded from the disk tier: 0.32 with
            tiny-llama (0.33 ms a block) and 0.12 with SmolLM2-135M (2.1 ms), files in the
            page cache. On a GPU both are larger (a prefill per block is far cheaper there,
            a load crosses PCIe): measure there before serving.
        lora_load_block_cost: what putting a LoRA adapter into a worker's device slots is worth
            in prefilled blocks, for `kv_aware` routing of a request on that adapter
            (`cluster/router/loras.py`): workers with it resident win ties, and a worker's
            cached prefix still outweighs a load. `pagedserve bench lora` measures the load.
        enable_push: let a worker under eviction pressure hand cached blocks that no other
            worker holds to the worker with the most free blocks, instead of dropping them.
        push_free_fraction: "under pressure" means fewer uncached free blocks than this
            fraction of the pool, with cached blocks about to be evicted.
        push_max_chains: prefix chains pushed per worker per poll.
        stats_interval_s: how often the router refreshes each worker's load (and renews its
            lease there, asks the pool for its members and reports its counters). Every poll
            is a Ray call on the router, the worker, the pool or the index: every 0.25 s they
            cost an idle local cluster 32 CPU-ms a second more than every 1 s (bench/README.md,
            "Serving defaults"), ~1.2 ms per streamed token at 1 request/s. The router counts
            its own requests on each worker at once, so a poll only adds the other replicas'.
        rpc_timeout_s: deadline of every control call (stats, index, abort).
        startup_timeout_s: how long the router waits for workers to load their model.
        max_prompt_chars: longest prompt the router takes, in characters (or token ids); a
            longer one is refused before it is tokenized.
        max_request_bytes: largest request body, HTTP body or gRPC message; a larger one is
            refused before it is parsed (HTTP 413, gRPC RESOURCE_EXHAUSTED).
        max_pending_grpc_calls: gRPC calls Serve's proxy holds before its event loop takes
            them up; past it gRPC itself drops a new call (CANCELLED, no details, no retry
            hint), so it must exceed the largest burst (gRPC's default drops from 1,000 on:
            see `api.grpc.backlog`). A held call costs the proxy its stream and headers.
        max_waiting_per_worker: new requests a worker's engine queues at most; past it the
            worker refuses at once with `Overloaded` (RESOURCE_EXHAUSTED, HTTP 429). None:
            unbounded.
        max_inflight: requests the router streams at once; past it it refuses at once, the
            same way. None: unbounded.
        retry_after_s: the retry hint a refusal carries.
        lease_timeout_s: a worker aborts the requests of a router replica that has not renewed
            its lease (every stats poll renews it) within this long, so a dead router leaves
            no orphans decoding. At least 4 × `stats_interval_s`, so that a few late polls
            cannot end live requests.
        max_buffered_deltas: deltas a worker buffers per stream; past it the request is
            paused (it keeps its blocks) until the reader catches up.
        stall_timeout_s: a worker that has runnable requests but takes no engine step for
            this long is stalled: out of routing, and the router's streams on it end as if it
            were lost (replayed on a peer, or UNAVAILABLE), so no stream waits on it forever.
            It rejoins routing once it steps again. Longer than any one step may take.
        drain_grace_s: how long a draining worker's open streams get to finish before the
            rest are handed back to the router (which replays them on a peer): on SIGTERM to
            the worker's process (`pagedserve drain-node`, a pod's removal), when
            `stop_worker_group` stops the app, and when `pagedserve serve` stops on SIGINT or
            SIGTERM (unless `--shutdown-grace-s` says otherwise).
        fault_injection: workers accept fault calls (stall, refuse, lose a KV fetch or an
            event batch: `workers/worker/fault_injection.py`), for soaks and failure tests. Off in
            production: a production worker has no such methods.
        router_replicas: Router replicas Serve runs (each one ingress of both proxies, with its
            own prefix view, liveness watch and `max_inflight`; any replica serves any call,
            Abort included). The floor when `router_max_replicas` is set.
        router_max_replicas: the ceiling of Serve's autoscaling of the Router between
            `router_replicas` and this (target: half of `max_inflight` streams per replica,
            so a replica scales out well before it refuses). None: a fixed `router_replicas`.
        prefill_workers: prefill/decode disaggregation (P/D): of the pool's workers, this
            many are `prefill` workers (fresh requests are routed among them by prefix hits
            and load; each hands its requests off once their first token went out), ...
        decode_workers: ... and this many `decode` workers (they continue the handed-off
            requests, their KV fetched from the prefill worker; least loaded, most free
            blocks first). The rest of `num_workers` are `mixed` (both). 0 and 0: no P/D,
            every worker mixed. A worker that replaces a lost one takes the role that is
            short; one the pool adds past the roles' counts is mixed
            (`cluster/routing/worker_roles.py`).
        tenants: tenant id (the auth token's, `cluster/api/auth.py`) or `*` (every tenant not
            named) → its `weight` in each worker's fair share of the engine and its optional
            quotas per router replica, `max_inflight` and `tokens_per_minute`
            (`cluster/router/tenant_quotas.py`, docs/fairness.md).
        namespace: Ray namespace of the named actors (index, workers).
        name: prefix of the actors' names, so two apps can share a Ray cluster.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    num_workers: int = 2
    min_workers: int | None = None
    max_workers: int | None = None
    scale_up_waiting_per_worker: float = 8.0
    scale_up_kv_usage: float = 0.9
    scale_down_idle_s: float = 300.0
    scale_interval_s: float = 1.0
    scale_down_grace_s: float = 30.0
    worker_num_gpus: float = 0.0
    worker_num_cpus: float = 1.0
    worker_threads: int | None = None
    worker_cpus: str | None = None
    control_cpus: str | None = None
    worker_nice: int | None = 0
    control_nice: int | None = 5
    worker_resources: dict[str, float] = field(default_factory=dict)
    routing_policy: str = field(
        default=DEFAULT_POLICY, metadata={"choices": RoutingPolicy.registry}
    )
    routing_options: dict[str, Any] = field(default_factory=dict)
    on_worker_failure: FailureMode = field(
        default=FailureMode.REPLAY, metadata={"choices": FAILURE_MODES}
    )
    enable_pull: bool = True
    pull_min_blocks: int = 8
    pull_timeout_s: float = 5.0
    tier_host_block_cost: float = 0.05
    tier_disk_block_cost: float = 0.3
    lora_load_block_cost: float = 1.0
    enable_push: bool = True
    push_free_fraction: float = 0.1
    push_max_chains: int = 4
    stats_interval_s: float = 1.0
    rpc_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    max_prompt_chars: int = 1_000_000
    max_request_bytes: int = 8 * 1024 * 1024
    max_pending_grpc_calls: int = 20_000
    max_waiting_per_worker: int | None = 256
    max_inflight: int | None = 1024
    retry_after_s: float = 1.0
    lease_timeout_s: float = 10.0
    max_buffered_deltas: int = 64
    stall_timeout_s: float = 60.0
    drain_grace_s: float = 30.0
    fault_injection: bool = False
    router_replicas: int = 1
    router_max_replicas: int | None = None
    prefill_workers: int = 0
    decode_workers: int = 0
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    namespace: str = "pagedserve"
    name: str = "pagedserve"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tenant_policies(self.tenants))
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.on_worker_failure not in FAILURE_MODES:
            raise ValueError(
                f"on_worker_failure must be one of {FAILURE_MODES}, got {self.on_worker_failure!r}"
            )
        object.__setattr__(self, "on_worker_failure", FailureMode(self.on_worker_failure))
        if self.pull_min_blocks < 1:
            raise ValueError(f"pull_min_blocks must be >= 1, got {self.pull_min_blocks}")
        for name in ("tier_host_block_cost", "tier_disk_block_cost", "lora_load_block_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("max_waiting_per_worker", "max_inflight", "worker_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        timeouts = ("pull_timeout_s", "stats_interval_s", "rpc_timeout_s", "startup_timeout_s")
        others = ("retry_after_s", "push_free_fraction", "stall_timeout_s", "drain_grace_s")
        for name in (*timeouts, *others):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN fails every comparison
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        positive = ("max_prompt_chars", "max_request_bytes", "max_pending_grpc_calls")
        for name in (*positive, "push_max_chains"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_lease()
        self._check_placement()
        self._check_router_replicas()
        self._check_pool_bounds()
        self._check_roles()
        if self.max_buffered_deltas < 1:
            raise ValueError(f"max_buffered_deltas must be >= 1, got {self.max_buffered_deltas}")

    def _check_lease(self) -> None:
        lease = self.lease_timeout_s
        if not (lease > 0 and math.isfinite(lease)):
            raise ValueError(f"lease_timeout_s must be > 0 and finite, got {lease}")
        if lease < 4 * self.stats_interval_s:
            raise ValueError(
                f"lease_timeout_s ({lease}) must be >= 4 x stats_interval_s "
                f"({self.stats_interval_s}): the router renews leases every stats interval"
            )

    def _check_router_replicas(self) -> None:
        if self.router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, got {self.router_replicas}")
        ceiling = self.router_max_replicas
        if ceiling is not None and ceiling < self.router_replicas:
            raise ValueError(
                f"router_max_replicas ({ceiling}) must be >= router_replicas "
                f"({self.router_replicas}) or None"
            )

    def _check_pool_bounds(self) -> None:
        low, high = self.worker_bounds
        if low < 1:
            raise ValueError(f"min_workers must be >= 1, got {low}")
        if not low <= self.num_workers <= high:
            raise ValueError(
                f"the pool must start within its bounds: min_workers ({low}) <= num_workers "
                f"({self.num_workers}) <= max_workers ({high})"
            )
        seconds = ("scale_down_idle_s", "scale_interval_s", "scale_down_grace_s")
        for name in (*seconds, "scale_up_waiting_per_worker"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.scale_up_kv_usage <= 1:
            raise ValueError(f"scale_up_kv_usage must be in (0, 1], got {self.scale_up_kv_usage}")

    def _check_roles(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        low, _ = self.worker_bounds
        roles = self.prefill_workers + self.decode_workers
        if roles > low:
            raise ValueError(
                f"prefill_workers ({self.prefill_workers}) + decode_workers "
                f"({self.decode_workers}) must be <= num_workers ({self.num_workers}) and "
                f"min_workers ({low}): every worker of a role is one of the pool's"
            )
        if self.prefill_workers and self.prefill_workers == low:
            raise ValueError(
                f"prefill_workers ({self.prefill_workers}) leaves no worker that decodes: "
                "add decode_workers or raise num_workers (the rest are mixed)"
            )
        if self.decode_workers and self.decode_workers == low:
            raise ValueError(
                f"decode_workers ({self.decode_workers}) leaves no worker that prefills: "
                "add prefill_workers or raise num_workers (the rest are mixed)"
            )

    @property
    def disaggregated(self) -> bool:
        """Whether prefill/decode disaggregation is on (some worker has a role)."""
        return bool(self.prefill_workers or self.decode_workers)

    @property
    def worker_bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers), each `num_workers` where not set."""
        low = self.num_workers if self.min_workers is None else self.min_workers
        high = self.num_workers if self.max_workers is None else self.max_workers
        return low, high

    def _check_placement(self) -> None:
        for name in ("worker_nice", "control_nice"):
            value = getattr(self, name)
            if value is not None and not -20 <= value <= 19:
                raise ValueError(f"{name} must be in -20..19 (a niceness) or None, got {value}")
        if self.control_cpus is not None:
            parse_cpu_list(self.control_cpus, "control_cpus")
        if self.worker_cpus is None:
            return
        cpus = parse_cpu_list(self.worker_cpus, "worker_cpus")
        shares = [worker_share(cpus, i, self.num_workers) for i in range(self.num_workers)]
        smallest = min(len(share) for share in shares)
        if self.worker_threads is not None and self.worker_threads > smallest:
            raise ValueError(
                f"worker_threads ({self.worker_threads}) is more than the {smallest} core(s) "
                f"each worker gets of worker_cpus {self.worker_cpus!r}: its threads would "
                "fight over them"
            )

    def worker_cpu_share(self, index: int) -> tuple[int, ...] | None:
        """The cores worker `index` is pinned to (None: not pinned). Slices are cut for
        `num_workers`; a worker the pool adds beyond them shares slice `index % num_workers`."""
        if self.worker_cpus is None:
            return None
        slot = index % self.num_workers
        return worker_share(parse_cpu_list(self.worker_cpus), slot, self.num_workers)

    def worker_thread_count(self, index: int) -> int | None:
        """Torch threads of worker `index`: `worker_threads`, else one per core of its share,
        else None (Ray's default)."""
        if self.worker_threads is not None:
            return self.worker_threads
        share = self.worker_cpu_share(index)
        return len(share) if share is not None else None

    @property
    def control_cpu_set(self) -> tuple[int, ...] | None:
        """The control plane's cores (None: not pinned)."""
        return None if self.control_cpus is None else parse_cpu_list(self.control_cpus)

    @property
    def worker_engine(self) -> EngineConfig:
        """The engine config each worker is built from: `engine` with the cluster's queue bound
        and its tenants' weights."""
        fair_share = self.engine.fair_share
        if self.tenants:
            weights = {t: p.weight for t, p in self.tenants.items() if t != EVERY_TENANT}
            every = self.tenants.get(EVERY_TENANT)
            fair_share = replace(
                fair_share,
                tenant_weights={**fair_share.tenant_weights, **weights},
                default_weight=every.weight if every else fair_share.default_weight,
            )
        return replace(self.engine, max_waiting=self.max_waiting_per_worker, fair_share=fair_share)

    @property
    def limits(self) -> BackpressureLimits:
        """The backpressure limits, as `cluster_stats` reports them."""
        return BackpressureLimits(
            max_waiting_per_worker=self.max_waiting_per_worker,
            max_inflight=self.max_inflight,
            retry_after_s=self.retry_after_s,
        )

    def worker_name(self, index: int) -> str:
        return f"{self.name}-worker-{index}"

    @property
    def pool_name(self) -> str:
        return f"{self.name}-worker-pool"

    @property
    def index_name(self) -> str:
        return f"{self.name}-prefix-index"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        """Build from plain data (YAML, Serve args), naming any unknown key."""
        data = dict(data)
        engine = data.pop("engine", {}) or {}
        if isinstance(engine, dict):
            _check_keys("engine", engine, EngineConfig)
            engine = EngineConfig(**engine)
        _check_keys("cluster config", data, cls)
        return cls(engine=engine, **data)


def _check_keys(where: str, data: dict[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"unknown {where} keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
