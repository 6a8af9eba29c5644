"""The worker pool's pure parts: the planner's decisions, the membership and its router acks,
the pool bounds of `ScalingConfig`, the worker spec's fingerprint, and a router's follower
applying joins and leaves (fake handles, no Ray)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pagedserve.cluster.config import (
    ClusterConfig,
    PlacementConfig,
    RoutingConfig,
    ScalingConfig,
)
from pagedserve.cluster.index.view import PrefixView
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.follower import PoolFollower
from pagedserve.cluster.pool.members import PoolMembers
from pagedserve.cluster.pool.planner import (
    ActionKind,
    Observation,
    PoolAction,
    PoolPlanner,
    Reason,
    ScalingSettings,
)
from pagedserve.cluster.pool.spec import WorkerSpec
from pagedserve.cluster.pool.types import MemberState
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.engine.config import EngineConfig

SERVING, STARTING, LEAVING = MemberState.SERVING, MemberState.STARTING, MemberState.LEAVING
SETTINGS = ScalingSettings(
    min_workers=1, max_workers=3, up_waiting_per_worker=4, up_kv_usage=0.9, down_idle_s=10
)


def seen(slot: int, waiting=0, running=0, streams=0, kv=0.0, state=SERVING, fp="new"):
    return Observation(f"w{slot}", state, fp, slot, waiting, running, streams, kv)


def lost(slot: int, fp="new") -> Observation:
    """A member whose stats call found its actor gone for good (no load known)."""
    return Observation(f"w{slot}", SERVING, fp, slot, gone=True)


def add(reason: Reason) -> PoolAction:
    return PoolAction(ActionKind.ADD, reason)


def retire(reason: Reason, worker_id: str) -> PoolAction:
    return PoolAction(ActionKind.RETIRE, reason, worker_id)


# ------------------------------------------------------------------ planner
def test_scale_up_on_the_mean_waiting_queue_or_kv_usage_up_to_max():
    planner = PoolPlanner(SETTINGS, target=1, fingerprint="new")
    assert planner.decide(0, [seen(0, waiting=3)]) is None  # below 4 waiting
    assert planner.decide(1, [seen(0, waiting=4)]) == add(Reason.LOAD)
    assert planner.target == 2
    # The new worker starting: nothing else happens meanwhile.
    assert planner.decide(2, [seen(0, waiting=9), seen(1, state=STARTING)]) is None
    # Mean waiting (8 + 0) / 2 = 4: up again; then KV usage alone.
    assert planner.decide(3, [seen(0, waiting=8), seen(1)]) == add(Reason.LOAD)
    full = [seen(0, kv=0.95), seen(1, kv=0.9), seen(2, kv=0.9)]
    assert planner.decide(4, full) is None  # at max_workers (3)
    assert planner.target == 3


def test_scale_down_retires_the_newest_idle_worker_after_the_idle_time_down_to_min():
    planner = PoolPlanner(SETTINGS, target=3, fingerprint="new")
    busy = seen(0, running=1)
    assert planner.decide(0, [busy, seen(1), seen(2)]) is None  # idle clocks start
    assert planner.decide(9, [busy, seen(1), seen(2)]) is None  # 9 s < 10 s
    assert planner.decide(10, [busy, seen(1), seen(2)]) == retire(Reason.IDLE, "w2")
    assert planner.target == 2
    assert planner.decide(11, [busy, seen(1), seen(2, state=LEAVING)]) is None
    # w1 was busy for one round: its clock starts again.
    assert planner.decide(12, [busy, seen(1, streams=1)]) is None
    assert planner.decide(13, [busy, seen(1)]) is None
    assert planner.decide(23, [busy, seen(1)]) == retire(Reason.IDLE, "w1")
    assert planner.decide(50, [seen(0)]) is None  # at min_workers (1)


def test_no_scale_down_while_the_signal_holds_and_none_below_target():
    planner = PoolPlanner(SETTINGS, target=3, fingerprint="new")
    loaded = [seen(0, waiting=20), seen(1, waiting=20), seen(2)]
    planner.decide(0, loaded)
    assert planner.decide(100, loaded) is None  # w2 idle long, but the pool is loaded
    planner.start_failed(serving=2)
    assert planner.target == 2
    assert planner.decide(101, [seen(0)]) == add(Reason.TARGET)


def test_reconcile_adds_a_current_worker_then_retires_the_oldest_stale_one():
    planner = PoolPlanner(SETTINGS, target=2, fingerprint="new")
    stale = [seen(0, fp="old"), seen(1, fp="old")]
    assert planner.decide(0, stale) == add(Reason.RECONCILE)  # surge first: 3 serving
    assert planner.decide(1, [*stale, seen(2, state=STARTING)]) is None
    assert planner.decide(2, [*stale, seen(2)]) == retire(Reason.RECONCILE, "w0")
    assert planner.decide(3, [stale[1], seen(2)]) == add(Reason.RECONCILE)
    assert planner.decide(4, [stale[1], seen(2), seen(3)]) == retire(Reason.RECONCILE, "w1")
    assert planner.decide(5, [seen(2), seen(3)]) is None
    assert planner.target == 2


def test_a_lost_worker_is_removed_at_once_then_replaced_to_keep_the_target():
    planner = PoolPlanner(SETTINGS, target=2, fingerprint="new")
    # Removed even while another member starts, and whatever the load says: it serves no more.
    starting = [seen(0, waiting=50), lost(1), seen(2, state=STARTING)]
    assert planner.decide(0, starting) == PoolAction(ActionKind.REMOVE, Reason.LOST, "w1")
    assert planner.target == 2  # a loss is not a scale-down
    # The oldest lost one first; then, one serving of a target of two: its replacement.
    assert planner.decide(1, [lost(3), seen(0), lost(1)]).worker_id == "w1"
    assert planner.decide(2, [seen(0)]) == add(Reason.TARGET)
    # At min_workers too: the pool never stays below it because a worker died.
    floor = PoolPlanner(SETTINGS, target=1, fingerprint="new")
    assert floor.decide(0, [lost(0)]).kind == ActionKind.REMOVE
    assert floor.decide(1, []) == add(Reason.TARGET)
    # A lost stale worker (mid-roll) is removed, not retired through a drain it cannot do.
    rolling = PoolPlanner(SETTINGS, target=1, fingerprint="new")
    assert rolling.decide(0, [lost(0, fp="old"), seen(1)]).kind == ActionKind.REMOVE


def test_new_bounds_clamp_the_target_and_the_surplus_leaves_idle_first():
    planner = PoolPlanner(SETTINGS, target=3, fingerprint="new")
    narrow = dataclasses.replace(SETTINGS, max_workers=2)
    planner.configure(narrow, "new", target=3)
    assert planner.target == 2
    observed = [seen(0), seen(1, running=2), seen(2, running=1)]
    assert planner.decide(0, observed) == retire(Reason.TARGET, "w0")  # the only idle one


# ------------------------------------------------------------------ members
def test_membership_versions_names_and_router_acks():
    members = PoolMembers(lambda i: f"app-worker-{i}")
    members.adopt_slot(4)  # a worker app-worker-4 exists (the pool restarted)
    name, slot = members.new_name()
    assert (name, slot) == ("app-worker-5", 5)
    members.add(name, handle="h5")
    v1 = members.version
    members.ack("r1", None, now=0.0)
    members.ack("r2", v1, now=0.0)
    assert not members.routers_caught_up(v1, now=1.0, lease_s=10)  # r1 holds nothing yet
    members.ack("r1", v1, now=1.0)
    assert members.routers_caught_up(v1, now=1.0, lease_s=10)
    members.set_state(name, LEAVING)
    v2 = members.version
    members.ack("r1", v2, now=2.0)
    assert not members.routers_caught_up(v2, now=2.0, lease_s=10)  # r2 still holds v1
    assert members.routers_caught_up(v2, now=20.0, lease_s=10)  # r2 silent past its lease
    members.remove(name)
    assert members.membership().members == () and members.retired == [name]
    assert members.new_name()[0] == "app-worker-6"  # never reused
    other = PoolMembers(lambda i: f"w{i}")
    other.ack("r", v2, now=0.0)  # another incarnation's version counts as nothing held
    assert not other.routers_caught_up(other.version, now=0.0, lease_s=10)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_workers": 2, "min_workers": 3}, r"min_workers \(3\) <= num_workers \(2\)"),
        ({"num_workers": 4, "max_workers": 3}, r"num_workers \(4\) <= max_workers \(3\)"),
        ({"num_workers": 1, "min_workers": 0}, "min_workers must be >= 1"),
        ({"scale_down_idle_s": 0}, "scale_down_idle_s must be a finite number > 0"),
        ({"scale_up_kv_usage": 1.5}, r"scale_up_kv_usage must be in \(0, 1\]"),
        ({"scale_interval_s": float("nan")}, "scale_interval_s must be"),
    ],
)
def test_pool_bounds_and_signal_settings_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**fields)


def test_the_pool_is_fixed_unless_its_bounds_say_otherwise():
    assert ScalingConfig(num_workers=3).worker_bounds == (3, 3)
    assert ScalingConfig(num_workers=2, min_workers=1, max_workers=4).worker_bounds == (1, 4)
    config = ClusterConfig.from_dict({"scaling": {"num_workers": 2, "max_workers": 5}})
    assert config.scaling.worker_bounds == (2, 5)


def test_the_spec_fingerprint_follows_what_shapes_a_worker_only():
    base = ClusterConfig(engine=EngineConfig(max_num_seqs=8))
    same = dataclasses.replace(
        base,
        routing=RoutingConfig(routing_policy="round_robin"),
        scaling=ScalingConfig(min_workers=1),
    )
    engine = dataclasses.replace(base, engine=EngineConfig(max_num_seqs=9))
    placed = dataclasses.replace(base, placement=PlacementConfig(worker_num_cpus=2.0))
    fingerprint = WorkerSpec.of(base).fingerprint
    assert WorkerSpec.of(same).fingerprint == fingerprint
    assert WorkerSpec.of(engine).fingerprint != fingerprint
    assert WorkerSpec.of(placed).fingerprint != fingerprint


# ------------------------------------------------------------------ follower
class FakeLiveness:
    def __init__(self) -> None:
        self.revived: list[str] = []
        self.forgotten: list[str] = []

    async def revive(self, worker: WorkerState) -> None:
        self.revived.append(worker.worker_id)
        worker.alive = True

    def forget(self, worker_id: str) -> None:
        self.forgotten.append(worker_id)


def test_the_follower_adds_serving_marks_leaving_and_drops_unlisted_workers():
    members = PoolMembers(lambda i: f"w{i}")
    for i in range(3):
        members.add(members.new_name()[0], handle=f"h{i}")
    members.set_state("w0", SERVING, "fp")
    members.set_state("w1", SERVING, "fp")
    workers = {"w0": WorkerState("w0", "h0", alive=True), "gone": WorkerState("gone", None)}
    view, liveness = PrefixView(), FakeLiveness()
    pool_config = PoolConfig.of(ClusterConfig())
    follower = PoolFollower(None, pool_config, 10.0, 0.0, "r", workers, liveness, view)

    asyncio.run(follower.apply(members.membership()))
    assert sorted(workers) == ["w0", "w1"]  # w2 is starting: not yet routed to
    assert liveness.revived == ["w1"] and liveness.forgotten == ["gone"]
    assert follower.held == members.version
    members.set_state("w1", LEAVING)
    asyncio.run(follower.apply(members.membership()))
    assert workers["w1"].alive and not workers["w1"].routable and workers["w0"].routable
    members.remove("w1")
    asyncio.run(follower.apply(members.membership()))
    assert sorted(workers) == ["w0"] and liveness.forgotten == ["gone", "w1"]


def test_a_router_s_first_workers_are_the_pool_s_answer_to_its_config():
    """A Router replica starts nothing: at its start it hands the pool its config (with its
    revision) and takes the starting and serving members as its workers."""
    members = PoolMembers(lambda i: f"w{i}")
    for i in range(3):
        members.add(members.new_name()[0], handle=f"h{i}")
    members.set_state("w0", SERVING, "fp")
    members.set_state("w2", LEAVING)
    configured = []

    class Pool:
        class configure:  # noqa: N801 (a Ray actor method's shape)
            @staticmethod
            async def remote(config, revision):
                configured.append((config, revision))
                return members.membership()

    workers: dict[str, WorkerState] = {}
    pool_config = PoolConfig.of(ClusterConfig())
    follower = PoolFollower(Pool, pool_config, 10.0, 3.0, "r", workers, FakeLiveness(), None)
    asyncio.run(follower.first(timeout_s=5.0))
    assert configured == [(pool_config, 3.0)]
    assert sorted(workers) == ["w0", "w1"] and workers["w1"].handle == "h1"  # w2 is leaving


def test_the_router_and_the_pool_get_only_their_sections():
    config = ClusterConfig.from_dict(
        {"scaling": {"num_workers": 3, "prefill_workers": 1}, "limits": {"max_inflight": 5}}
    )
    router = RouterConfig.of(config)
    assert (router.limits, router.routing, router.failure) == (
        config.limits,
        config.routing,
        config.failure,
    )
    assert router.disaggregated and not hasattr(router, "scaling")
    pool = PoolConfig.of(config)
    assert (pool.scaling, pool.actors, pool.spec) == (
        config.scaling,
        config.actors,
        WorkerSpec.of(config),
    )
    assert not hasattr(pool, "limits") and pool.spec.engine.max_waiting == 256
