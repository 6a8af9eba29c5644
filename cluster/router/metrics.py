"""Prometheus metrics of the cluster, served by the router at `GET /metrics` (HTTP port).

Why `prometheus_client` in the router, not `ray.util.metrics`: everything is already seen here.
Per-request timings arrive on each request's last delta (`RequestMetrics`), and every worker's
load and KV breakdown arrive with the router's stats poll, so one registry in the router holds
the per-worker series (label `worker`) and the cluster-wide ones (`sum without (worker)`), on
an endpoint that works without Ray's per-node metrics agent or its export port.

Counters and histograms are recorded as events happen; worker gauges (and the prefix-cache
counters, which the workers count cumulatively) are read from the last poll at scrape time.
Without `prometheus_client`, or with `telemetry.metrics: false`, `RouterMetrics` is a no-op.

Several Router replicas: the worker series are cluster-wide already (every replica polls every
worker), and so are `pagedserve_cluster_router_events_total` (every replica's `RouterCounters`
summed, `cluster/router/reports.py`, read as the scrape arrives), `pagedserve_router_replicas`
and `pagedserve_cluster_requests_inflight`. The request counters and latency histograms above
are the answering replica's own (label-free: a scrape reaches one replica through Serve).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.cluster.router.reports import ClusterRouters
    from pagedserve.cluster.router.types import MigrationKind
    from pagedserve.workers.protocol.stats import WorkerStats

logger = logging.getLogger(__name__)
# worker id → (alive, its last stats or None): what the router's poll last saw.
WorkerStatsByWorker = dict[str, tuple[bool, "WorkerStats | None"]]

# Seconds; serving latencies from a CPU tiny model (ms) to long GPU generations (minutes).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    """Owns one Prometheus registry: the router's counters and histograms, and a collector that
    turns the last polled worker stats into gauges.

    Args:
        enabled: False (or no `prometheus_client`): every method does nothing.
        worker_stats: returns {worker_id: (alive, last `WorkerStats` or None)} from the
            router's last poll.
        cluster_routers: returns every replica's counters summed, as last read (None: not
            read yet, or the index did not answer).
    """

    def __init__(
        self,
        enabled: bool,
        worker_stats: Callable[[], WorkerStatsByWorker],
        cluster_routers: Callable[[], ClusterRouters | None] = lambda: None,
    ) -> None:
        self.registry = None
        if not enabled:
            return
        try:
            import prometheus_client as prom
        except ImportError:
            logger.warning("prometheus_client is not installed; metrics are off")
            return
        self.registry = prom.CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.routed = prom.Counter(
            "pagedserve_routing_decisions", "Routing decisions", ["policy", "outcome"], registry=reg
        )
        self.migrations = prom.Counter(
            "pagedserve_migrations", "KV migrations (pull, push, move)", ["kind"], registry=reg
        )
        self.migrated_blocks = prom.Counter(
            "pagedserve_migrated_blocks", "KV blocks migrated", ["kind"], registry=reg
        )
        self.pd_handoffs = prom.Counter(
            "pagedserve_pd_handoffs",
            "Requests handed from a prefill worker to a decode worker (P/D)",
            registry=reg,
        )
        self.pd_handoff_tokens = prom.Counter(
            "pagedserve_pd_handoff_tokens",
            "KV tokens the P/D handoffs carried",
            registry=reg,
        )
        self.requests = prom.Counter(
            "pagedserve_requests", "Finished requests", ["worker", "finish_reason"], registry=reg
        )
        self.preemptions = prom.Counter(
            "pagedserve_preemptions", "Preemptions of finished requests", ["worker"], registry=reg
        )
        self.tokens = prom.Counter(
            "pagedserve_tokens",
            "Tokens by kind (prompt, generation)",
            ["worker", "kind"],
            registry=reg,
        )
        self.histograms = {
            name: prom.Histogram(
                f"pagedserve_{name}_seconds", doc, ["worker"], buckets=LATENCY_BUCKETS, registry=reg
            )
            for name, doc in (
                ("queue_time", "Time from arrival to first scheduled"),
                ("ttft", "Time to first token"),
                ("inter_token_latency", "Time between consecutive tokens"),
                ("e2e_latency", "Time from arrival to finish"),
            )
        }
        reg.register(_WorkerCollector(worker_stats))
        reg.register(_ClusterRouterCollector(cluster_routers))

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    def on_routed(self, policy: str, outcome: str) -> None:
        if self.enabled:
            self.routed.labels(policy, outcome).inc()

    def on_migration(self, kind: MigrationKind, blocks: int = 0) -> None:
        if self.enabled:
            self.migrations.labels(kind).inc()
            self.migrated_blocks.labels(kind).inc(blocks)

    def on_pd_handoff(self, tokens: int) -> None:
        if self.enabled:
            self.pd_handoffs.inc()
            self.pd_handoff_tokens.inc(tokens)

    def on_finished(self, delta: Any) -> None:
        """A branch's last delta: its usage and the request's timings."""
        if not self.enabled or delta.finish_reason is None:
            return
        worker = delta.worker_id or "unknown"
        self.requests.labels(worker, str(delta.finish_reason)).inc()
        if delta.usage is not None:
            self.tokens.labels(worker, "prompt").inc(delta.usage.prompt_tokens)
            self.tokens.labels(worker, "generation").inc(delta.usage.completion_tokens)
        m = delta.metrics
        if m is None or delta.index != 0:  # timings are per request: count them once
            return
        self.preemptions.labels(worker).inc(m.num_preemptions)
        for name, value in (("queue_time", m.queue_time), ("ttft", m.ttft), ("e2e_latency", m.e2e)):
            if value is not None:
                self.histograms[name].labels(worker).observe(max(0.0, value))
        for gap in m.inter_token_latencies:
            self.histograms["inter_token_latency"].labels(worker).observe(gap)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        if not self.enabled:
            return b""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _WorkerCollector:
    """Gauges (and cumulative counters) from each worker's last polled stats."""

    def __init__(self, worker_stats: Callable[[], WorkerStatsByWorker]) -> None:
        self.worker_stats = worker_stats

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pagedserve_{name}", doc, labels=["worker", *(extra or [])])

        up = gauge("worker_up", "1 when the worker answers")
        running = gauge("requests_running", "Sequences running on the worker")
        waiting = gauge("requests_waiting", "Sequences waiting on the worker")
        usage = gauge("kv_usage_fraction", "Fraction of KV blocks in use by requests")
        blocks = gauge("kv_blocks", "KV blocks by state", ["state"])
        positions = gauge("kv_positions", "KV token positions: useful and tail waste", ["kind"])
        queries = CounterMetricFamily(
            "pagedserve_prefix_cache_queries_tokens", "Prompt tokens looked up", labels=["worker"]
        )
        hits = CounterMetricFamily(
            "pagedserve_prefix_cache_hits_tokens", "Prompt tokens found cached", labels=["worker"]
        )
        spec = {
            "num_draft_tokens": "Speculative draft tokens verified",
            "num_accepted_tokens": "Speculative draft tokens accepted",
            "num_emitted_tokens": "Tokens emitted by verify steps (accepted + the target's own)",
            "num_verified": "Request-steps that verified drafts",
        }
        spec_counters = {
            name: CounterMetricFamily(
                f"pagedserve_spec_{name.removeprefix('num_')}", doc, labels=["worker"]
            )
            for name, doc in spec.items()
        }
        acceptance = gauge("spec_acceptance_rate", "Accepted / verified draft tokens")
        spec_seconds = CounterMetricFamily(
            "pagedserve_spec_seconds",
            "Time proposing and verifying drafts",
            labels=["worker", "phase"],
        )
        role = gauge("worker_role", "1 for the worker's P/D role", ["role"])
        adopted = CounterMetricFamily(
            "pagedserve_adopted_handoffs",
            "Handoffs a worker adopted: with their KV imported, or recomputed from tokens",
            labels=["worker", "kv"],
        )
        tier_families = _tier_families(gauge, CounterMetricFamily)
        service = CounterMetricFamily(
            "pagedserve_tenant_service_tokens",
            "Tokens a worker computed for a tenant (kind: prompt, output)",
            labels=["worker", "tenant", "kind"],
        )
        virtual = gauge(
            "tenant_virtual_tokens", "A tenant's virtual token counter (fair share)", ["tenant"]
        )
        adapters = gauge(
            "lora_adapter", "1 per LoRA adapter a worker has (state: loaded, resident)",
            ["adapter", "state"],
        )  # fmt: skip
        adapter_requests = gauge(
            "lora_requests", "Requests on a LoRA adapter in a worker's engine", ["adapter"]
        )
        for worker_id, (alive, stats) in sorted(self.worker_stats().items()):
            up.add_metric([worker_id], 1.0 if alive else 0.0)
            if stats is None:
                continue
            kv = stats.kv
            running.add_metric([worker_id], stats.num_running)
            waiting.add_metric([worker_id], stats.num_waiting)
            usage.add_metric([worker_id], kv.used_blocks / (kv.total_blocks or 1))
            for state, value in (
                ("used", kv.used_blocks),
                ("cached", kv.cached_free_blocks),
                ("free", kv.free_blocks),
                ("reserve", kv.reserve_blocks),
            ):
                blocks.add_metric([worker_id, state], value)
            positions.add_metric([worker_id, "useful"], kv.useful_tokens)
            positions.add_metric([worker_id, "tail_waste"], kv.wasted_positions)
            queries.add_metric([worker_id], kv.prefix_queries_tokens)
            hits.add_metric([worker_id], kv.prefix_hits_tokens)
            for name, family in spec_counters.items():
                family.add_metric([worker_id], getattr(stats.spec, name))
            acceptance.add_metric([worker_id], stats.spec.acceptance_rate)
            spec_seconds.add_metric([worker_id, "draft"], stats.spec.draft_time_s)
            spec_seconds.add_metric([worker_id, "verify"], stats.spec.verify_time_s)
            _add_tier_metrics(tier_families, worker_id, stats.tiers)
            role.add_metric([worker_id, str(stats.role)], 1.0)
            for name, _ in stats.lora_adapters:
                adapters.add_metric([worker_id, name, "loaded"], 1.0)
            for name in stats.resident_loras:
                adapters.add_metric([worker_id, name, "resident"], 1.0)
            for name, count in stats.lora_requests:
                adapter_requests.add_metric([worker_id, name], count)
            adopted.add_metric([worker_id, "imported"], stats.adopted_with_kv)
            adopted.add_metric([worker_id, "recomputed"], stats.adopted_recomputed)
            for tenant, used in sorted(stats.tenants.items()):
                service.add_metric([worker_id, tenant, "prompt"], used.prompt_tokens)
                service.add_metric([worker_id, tenant, "output"], used.output_tokens)
                virtual.add_metric([worker_id, tenant], used.counter)
        yield from (up, running, waiting, usage, blocks, positions, queries, hits, role, adopted)
        yield from (service, virtual, adapters, adapter_requests)
        yield from (*spec_counters.values(), acceptance, spec_seconds)
        yield from tier_families.values()


