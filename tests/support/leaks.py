"""The leak check every test that runs requests ends with, and what makes it automatic.

What "clean" means:

- an engine built in the test process: no request in flight, every block free or cached, the
  pool's invariants hold (`kv.checks.assert_no_leaks`), and so for a speculative draft model's
  own pool;
- a cluster: every router that served it holds nothing open (`RouterCore.inflight`: no request
  id reserved, no request or token counted on any worker); every worker that is still there is
  idle with a clean pool (`Worker.check_pool`, lower tiers included) (the workers:
  `worker_names`, the pool's members and the ones it retired included); the prefix index
  holds, for each such worker, exactly the blocks its pool and tiers have cached (no entry for
  a block that no longer exists, none missing), as many in each tier (device, host, disk) as
  the worker has there, no worker is stale, the index's own invariants hold, and a worker that
  is gone for good has no entry left. Requests being aborted, and KV events on their way to
  the index, may still be in flight when a test ends: the check polls until the cluster is
  clean, under a generous deadline that is a failsafe only (it never measures anything);
- each router built in the test process also has a prefix view (what routing matches
  against) equal to the pools, worker by worker, each block in its tier. When that router's
  event loop is gone (a test drove it from an `asyncio.run` that has returned) nothing follows
  the feed for it, so the check reads the feed from the view's cursor and applies it, as the
  follower would.

How it cannot be forgotten (`LeakWatch`, installed for the whole session by tests/conftest.py):

- every `Engine` and `RouterCore` built in the test process is recorded as it is built;
- `support.api_app.running_app` registers its Serve app's Router;
- every call to `stop_worker_group` (the one way a cluster's actors are stopped: by tests, their
  fixtures, `running_app`, and the bench commands the tests run) first checks that cluster,
  `serve.delete` first checks the app's Router, and `serve.shutdown` every Serve app's Router;
- after each test, every cluster still up (a module's shared cluster or app) is checked, and so
  are the engines the test built; problems found at a stop during the test are reported then.

A failing test is not also charged with the leaks its failure left behind.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.index.view import PrefixView
from pagedserve.cluster.pool import group as worker_group
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.pool import existing_workers
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.types import RouterInflight
from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.kv.checks import KVInvariantError, assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.events import TIER_NAMES
from support.wait import RESTART_DEADLINE_S

# A failsafe: the check returns as soon as everything is clean. A worker a test killed is
# checked once it has restarted, so the failsafe is a restart's (`support.wait`).
DEADLINE_S = RESTART_DEADLINE_S
RPC_S = 10.0
POLL_S = 0.1
# What a cluster check reads (its actors' names, its first workers): the app's config, or the
# pool's part of it that an in-process router carries.
AppConfig = ClusterConfig | PoolConfig


# ------------------------------------------------------------------------ engines
@dataclass(frozen=True)
class EngineView:
    """What the check reads of an engine: its requests and its block manager. Kept instead of
    the engine, so that the engine's KV tensors are freed when the test lets go of it."""

    requests: dict[str, Any]  # the engine's own `_groups`: request id → group
    kv: KVCacheManager
    draft_kv: KVCacheManager | None = None  # the draft model's own pool (speculative `draft`)

    @classmethod
    def of(cls, engine: Engine) -> EngineView:
        proposer = engine.proposer
        return cls(engine._groups, engine.kv, proposer.kv if proposer is not None else None)


def engine_problems(engine: EngineView) -> list[str]:
    """What an engine built in this process still holds; empty when it is clean."""
    if engine.requests:
        return [f"engine still has requests in flight: {sorted(engine.requests)}"]
    pools = [("engine pool", engine.kv), ("draft pool", engine.draft_kv)]
    for name, kv in pools:
        if kv is None:
            continue
        try:
            assert_no_leaks(kv)
        except KVInvariantError as error:
            return [f"{name}: {error}"]
    return []


# ----------------------------------------------------------------------- clusters
@dataclass(frozen=True)
class RouterView:
    """How the check reads one router's in-flight table and, in process, its prefix view."""

    name: str
    read: Callable[[], RouterInflight]
    prefix_view: Callable[[], PrefixView] | None = None


