"""The worker pool: the one owner of which workers an app runs.

`WorkerPoolActor` is a named, detached actor (one per app, `ActorNames.pool_name`). It
creates every worker (names from a monotonic counter: `<name>-worker-<n>`, never reused),
publishes the membership with a version (`cluster/pool/members.py`), and every
`scale_interval_s` lets `PoolPlanner` (`cluster/pool/planner.py`, no Ray) decide on one round
of the workers' stats. Each router replica asks for the membership on its stats poll
(`cluster/pool/follower.py`): nothing on the request path.

    router replicas ──membership(router_id, held)──► WorkerPoolActor ──decide──► PoolPlanner
          ▲  (acks: which version each holds)              │
          └──── joins / leaves, on the next poll ◄─────────┘ add / retire, one at a time

- **add**: create the actor (a new actor is new Ray resource demand: on KubeRay the in-tree
  autoscaler adds a pod when no node has room), wait for its `ready()` (up to
  `startup_timeout_s`), then publish it serving. One that never becomes ready is killed; two
  in a row whose constructor raised the same error (`StartFailures`: a model that does not
  load fails on every worker) stop the pool from starting any more (`PoolStats.failed`,
  which `pagedserve serve` prints as its last line) until a new worker spec is configured. A
  start that timed out or whose process died is retried as before (a pod on its way, a
  node lost).
- **retire** (scale-down, or a worker replaced) and **lost** (gone for good):
  `cluster/pool/leaving.py`. A retired worker leaves routing on every router first, hands its
  hot cached prefixes to peers, drains, and only then is killed; none of its requests is lost.
- **lost**: a serving worker whose stats call fails with a lost-worker error while its name
  is no longer registered with Ray (dead, not restarting: killed with no restart; a worker
  whose node is lost is restarting, `max_restarts=-1`, so it is not lost) is removed at
  once: dropped from the membership (each router drops it and its prefix-view entries on its
  next poll; their liveness had already taken it out of routing and replayed its requests on
  peers) and from the index. The target is unchanged, so the next round adds its
  replacement. A worker Ray is restarting keeps its name and stays a member: the routers
  revive it when it answers again.
- **reconcile**: each worker reports the fingerprint of the spec it was built from
  (`cluster/pool/spec.py`). A Router replica built from a newer app config sends it
  (`configure`); workers of another fingerprint are replaced one at a time, new one up and
  serving before the old one leaves, never silently kept.

Restart: Ray restarts the actor with its first arguments. It then adopts the workers that
exist under the app's name pattern (counting past their numbers) and decides nothing until a
router configures it again (routers do on their next poll when the pool says it is not
configured, or follows an older revision than theirs) and two stats intervals and a control
call's deadline have passed (every live router has polled by then, even one whose poll timed out
on the restarting pool and waits for its next round). A router's poll can be later than that
on a loaded machine, so the newest revision the pool followed is also kept in the GCS
(`cluster/pool/followed.py`) and a restarted pool decides nothing until it is configured with
that revision or a newer one: it follows the newest config and never rolls the workers back to
its creation config, or to an older router's.

Stop: `freeze` (the app is stopping) ends every decision; the pool goes on answering the
routers' membership polls until the app's stop kills it after them (`pool.group`), so that
no router sees its pool vanish while it still serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time

import ray
from ray.actor import ActorHandle

from pagedserve.cluster.config import ActorNames
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.followed import FollowedRevision
from pagedserve.cluster.pool.leaving import CALL_ERRORS, PoolLeaving
from pagedserve.cluster.pool.members import PoolMembers
from pagedserve.cluster.pool.planner import (
    ActionKind,
    Observation,
    PoolAction,
    PoolPlanner,
    ScalingSettings,
)
from pagedserve.cluster.pool.spec import create_worker
from pagedserve.cluster.pool.types import (
    Membership,
    MembershipVersion,
    MemberState,
    PoolCounters,
    PoolStats,
    StartFailures,
)
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.role import WorkerRole
from pagedserve.workers.telemetry.telemetry import TelemetryConfig, otel_env

logger = logging.getLogger(__name__)


@ray.remote
class WorkerPoolActor(PoolLeaving):
    """Owns the app's workers: their creation, membership, scaling and removal.

    Args:
        config: the pool's part of the app config it starts with (a later one comes
            through `configure`).
        telemetry: the settings every worker it creates gets.
    """

    def __init__(self, config: PoolConfig, telemetry: TelemetryConfig) -> None:
        self._config = config
        self._spec = config.spec
        self._telemetry = telemetry
        self.members = PoolMembers(config.actors.worker_name)
        self.planner = PoolPlanner(
            ScalingSettings.of(config.scaling), config.scaling.num_workers, self._spec.fingerprint
        )
        self.counters = PoolCounters()
        self._configured = False  # decides nothing until a router (re)configures it
        self._configured_at = 0.0
        self._adopted = False  # it found workers at its start: a restart
        self._followed = FollowedRevision(config.actors.pool_name, config.actors.namespace)
        self._slots: dict[str, int] = {}
        self._roles: dict[str, WorkerRole] = {}  # each member's P/D role
        self._ready: dict[str, asyncio.Task] = {}
        self._action: asyncio.Task | None = None
        self._last_action = ""
        self._start_failures = StartFailures()
        self._failed = ""  # why workers cannot start (the same error twice); "" while they can
        self._frozen = False
        self._index: ActorHandle | None = None
        loop = asyncio.get_running_loop()
        self._started = loop.create_task(self._start())
        self._loop = loop.create_task(self._control_loop())

    # ------------------------------------------------------------------ start
    async def _start(self) -> None:
        """Find the index; adopt the workers that exist, or create the first ones."""
        actors = self._config.actors
        self._index = await asyncio.to_thread(
            ray.get_actor, actors.index_name, namespace=actors.namespace
        )
        existing = await asyncio.to_thread(existing_workers, actors)
        self._adopted = bool(existing)
        if self._adopted:
            await self._followed.load()  # the newest revision it had followed: `followed.py`
        for worker_id, slot in sorted(existing.items(), key=lambda item: item[1]):
            handle = await asyncio.to_thread(ray.get_actor, worker_id, actors.namespace)
            self.members.adopt_slot(slot)
            self._join(worker_id, slot, handle)
        if not existing:
            for _ in range(self._config.scaling.num_workers):
                await self._create()

    async def _create(self) -> asyncio.Task:
        """A new worker, starting; returns the task that makes it serving."""
        worker_id, slot = self.members.new_name()
        role = self._spec.role_for_new(self._roles[m.worker_id] for m in self._role_holders())
        handle = await asyncio.to_thread(
            create_worker, self._spec, worker_id, slot, self._telemetry, role
        )
        self._roles[worker_id] = role
        return self._join(worker_id, slot, handle)

    def _role_holders(self) -> list:
        """The members whose role counts toward the P/D layout: serving or starting, of the
        current spec (a worker a reconcile replaces, or one leaving, is not counted)."""
        current = self._spec.fingerprint
        return [
            m
            for m in self._in_state(MemberState.STARTING, MemberState.SERVING)
            if m.worker_id in self._roles
            and (m.state == MemberState.STARTING or m.fingerprint == current)
        ]

    def _join(self, worker_id: str, slot: int, handle: ActorHandle) -> asyncio.Task:
        """A member from now on, starting; serving once its `ready()` answers."""
        self._slots[worker_id] = slot
        self.members.add(worker_id, handle)
        task = asyncio.ensure_future(self._await_ready(worker_id, handle))
        self._ready[worker_id] = task  # kept referenced while it runs
        return task

    async def _await_ready(self, worker_id: str, handle: ActorHandle) -> bool:
        timeout = self._config.failure.startup_timeout_s
        try:
            info = await within(handle.ready.remote(), timeout)
        except CALL_ERRORS as error:
            cause = start_failure_cause(error, timeout)
            logger.warning("worker %s did not start (%s); stopping it", worker_id, cause)
            self.counters.start_failures += 1
            self.members.remove(worker_id, retired=True)
            self._kill(handle)
            await self._forget_in_index(worker_id)
            self.planner.start_failed(len(self._in_state(MemberState.SERVING)))
            deterministic = isinstance(error, ray.exceptions.RayActorError) and bool(
                error.actor_init_failed  # its constructor raised; a timeout or crash may pass
            )
            if deterministic and self._start_failures.failed(cause) and not self._failed:
                self._failed = cause
                logger.error("pool: workers cannot start, the same error twice: %s", cause)
            return False
        finally:
            self._ready.pop(worker_id, None)
        self._start_failures.succeeded()
        self._failed = ""
        self._roles[worker_id] = info.role  # an adopted worker's, known from here on
        self.members.set_state(worker_id, MemberState.SERVING, info.config_fingerprint)
        self.counters.workers_added += 1
        return True

    # ------------------------------------------------------------------ API
    async def membership(
        self, router_id: str | None = None, held: MembershipVersion | None = None
    ) -> Membership | None:
        """The membership; None when `held` is the current version. A router passes its id
        and the version it holds on every poll: that is how the pool knows what each sees."""
        await self._started
        if router_id is not None:
            self.members.ack(router_id, held, time.monotonic())
        if held == self.members.version and self._configured:
            return None
        return self._published()

    async def configure(self, config: PoolConfig, revision: float = 0.0) -> Membership:
        """Follow the app config of `revision` (ignored when older than the one followed):
        its bounds and signal settings at once; a changed worker spec by rolling replacement."""
        await self._started
        if self._configured and revision < self.members.config_revision:
            logger.info(
                "pool: ignoring config revision %s (it follows %s)",
                revision,
                self.members.config_revision,
            )
            return self._published()
        old, self._config = self._config, config
        self._spec = config.spec
        if self._spec.fingerprint != old.spec.fingerprint:  # may start where it failed
            self._start_failures, self._failed = StartFailures(), ""
        num_workers = config.scaling.num_workers
        same_size = num_workers == old.scaling.num_workers and self._configured
        target = self.planner.target if same_size else num_workers
        self.planner.configure(ScalingSettings.of(config.scaling), self._spec.fingerprint, target)
        self.members.config_revision = revision
        await self._followed.record(revision)
        if revision < self._followed.newest:
            logger.warning(
                "pool: configured with revision %s after its restart; it followed %s before, "
                "so it decides nothing until a router of that revision configures it",
                revision,
                self._followed.newest,
            )
        if not self._configured:
            self._configured, self._configured_at = True, time.monotonic()
        return self._published()

    def _published(self) -> Membership:
        return dataclasses.replace(self.members.membership(), configured=self._configured)

    async def stats(self) -> PoolStats:
        await self._started
        return PoolStats(
            membership=self._published(),
            target=self.planner.target,
            fingerprint=self._spec.fingerprint,
            retired=tuple(self.members.retired),
            counters=dataclasses.replace(self.counters),
            last_action=self._last_action,
            failed=self._failed,
            frozen=self._frozen,
        )

    async def freeze(self) -> None:
        """Decide nothing more, and stop what is under way (the app is stopping): no worker
        is added, replaced or retired from now on. Membership polls are still answered."""
        self._frozen = True
        for task in (self._loop, self._action):
            if task is not None:
                task.cancel()

    # ------------------------------------------------------------------ decide
    async def _control_loop(self) -> None:
        await self._started
        while True:
            await asyncio.sleep(self._config.scaling.scale_interval_s)
            if not self._settled() or (self._action is not None and not self._action.done()):
                continue
            if self.members.config_revision < self._followed.newest:  # `followed.py`
                self.counters.rounds_held += 1  # restarted, and a newer config is due
                continue
            if self._failed:  # starting more would fail the same way: wait for a new spec
                continue
            try:
                action = self.planner.decide(time.monotonic(), await self._observe())
            except Exception:  # the next round tries again; the loop must live on
                logger.exception("pool: a decision round failed")
                continue
            if action is not None:
                self._last_action = action.describe()
                logger.info("pool: %s", self._last_action)
                self._action = asyncio.ensure_future(self._run(action))

    def _settled(self) -> bool:
        """Configured, two stats intervals ago at least: by then every live router has polled
        and sent its config if it was newer, so a restarted pool acts on the newest config
        and not on whichever router (of an older deployment, maybe) reached it first."""
        failure = self._config.failure
        wait_s = 2 * failure.stats_interval_s
        if self._adopted:  # a router whose poll timed out on the restart polls again by then
            wait_s += failure.rpc_timeout_s
        return self._configured and time.monotonic() - self._configured_at >= wait_s

    async def _observe(self) -> list[Observation]:
        async def observe(member) -> Observation:
            seen = Observation(
                member.worker_id, member.state, member.fingerprint, self._slots[member.worker_id]
            )
            if member.state != MemberState.SERVING:
                return seen
            try:
                stats = await within(
                    member.handle.stats.remote(), self._config.failure.rpc_timeout_s
                )
            except WORKER_LOST_ERRORS:
                gone = await asyncio.to_thread(gone_for_good, member.worker_id, self._config.actors)
                return dataclasses.replace(seen, gone=gone)
            except CALL_ERRORS:
                return seen
            kv = stats.kv
            return dataclasses.replace(
                seen,
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                num_streams=stats.num_streams,
                kv_usage=kv.used_blocks / kv.total_blocks if kv.total_blocks else 0.0,
            )

        return list(await asyncio.gather(*(observe(m) for m in self.members.members())))

    async def _run(self, action: PoolAction) -> None:
        try:
            if action.kind == ActionKind.ADD:
                await (await self._create())
            elif action.kind == ActionKind.REMOVE:
                assert action.worker_id is not None
                await self._remove_lost(action.worker_id)
            else:
                assert action.worker_id is not None
                await self._retire(action.worker_id, action.reason)
        except Exception:
            logger.exception("pool: %s failed", action.describe())


def start_failure_cause(error: BaseException, timeout_s: float) -> str:
    """Why a worker did not start, in one line: the exception its constructor raised (the last
    line of the creation task's traceback, which Ray's error carries), Ray's words for a
    process that died, or the deadline it missed."""
    if isinstance(error, TimeoutError):
        return f"not ready within startup_timeout_s ({timeout_s:g} s)"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def existing_workers(actors: ActorNames) -> dict[str, int]:
    """The app's worker actors alive now, by name: name → its counter value."""
    pattern = re.compile(re.escape(actors.worker_name(0))[: -len("0")] + r"(\d+)")
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = pattern.fullmatch(actor["name"])
        if match and actor["namespace"] == actors.namespace:
            found[actor["name"]] = int(match.group(1))
    return found


def gone_for_good(worker_id: str, actors: ActorNames) -> bool:
    """Whether the worker's actor is dead and will not come back: Ray releases an actor's name
    only then (one restarting keeps it)."""
    try:
        ray.get_actor(worker_id, namespace=actors.namespace)
    except ValueError:
        return True
    return False


def get_or_create_worker_pool(config: PoolConfig, telemetry: TelemetryConfig) -> ActorHandle:
    """The app's pool actor, created (with `config`) when it does not exist yet.

    Detached, like the workers and the index: it outlives the router replica that created it.
    Its runtime env carries this process's OTEL_* variables, which it hands to each worker.
    """
    env = otel_env()
    return WorkerPoolActor.options(
        name=config.actors.pool_name,
        namespace=config.actors.namespace,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,
        num_cpus=0,
        runtime_env={"env_vars": env} if env else None,
    ).remote(config, telemetry)
