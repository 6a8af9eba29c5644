"""The newest config revision the worker pool has followed, kept outside the pool actor.

Ray restarts a dead pool with its first arguments, which hold the config the app was created
with. A restarted pool must not act on that config, or on one an older router sends it
first, once it has followed a newer one: it would roll the workers back to a spec the app no
longer runs, and roll them forward again when the newest router polls. Waiting a few poll
intervals for the newest router is not enough on a loaded machine (a router whose poll timed
out on the dying pool polls again only after its deadline). So the pool records each newer
revision it follows in the GCS's key-value store, which outlives the actor, and after a
restart decides nothing until a router has configured it with that revision or a newer one.

The record is trusted only when the pool adopts workers at its start (a restart); a pool
that creates the app's first workers overwrites it. The app's stop deletes it
(`pool.group.stop_worker_group`).
"""

from __future__ import annotations

import asyncio

from pagedserve.workers.ray_internals import kv_del, kv_get, kv_put


class FollowedRevision:
    """The newest config revision a pool of `pool_name` followed, in the GCS."""

    def __init__(self, pool_name: str, namespace: str) -> None:
        self._key = f"{pool_name}/followed_config_revision"
        self._namespace = namespace
        self.newest = 0.0  # the newest revision recorded (0: none)

    def stored(self) -> float:
        """The newest revision recorded in the GCS (0: none)."""
        value = kv_get(self._key, self._namespace)
        return float(value.decode()) if value else 0.0

    async def load(self) -> None:
        """Start from the newest revision a previous incarnation of this pool recorded."""
        self.newest = await asyncio.to_thread(self.stored)

    async def record(self, revision: float) -> None:
        """Remember `revision` if it is newer than the newest recorded."""
        if revision > self.newest:
            await asyncio.to_thread(kv_put, self._key, repr(revision).encode(), self._namespace)
            self.newest = revision

    def forget(self) -> None:
        """Delete the record (the app is stopping)."""
        kv_del(self._key, self._namespace)
