"""What a worker actor is built from, its fingerprint, and the one place workers are created.

`WorkerSpec` holds everything of a `ClusterConfig` that shapes a worker (its engine config,
its Ray resources and placement, its stream and drain settings, the P/D layout) and nothing
that only the routers read,
so that its `fingerprint` changes exactly when a running worker no longer matches the app:
the worker pool (`cluster/pool/pool.py`) then replaces it (reconcile). Each worker is given
the fingerprint of the spec it was built from and reports it in `WorkerInfo`, so the pool
can tell a stale worker from a current one even after the pool itself restarted.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ClusterConfig, PlacementConfig
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.process import drain_signal
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.ray_internals import setup_hook_env_var
from pagedserve.workers.telemetry.telemetry import TelemetryConfig, otel_env
from pagedserve.workers.worker.actor import Worker

# Generous: a worker streams many requests at once, each a long-lived generator call.
WORKER_MAX_CONCURRENCY = 4096


@dataclass(frozen=True)
class WorkerSpec:
    """How every worker of one app is built (see the module docstring).

    Attributes:
        engine: the engine config (with the cluster's queue bound).
        num_gpus, num_cpus, resources: what Ray reserves for each worker actor.
        worker_threads, worker_cpus, num_slots: torch threads and CPU pinning
            (`PlacementConfig.worker_thread_count` / `worker_cpu_share`).
        share_cores: each worker runs on its share of its machine's cores
            (`PlacementConfig.worker_share_cores`).
        nice: each worker's niceness.
        lease_timeout_s, max_buffered_deltas: the worker's stream settings.
        drain_grace_s: how long its open streams get to finish when SIGTERM drains it.
        fault_injection: create `FaultInjectingWorker` actors (soaks and failure tests).
        index_name, namespace: where its prefix index and its name live.
        prefill_workers, decode_workers: the P/D layout (`ScalingConfig`): how many workers
            of each role the pool keeps; each worker is created with one (`role_for_new`).
    """

    engine: EngineConfig
    num_gpus: float
    num_cpus: float
    resources: tuple[tuple[str, float], ...]
    worker_threads: int | None
    worker_cpus: str | None
    num_slots: int
    nice: int | None
    lease_timeout_s: float
    max_buffered_deltas: int
    drain_grace_s: float
    index_name: str
    namespace: str
    prefill_workers: int = 0
    decode_workers: int = 0
    fault_injection: bool = False
    share_cores: bool = False

    @classmethod
    def of(cls, config: ClusterConfig) -> WorkerSpec:
        """The spec of `config`'s workers: its engine (with the limits' queue bound and
        tenant weights), placement, stream limits, drain grace and P/D layout."""
        engine = config.worker_engine
        placement, scaling, failure = config.placement, config.scaling, config.failure
        # A tensor-parallel worker is one actor whose ranks are its child processes: it
        # reserves k devices' worth, on one node (`docs/tensor-parallel.md`).
        ranks = engine.tensor_parallel_size
        return cls(
            engine=engine,
            num_gpus=placement.worker_num_gpus * ranks,
            num_cpus=placement.worker_num_cpus * ranks,
            resources=tuple(sorted(placement.worker_resources.items())),
            worker_threads=placement.worker_threads,
            worker_cpus=placement.worker_cpus,
            num_slots=scaling.num_workers,
            nice=placement.worker_nice,
            lease_timeout_s=failure.lease_timeout_s,
            max_buffered_deltas=config.limits.max_buffered_deltas,
            drain_grace_s=failure.drain_grace_s,
            index_name=config.actors.index_name,
            namespace=config.namespace,
            prefill_workers=scaling.prefill_workers,
            decode_workers=scaling.decode_workers,
            fault_injection=failure.fault_injection,
            share_cores=placement.worker_share_cores,
        )

    def role_for_new(self, roles: Iterable[WorkerRole]) -> WorkerRole:
        """The role of a worker added beside workers of `roles`: the first one short of its
        count (prefill, then decode), else mixed."""
        held = Counter(roles)
        wanted = (
            (WorkerRole.PREFILL, self.prefill_workers),
            (WorkerRole.DECODE, self.decode_workers),
        )
        return next((role for role, count in wanted if held[role] < count), WorkerRole.MIXED)

    @property
    def fingerprint(self) -> str:
        """A short digest of the whole spec: equal specs, equal fingerprints, in any process."""
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _placement(self) -> PlacementConfig:
        """The placement rules live on `PlacementConfig`; one with just these fields."""
        return PlacementConfig(worker_threads=self.worker_threads, worker_cpus=self.worker_cpus)


def worker_class(spec: WorkerSpec) -> type[Worker]:
    """The production `Worker`, or with `fault_injection` its subclass that takes faults."""
    if not spec.fault_injection:
        return Worker
    from pagedserve.workers.worker.fault_injection import FaultInjectingWorker

    return FaultInjectingWorker


def create_worker(
    spec: WorkerSpec,
    worker_id: str,
    slot: int,
    telemetry: TelemetryConfig,
    role: WorkerRole = WorkerRole.MIXED,
) -> ActorHandle:
    """Get or create the named, detached worker actor `worker_id` (slot: its counter) with its
    P/D `role`.

    Ray restarts a crashed worker (max_restarts) and a router revives it once it answers. The
    worker gets the telemetry settings, this process's OTEL_* variables in its runtime env, and
    `OMP_NUM_THREADS` when threads or pinning are set (torch reads it at import). Its process
    runs the setup hook that makes SIGTERM drain it (`workers/process/drain_signal.py`).
    """
    placement = spec._placement()
    env = {**otel_env(), setup_hook_env_var(): drain_signal.SETUP_HOOK}
    threads = placement.worker_thread_count(slot, spec.num_slots)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return (
        ray.remote(worker_class(spec))
        .options(
            name=worker_id,
            namespace=spec.namespace,
            get_if_exists=True,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=0,
            num_gpus=spec.num_gpus,
            num_cpus=spec.num_cpus,
            resources=dict(spec.resources),
            max_concurrency=WORKER_MAX_CONCURRENCY,
            runtime_env={"env_vars": env},
        )
        .remote(
            worker_id,
            spec.engine,
            spec.index_name,
            spec.namespace,
            telemetry,
            lease_timeout_s=spec.lease_timeout_s,
            max_buffered_deltas=spec.max_buffered_deltas,
            cpus=placement.worker_cpu_share(slot, spec.num_slots),
            nice=spec.nice,
            config_fingerprint=spec.fingerprint,
            drain_grace_s=spec.drain_grace_s,
            role=role,
            share_cores=spec.share_cores,
        )
    )