# The host and disk KV tiers (`TierStats`): metric name → (TierUsage field, help, is a counter).
_TIER_METRICS: dict[str, tuple[str, str, bool]] = {
    "kv_tier_blocks": ("blocks", "KV blocks held in a lower tier", False),
    "kv_tier_bytes": ("bytes", "Bytes held in a lower tier", False),
    "kv_tier_capacity_bytes": ("capacity_bytes", "A lower tier's bound in bytes", False),
    "kv_tier_hit_blocks": ("hit_blocks", "Blocks loaded back from a lower tier", True),
    "kv_tier_stored_blocks": ("stored_blocks", "Blocks written into a lower tier", True),
    "kv_tier_evicted_blocks": ("evicted_blocks", "Blocks a lower tier's bound pushed out", True),
    "kv_tier_bytes_in": ("bytes_in", "KV bytes written into a lower tier", True),
    "kv_tier_bytes_out": ("bytes_out", "KV bytes loaded from a lower tier", True),
    "kv_tier_load_seconds": ("load_time_s", "Time reading a lower tier's blocks", True),
}


def _tier_families(gauge, counter) -> dict[str, Any]:
    return {
        name: (
            counter(f"pagedserve_{name}", doc, labels=["worker", "tier"])
            if is_counter
            else gauge(name, doc, ["tier"])
        )
        for name, (_, doc, is_counter) in _TIER_METRICS.items()
    }


