"""Where the app's processes run: what Ray reserves for each worker, the cores workers and
the control plane are pinned to, and their niceness. Read by the worker pool's `WorkerSpec`
(`cluster/pool/spec.py`), the Router replica, the prefix index and `pagedserve serve`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.cluster.config.checks import at_least
from pagedserve.workers.process.cpu_placement import parse_cpu_list, worker_share


@dataclass(frozen=True)
class PlacementConfig:
    """Resources, cores and niceness of the workers and of the control plane.

    Attributes:
        worker_num_gpus: GPUs per worker actor (1 on GPU machines, 0 on CPU).
        worker_num_cpus: CPUs per worker actor (what Ray reserves for it).
        worker_threads: torch intra-op threads of each worker's engine (its
            `OMP_NUM_THREADS`). None: Ray's default, which is `worker_num_cpus` rounded down
            (at least 1), so each worker keeps to the cores it reserved and the router, proxy
            and index keep the rest. `pagedserve serve` without it (and without
            `worker_cpus`) gives each CPU worker its share of the machine's cores.
        worker_share_cores: the workers on one machine share its cores: before each step a
            worker runs its engine on the machine's cores divided among those of its workers
            that have work (at least 1 thread), so a worker alone with work has every core
            (`workers/process/core_share.py`). Only without `worker_threads` and
            `worker_cpus`. `pagedserve serve` turns it on where it starts more than one CPU
            worker on a machine and neither is given.
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
            `pagedserve serve`, of Serve's proxy and controller and Ray's daemons: the GCS,
            the raylet where the server may lower a niceness, the dashboard agent, the log
            monitor). 5 by default: a little below
            the worker, so that where they share cores the engine's threads run first (a
            preempted OpenMP thread stalls its whole team at the next barrier) and the
            control plane's per-token work fills the gaps (on 2 shared cores: streamed TPOT
            p50 0.66x of 0's in two alternated pairs, bench/README.md). None: Ray's 15.
        worker_resources: custom Ray resources per worker actor (to pin workers to nodes).
    """

    worker_num_gpus: float = 0.0
    worker_num_cpus: float = 1.0
    worker_threads: int | None = None
    worker_share_cores: bool = False
    worker_cpus: str | None = None
    control_cpus: str | None = None
    worker_nice: int | None = 0
    control_nice: int | None = 5
    worker_resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        at_least(self, 1, "worker_threads", optional=True)
        for name in ("worker_nice", "control_nice"):
            value = getattr(self, name)
            if value is not None and not -20 <= value <= 19:
                raise ValueError(f"{name} must be in -20..19 (a niceness) or None, got {value}")
        if self.control_cpus is not None:
            parse_cpu_list(self.control_cpus, "control_cpus")
        if self.worker_cpus is not None:
            parse_cpu_list(self.worker_cpus, "worker_cpus")
        if self.worker_share_cores and (self.worker_threads or self.worker_cpus):
            given = "worker_threads" if self.worker_threads else "worker_cpus"
            raise ValueError(
                f"worker_share_cores and {given} both set: shared cores set each step's "
                f"threads from the machine's cores; drop one"
            )

    def check_slices(self, num_slots: int) -> None:
        """`worker_threads` fits the cores of each of `num_slots` workers' slice of
        `worker_cpus` (the pool's first `num_workers`), and each slice has a core."""
        if self.worker_cpus is None:
            return
        cpus = parse_cpu_list(self.worker_cpus, "worker_cpus")
        smallest = min(len(worker_share(cpus, i, num_slots)) for i in range(num_slots))
        if self.worker_threads is not None and self.worker_threads > smallest:
            raise ValueError(
                f"worker_threads ({self.worker_threads}) is more than the {smallest} core(s) "
                f"each worker gets of worker_cpus {self.worker_cpus!r}: its threads would "
                "fight over them"
            )

    def worker_cpu_share(self, index: int, num_slots: int) -> tuple[int, ...] | None:
        """The cores worker `index` is pinned to (None: not pinned). Slices are cut for
        `num_slots` (the pool's first `num_workers`); a worker the pool adds beyond them
        shares slice `index % num_slots`."""
        if self.worker_cpus is None:
            return None
        slot = index % num_slots
        return worker_share(parse_cpu_list(self.worker_cpus), slot, num_slots)

    def worker_thread_count(self, index: int, num_slots: int) -> int | None:
        """Torch threads of worker `index`: `worker_threads`, else one per core of its share,
        else None (Ray's default)."""
        if self.worker_threads is not None:
            return self.worker_threads
        share = self.worker_cpu_share(index, num_slots)
        return len(share) if share is not None else None

    @property
    def control_cpu_set(self) -> tuple[int, ...] | None:
        """The control plane's cores (None: not pinned)."""
        return None if self.control_cpus is None else parse_cpu_list(self.control_cpus)