def in_process_router(core: RouterCore) -> RouterView:
    view = functools.partial(_caught_up_view, core)
    return RouterView(f"router {core.router_id[:8]}", core.inflight, view)


def _caught_up_view(core: RouterCore) -> PrefixView:
    """The router's prefix view; brought up to the feed here when no loop follows it for the
    router (its follower's loop is not running)."""
    task = core._following
    if task is None or task.done() or not task.get_loop().is_running():
        batch = ray.get(
            core.index.read_feed.remote(core.view.epoch, core.view.next_offset, 0), timeout=RPC_S
        )
        core.view.apply(batch)
    return core.view


def serve_router(app_name: str) -> RouterView:
    def read() -> RouterInflight:
        handle = serve.get_app_handle(app_name)
        return handle.inflight.remote().result(timeout_s=RPC_S)

    return RouterView(f"Serve app {app_name!r}", read)


def cluster_problems(config: AppConfig, routers: list[RouterView] = ()) -> list[str]:
    """One look at a cluster: what is not clean now (see the module docstring)."""
    problems = []
    views = []
    for router in routers:
        try:
            table = router.read()
            if router.prefix_view is not None:
                views.append((router.name, router.prefix_view()))
        except Exception as error:  # a router replica (or the index) restarting: look again
            problems.append(f"{router.name} did not answer: {error!r}")
            continue
        if not table.idle:
            problems.append(f"{router.name} still holds {table}")
    try:
        index = ray.get_actor(config.actors.index_name, namespace=config.actors.namespace)
    except ValueError:
        return [*problems, f"{config.actors.name}: the prefix index is gone (stopped unchecked?)"]
    try:
        broken = ray.get(index.check_invariants.remote(), timeout=RPC_S)
        stats = ray.get(index.stats.remote(), timeout=RPC_S)
    except Exception as error:  # restarting (a test killed it): look again
        return [*problems, f"{config.actors.name}: the prefix index did not answer: {error!r}"]
    if broken:
        problems.append(f"{config.actors.name}: prefix index invariants: {broken}")
    if stats.stale_workers:
        problems.append(f"{config.actors.name}: prefix index stale for {stats.stale_workers}")
    try:
        names = worker_names(config)
    except Exception as error:  # the pool restarting: look again
        return [*problems, f"{config.actors.name}: the worker pool did not answer: {error!r}"]
    for name in names:
        problems += _worker_problems(name, config.actors.namespace, index, views)
    return problems


def worker_names(config: AppConfig) -> list[str]:
    """Every worker the check looks at: the first `num_workers` names, those alive under the
    app's name pattern, and the pool's members and the workers it retired (each of which
    must be gone from the index and every view)."""
    names = {config.actors.worker_name(i) for i in range(config.scaling.num_workers)}
    names |= set(existing_workers(config.actors))
    try:
        pool = ray.get_actor(config.actors.pool_name, namespace=config.actors.namespace)
    except ValueError:  # no pool (stopped): the names alone
        return sorted(names)
    stats = ray.get(pool.stats.remote(), timeout=RPC_S)
    names |= {m.worker_id for m in stats.membership.members} | set(stats.retired)
    return sorted(names)


def _worker_problems(
    worker_id: str, namespace: str, index: Any, views: list[tuple[str, PrefixView]]
) -> list[str]:
    """The worker's pool against the index and against each router's prefix view."""
    indexed = set(ray.get(index.snapshot_of.remote(worker_id), timeout=RPC_S))
    mirrors = [("index", indexed)] + [
        (f"{name}'s view", v.hashes_of(worker_id)) for name, v in views
    ]
    try:
        handle = ray.get_actor(worker_id, namespace=namespace)
    except ValueError:  # killed for good: the index and every view must have forgotten it
        return [
            f"{worker_id} is gone, yet the {what} lists {len(held)} blocks on it"
            for what, held in mirrors
            if held
        ]
    try:
        pool = ray.get(handle.check_pool.remote(), timeout=RPC_S)
        snapshot = ray.get(handle.kv_snapshot.remote(), timeout=RPC_S)
        indexed_tiers = ray.get(index.tier_counts.remote(worker_id), timeout=RPC_S)
    except Exception as error:  # restarting: look again
        return [f"{worker_id} did not answer: {error!r}"]
    cached = set(snapshot.block_hashes)
    problems = []
    if not pool.clean:
        problems.append(f"{worker_id} pool: {pool.error or 'a request or stream is still open'}")
    for what, held in mirrors:
        if held - cached:
            problems.append(f"{what} lists {len(held - cached)} blocks {worker_id} does not hold")
        if cached - held:
            problems.append(f"{what} misses {len(cached - held)} blocks {worker_id} holds")
    return problems + _tier_problems(worker_id, snapshot, indexed_tiers, views)