def _add_tier_metrics(families: dict[str, Any], worker_id: str, tiers) -> None:
    for usage in tiers.tiers:
        for name, (field_name, _, _) in _TIER_METRICS.items():
            families[name].add_metric([worker_id, usage.tier], getattr(usage, field_name))


class _ClusterRouterCollector:
    """Every router replica's counters summed, the live replicas and their open requests."""

    def __init__(self, cluster_routers: Callable[[], ClusterRouters | None]) -> None:
        self.cluster_routers = cluster_routers

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cluster = self.cluster_routers()
        if cluster is None:
            return
        events = CounterMetricFamily(
            "pagedserve_cluster_router_events",
            "Router counters (routed, migrations, replays, refusals, ...) of every replica",
            labels=["event"],
        )
        tenants = CounterMetricFamily(
            "pagedserve_tenant_requests",
            "Requests of a tenant, every replica (admitted, refused_inflight, refused_tokens)",
            labels=["tenant", "outcome"],
        )
        tenant_tokens = CounterMetricFamily(
            "pagedserve_tenant_tokens",
            "Tokens of a tenant's requests, every replica (prompt, output)",
            labels=["tenant", "kind"],
        )
        for name, value in sorted(cluster.counters.as_dict().items()):
            if not name.startswith("tenant."):  # labelled below
                events.add_metric([name], value)
        for tenant, counts in sorted(cluster.counters.tenants.items()):
            for outcome in ("admitted", "refused_inflight", "refused_tokens"):
                tenants.add_metric([tenant, outcome], getattr(counts, outcome))
            tenant_tokens.add_metric([tenant, "prompt"], counts.prompt_tokens)
            tenant_tokens.add_metric([tenant, "output"], counts.output_tokens)
        replicas = GaugeMetricFamily("pagedserve_router_replicas", "Router replicas reporting")
        replicas.add_metric([], len(cluster.replicas))
        inflight = GaugeMetricFamily(
            "pagedserve_cluster_requests_inflight",
            "Requests every router replica has open on the worker",
            labels=["worker"],
        )
        for worker_id, n in sorted(cluster.inflight.items()):
            inflight.add_metric([worker_id], n)
        yield from (events, replicas, inflight, tenants, tenant_tokens)
