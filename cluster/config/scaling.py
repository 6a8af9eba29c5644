"""How many of each part an app runs: workers (fixed or autoscaled, with their P/D roles)
and Router replicas. Read by the worker pool (`cluster/pool/`) and the app builder."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.config.checks import at_least, positive_finite


@dataclass(frozen=True)
class ScalingConfig:
    """The pool's size and when it changes; the Router's replicas.

    Attributes:
        num_workers: worker actors the pool starts with. `pagedserve serve` without it
            sizes to the machine: one per GPU, else two per NUMA node sharing its cores
            (`cluster/serve/node_layout.py`).
        min_workers: the fewest workers the pool scales down to. None: `num_workers`.
        max_workers: the most workers the pool scales up to. None: `num_workers` (with both
            None the pool is fixed). A rolling replacement (reconcile) briefly runs one
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
        prefill_workers: prefill/decode disaggregation (P/D): of the pool's workers, this
            many are `prefill` workers (fresh requests are routed among them by prefix hits
            and load; each hands its requests off once their first token went out), ...
        decode_workers: ... and this many `decode` workers (they continue the handed-off
            requests, their KV fetched from the prefill worker; least loaded, most free
            blocks first). The rest of `num_workers` are `mixed` (both). 0 and 0: no P/D,
            every worker mixed. A worker that replaces a lost one takes the role that is
            short; one the pool adds past the roles' counts is mixed
            (`cluster/routing/worker_roles.py`).
        router_replicas: Router replicas Serve runs (each one ingress of both proxies, with its
            own prefix view, liveness watch and `max_inflight`; any replica serves any call,
            Abort included). The floor when `router_max_replicas` is set.
        router_max_replicas: the ceiling of Serve's autoscaling of the Router between
            `router_replicas` and this (target: half of `max_inflight` streams per replica,
            so a replica scales out well before it refuses). None: a fixed `router_replicas`.
    """

    num_workers: int = 2
    min_workers: int | None = None
    max_workers: int | None = None
    scale_up_waiting_per_worker: float = 8.0
    scale_up_kv_usage: float = 0.9
    scale_down_idle_s: float = 300.0
    scale_interval_s: float = 1.0
    scale_down_grace_s: float = 30.0
    prefill_workers: int = 0
    decode_workers: int = 0
    router_replicas: int = 1
    router_max_replicas: int | None = None

    def __post_init__(self) -> None:
        at_least(self, 1, "num_workers", "router_replicas")
        at_least(self, 0, "prefill_workers", "decode_workers")
        positive_finite(
            self,
            "scale_down_idle_s",
            "scale_interval_s",
            "scale_down_grace_s",
            "scale_up_waiting_per_worker",
        )
        if not 0 < self.scale_up_kv_usage <= 1:
            raise ValueError(f"scale_up_kv_usage must be in (0, 1], got {self.scale_up_kv_usage}")
        self._check_bounds()
        self._check_roles()
        ceiling = self.router_max_replicas
        if ceiling is not None and ceiling < self.router_replicas:
            raise ValueError(
                f"router_max_replicas ({ceiling}) must be >= router_replicas "
                f"({self.router_replicas}) or None"
            )

    def _check_bounds(self) -> None:
        low, high = self.worker_bounds
        if low < 1:
            raise ValueError(f"min_workers must be >= 1, got {low}")
        if not low <= self.num_workers <= high:
            raise ValueError(
                f"the pool must start within its bounds: min_workers ({low}) <= num_workers "
                f"({self.num_workers}) <= max_workers ({high})"
            )

    def _check_roles(self) -> None:
        low, _ = self.worker_bounds
        if self.prefill_workers + self.decode_workers > low:
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