def _tier_problems(
    worker_id: str, snapshot: Any, indexed_tiers: dict[str, int], views: list
) -> list[str]:
    """Each block's tier (device, host, disk) as the worker has it, against the index's counts
    per tier and each router view's tier of every block."""
    tiers = dict(zip(snapshot.block_hashes, snapshot.tiers(), strict=True))
    counts = {tier: 0 for tier in TIER_NAMES} | Counter(tiers.values())
    problems = []
    indexed = {tier: indexed_tiers.get(tier, 0) for tier in TIER_NAMES}  # {}: not indexed
    if indexed != counts:
        problems.append(f"the index counts {indexed} blocks per tier, {worker_id} {counts}")
    for name, view in views:
        wrong = sum(view.tier_of(worker_id, h) != tier for h, tier in tiers.items())
        if wrong:
            problems.append(f"{name}'s view has the wrong tier for {wrong} blocks of {worker_id}")
    return problems


def settle(look: Callable[[], list[str]], deadline_s: float = DEADLINE_S) -> list[str]:
    """Look until nothing is wrong; what was still wrong at the deadline (empty: clean)."""
    end = time.monotonic() + deadline_s
    while True:
        problems = look()
        if not problems or time.monotonic() > end:
            return problems
        time.sleep(POLL_S)


def assert_cluster_clean(
    config: AppConfig, routers: list[RouterView] = (), deadline_s: float = DEADLINE_S
) -> None:
    """Wait until the cluster is clean (routers, pools, index); fail with what is not."""
    problems = settle(lambda: cluster_problems(config, routers), deadline_s)
    assert not problems, _report(f"cluster {config.actors.name!r} not clean", problems)


def _report(what: str, problems: list[str]) -> str:
    return f"{what} after {DEADLINE_S:.0f} s:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------- the watch
@dataclass
class _Watched:
    config: AppConfig
    routers: list[RouterView] = field(default_factory=list)


