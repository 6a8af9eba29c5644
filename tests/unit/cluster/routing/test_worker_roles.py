"""Prefill/decode disaggregation on the router's side, without Ray: the roles' config is
validated naming its fields, the pool gives each new worker the role that is short, a fresh
request's candidates are the workers that prefill and a handed-off one goes to the least
loaded worker that decodes (any routable worker when none of the role is left)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.cluster.config import ClusterConfig, RoutingConfig, ScalingConfig
from pagedserve.cluster.pool.migration import Migrations
from pagedserve.cluster.pool.spec import WorkerSpec
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.types import RouterCounters
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.worker_roles import DECODE_PHASE, PREFILL_PHASE
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.protocol.stats import KVUsage, WorkerInfo, WorkerStats
from pagedserve.workers.telemetry.telemetry import NOOP

P, D, M = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.MIXED


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill_workers": -1}, "prefill_workers must be >= 0"),
        ({"decode_workers": -2}, "decode_workers must be >= 0"),
        ({"prefill_workers": 2, "decode_workers": 1}, r"prefill_workers \(2\) \+ decode_workers"),
        ({"prefill_workers": 2}, "leaves no worker that decodes"),
        ({"decode_workers": 2}, "leaves no worker that prefills"),
        (
            {
                "num_workers": 3,
                "min_workers": 1,
                "max_workers": 3,
                "prefill_workers": 1,
                "decode_workers": 1,
            },
            r"min_workers \(1\)",
        ),
    ],
)
def test_role_counts_are_validated_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**fields)


def test_role_counts_that_fit_the_pool_are_taken():
    assert not ClusterConfig().scaling.disaggregated
    config = ClusterConfig(
        scaling=ScalingConfig(
            num_workers=3,
            prefill_workers=1,
            decode_workers=1,
        ),
    )
    assert config.scaling.disaggregated and config.from_dict(config.to_dict()) == config
    assert ClusterConfig(
        scaling=ScalingConfig(
            prefill_workers=1,  # 1 prefill + 1 mixed
        ),
    ).scaling.disaggregated  # 1 prefill + 1 mixed


def test_a_new_worker_takes_the_role_that_is_short_prefill_first():
    spec = WorkerSpec.of(
        ClusterConfig(
            scaling=ScalingConfig(
                num_workers=4,
                prefill_workers=1,
                decode_workers=2,
            ),
        )
    )
    assert spec.role_for_new([]) is P
    assert spec.role_for_new([P]) is D
    assert spec.role_for_new([P, D]) is D
    assert spec.role_for_new([D, P, D]) is M  # the layout is full: the rest are mixed
    assert spec.role_for_new([D, D]) is P  # a lost prefill worker is replaced by one
    assert WorkerSpec.of(ClusterConfig()).role_for_new([M, M]) is M
    # The layout shapes the workers: changing it rolls them (a new fingerprint).
    assert (
        spec.fingerprint
        != WorkerSpec.of(
            ClusterConfig(
                scaling=ScalingConfig(num_workers=4),
            )
        ).fingerprint
    )


def worker(worker_id: str, role: WorkerRole, *, requests: int = 0, used: int = 0, **state):
    info = WorkerInfo(worker_id, "e", "tiny-llama", 8, 256, 512, 100, role=role)
    names = [f.name for f in dataclasses.fields(KVUsage)]
    kv = KVUsage(
        **{**dict.fromkeys(names, 0), "block_size": 8, "total_blocks": 100, "used_blocks": used}
    )
    stats = WorkerStats(worker_id, "e", kv, num_running=requests, role=role)
    return WorkerState(worker_id, None, info=info, stats=stats, **{"alive": True, **state})


def migrations(*workers: WorkerState, disaggregated: bool = True) -> Migrations:
    by_id = {w.worker_id: w for w in workers}
    return Migrations(
        RoutingConfig(),
        10.0,
        disaggregated,
        None,
        by_id,
        NOOP,
        RouterCounters(),
        RouterMetrics(False, dict),
    )


def test_a_fresh_request_goes_to_workers_that_prefill():
    workers = [worker("p", P), worker("d", D), worker("m", M)]
    assert PREFILL_PHASE.unfit(workers) == (frozenset({"d"}), False)
    assert DECODE_PHASE.unfit(workers) == (frozenset({"p"}), False)
    # No worker that prefills is routable: every routable one may take it (a fallback).
    down = [dataclasses.replace(workers[0], alive=False), workers[1]]
    assert PREFILL_PHASE.unfit(down) == (frozenset(), True)
    assert PREFILL_PHASE.split(down) == ([workers[1]], True)


def test_a_handed_off_request_goes_to_the_least_loaded_worker_that_decodes():
    prefill = worker("p", P)  # idle, but it does not decode
    busy = worker("d1", D, requests=3)
    full = worker("d2", D, requests=1, used=90)
    roomy = worker("d3", D, requests=1, used=10)
    moves = migrations(prefill, busy, full, roomy)
    # Fewest requests first, then the most free blocks (its KV must fit).
    assert moves.move_target("p").worker_id == "d3"
    assert moves.move_target("p", exclude=frozenset({"d3"})).worker_id == "d2"
    assert moves.counters.pd_fallbacks == 0


def test_with_no_decode_worker_left_any_routable_worker_continues_it():
    prefill = worker("p1", P, requests=2)
    other = worker("p2", P)
    gone = worker("d", D, alive=False)
    moves = migrations(prefill, other, gone)
    assert moves.move_target("p1").worker_id == "p2"
    assert moves.counters.pd_fallbacks == 1
    with pytest.raises(NoWorkerAvailable):
        moves.move_target("p1", exclude=frozenset({"p1", "p2"}))


def test_without_roles_a_move_goes_to_the_least_loaded_peer_as_before():
    a, b = worker("a", M, requests=1), worker("b", M, requests=2)
    moves = migrations(a, b, disaggregated=False)
    assert moves.move_target("b").worker_id == "a"
    assert moves.move_target("a").worker_id == "b"  # never back to its source while a peer is up
    assert moves.counters.pd_fallbacks == 0


def test_a_handoff_after_prefill_is_traced_and_counted_as_a_pd_transfer():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagedserve.workers.protocol.handoff import HandoffReason, RequestHandoff
    from pagedserve.workers.protocol.sampling import SamplingParams
    from pagedserve.workers.telemetry.telemetry import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    moves = migrations(worker("p", P), worker("d", D))
    moves.tracing = Tracing(provider.get_tracer("test"), provider)
    handoff = RequestHandoff.replay(
        "r", list(range(20)), [7], 1, SamplingParams(), priority=0,
        cache_extra_keys=("tiny-llama",), block_size=8, deadline_remaining_s=None,
    )  # fmt: skip
    handoff = dataclasses.replace(handoff, num_computed_tokens=20, reason=HandoffReason.PREFILLED)
    target = moves.move_target("p")
    moves.move_span(None, handoff, "p", target).end()
    moves.on_moved(handoff)
    moved = dataclasses.replace(handoff, reason=HandoffReason.PREEMPTED)
    moves.move_span(None, moved, "p", target).end()
    moves.on_moved(moved)
    pd, move = exporter.get_finished_spans()
    assert (pd.name, move.name) == ("pd.transfer", "migration.move")
    assert pd.attributes["pagedserve.pd.prefill_worker"] == "p"
    assert pd.attributes["pagedserve.pd.decode_worker"] == "d"
    assert (pd.attributes["pagedserve.pd.tokens"], pd.attributes["pagedserve.pd.kv_tokens"]) == (
        21,
        20,
    )
    counters = moves.counters
    assert (counters.pd_handoffs, counters.pd_handoff_tokens, counters.moves) == (1, 20, 1)