class LeakWatch:
    """Owns what the leak checks look at: the clusters up now with the routers serving them,
    the engines built during the current test, the problems found when a cluster stopped,
    and how many tests each kind of check covered.

    Install it once (`install`); the conftest fixtures call `begin_test` / `end_test`.
    """

    def __init__(self) -> None:
        self.clusters: dict[str, _Watched] = {}
        self.serve_apps: dict[str, RouterView] = {}
        self.engines: list[EngineView] = []
        self.problems: list[str] = []
        self.covered: dict[str, set[str]] = {"engine": set(), "cluster": set()}
        self._test: str | None = None

    # ------------------------------------------------------------------ hooks
    def install(self, monkeypatch: Any) -> None:
        """Record engines and routers as they are built; check clusters before they stop."""
        watch = self
        engine_init, core_init = Engine.__init__, RouterCore.__init__
        stop, shutdown, delete = worker_group.stop_worker_group, serve.shutdown, serve.delete

        def recording_engine(engine, *args, **kwargs):
            engine_init(engine, *args, **kwargs)
            watch.engines.append(EngineView.of(engine))

        def recording_core(core, config, *args, **kwargs):
            core_init(core, config, *args, **kwargs)
            # Over no pool: a unit test's, with no cluster to check, or one whose cluster is
            # checked when it stops (`stop_worker_group`).
            if core.index is not None and core.membership is not None:
                watch.watch(core.membership.config, in_process_router(core))

        def checked_stop(config: AppConfig) -> None:
            watch.stopping(config)
            stop(config)

        def checked_shutdown() -> None:
            watch.serve_stopping()
            shutdown()

        def checked_delete(name: str, *args, **kwargs) -> None:
            watch.serve_stopping(only=name)
            delete(name, *args, **kwargs)

        monkeypatch.setattr(Engine, "__init__", recording_engine)
        monkeypatch.setattr(RouterCore, "__init__", recording_core)
        monkeypatch.setattr(serve, "shutdown", checked_shutdown)
        monkeypatch.setattr(serve, "delete", checked_delete)
        # Every module that imported the function by name gets the checked one too.
        for module in list(sys.modules.values()):
            if getattr(module, "stop_worker_group", None) is stop:
                monkeypatch.setattr(module, "stop_worker_group", checked_stop)

    def watch(self, config: AppConfig, router: RouterView | None = None) -> None:
        watched = self.clusters.setdefault(config.actors.name, _Watched(config))
        if router is not None:
            watched.routers.append(router)

    def watch_serve_app(self, config: AppConfig, app_name: str) -> None:
        self.serve_apps[app_name] = serve_router(app_name)
        self.watch(config, self.serve_apps[app_name])

    # ------------------------------------------------------------------ stops
    def stopping(self, config: AppConfig) -> None:
        """A cluster is about to stop: check it now, report at the end of the test."""
        watched = self.clusters.pop(config.actors.name, _Watched(config))
        if not ray.is_initialized():
            return
        routers = [r for r in watched.routers if r not in self.serve_apps.values()]
        problems = settle(lambda: cluster_problems(config, routers))
        self._covered("cluster")
        if problems:
            self.problems.append(
                _report(f"cluster {config.actors.name!r} stopped unclean", problems)
            )

    def serve_stopping(self, only: str | None = None) -> None:
        """Serve is about to shut down (or delete the app `only`): every app's Router (that
        one's) must hold nothing open."""
        views = {name: view for name, view in self.serve_apps.items() if only in (None, name)}
        for name in views:
            del self.serve_apps[name]
        for watched in self.clusters.values():
            watched.routers = [r for r in watched.routers if r not in views.values()]
        try:
            names = list(serve.status().applications) if ray.is_initialized() else []
        except Exception:  # Serve is not running
            names = []
        names = [name for name in names if only in (None, name)]
        for name in names:
            view = views.get(name, serve_router(name))
            problems = settle(lambda view=view: _router_problems(view))
            if problems:
                self.problems.append(_report(f"{view.name} shut down unclean", problems))

    # ------------------------------------------------------------------ tests
    def begin_test(self, nodeid: str) -> None:
        """(Problems already found, at a stop in a module fixture's setup, are kept: this
        test's end reports them.)"""
        self._test = nodeid
        self.engines = []

    def end_test(self, passed: bool) -> list[str]:
        """Check what the test leaves behind; the problems to report (none if it failed)."""
        problems, self.problems = self.problems, []
        if passed:
            for engine in self.engines:
                self._covered("engine")
                problems += engine_problems(engine)
            for watched in list(self.clusters.values()):
                if ray.is_initialized():
                    self._covered("cluster")
                    found = settle(
                        functools.partial(cluster_problems, watched.config, watched.routers)
                    )
                    if found:
                        problems.append(_report(f"cluster {watched.config.actors.name!r}", found))
        self.engines = []
        self._test = None
        return problems if passed else []

    def end_module(self) -> list[str]:
        """Problems found by stops after the module's last test (its fixtures' teardown).

        What is still registered is forgotten: a module's Ray goes with it, and a router built
        on no Ray at all (a unit test's) has nothing to check."""
        problems, self.problems = self.problems, []
        self.clusters.clear()
        self.serve_apps.clear()
        return problems

    def _covered(self, kind: str) -> None:
        self.covered[kind].add(self._test or "a module fixture")


def _router_problems(view: RouterView) -> list[str]:
    try:
        table = view.read()
    except Exception as error:
        return [f"{view.name} did not answer: {error!r}"]
    return [] if table.idle else [f"{view.name} still holds {table}"]


WATCH = LeakWatch()
