"""Who is in the worker pool, at which version, and which routers have seen it (no Ray).

`PoolMembers` is the one owner of membership: the worker pool actor changes it, every change
bumps the epoch, and each router replica reports the version it holds on every poll (`ack`).
`routers_caught_up` is how the pool knows a leaving worker is out of routing everywhere before
it drains it: every router that polled within its lease holds that version or a later one. A
router that stopped polling for longer than its lease counts no more (its requests on the
workers are aborted by then anyway).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace

from pagedserve.cluster.pool.types import Member, Membership, MembershipVersion, MemberState

MAX_RETIRED = 256  # removed names kept for leak checks and tools; older ones are dropped


class PoolMembers:
    """Owns the members (in join order), the epoch, the name counter, the routers' acks and
    the names removed for good.

    Args:
        name_of: worker name of a counter value (`ActorNames.worker_name`).
    """

    def __init__(self, name_of: Callable[[int], str]) -> None:
        self.name_of = name_of
        self.incarnation = uuid.uuid4().hex[:12]
        self.epoch = 0
        self.next_slot = 0
        self.config_revision = 0.0
        self._members: dict[str, Member] = {}
        self._acks: dict[str, tuple[MembershipVersion, float]] = {}  # router → (held, when)
        self.retired: list[str] = []

    # -------------------------------------------------------------- changes
    def new_name(self) -> tuple[str, int]:
        """A fresh worker name and its counter value: names are never reused."""
        slot = self.next_slot
        self.next_slot += 1
        return self.name_of(slot), slot

    def adopt_slot(self, slot: int) -> None:
        """A worker of this counter value exists already (the pool restarted): count past it."""
        self.next_slot = max(self.next_slot, slot + 1)

    def add(self, worker_id: str, handle: object) -> None:
        assert worker_id not in self._members, f"{worker_id} is a member already"
        self._members[worker_id] = Member(worker_id, handle, MemberState.STARTING)
        self._bump()

    def set_state(self, worker_id: str, state: MemberState, fingerprint: str | None = None) -> None:
        member = self._members[worker_id]
        fingerprint = member.fingerprint if fingerprint is None else fingerprint
        self._members[worker_id] = replace(member, state=state, fingerprint=fingerprint)
        self._bump()

    def remove(self, worker_id: str, retired: bool = True) -> None:
        """Drop a member; `retired`: it is gone for good (not a start that failed)."""
        del self._members[worker_id]
        if retired:
            self.retired = [*self.retired, worker_id][-MAX_RETIRED:]
        self._bump()

    def _bump(self) -> None:
        self.epoch += 1

    # -------------------------------------------------------------- reads
    @property
    def version(self) -> MembershipVersion:
        return MembershipVersion(self.incarnation, self.epoch)

    def get(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def members(self) -> list[Member]:
        return list(self._members.values())

    def membership(self) -> Membership:
        return Membership(self.version, tuple(self._members.values()), self.config_revision)

    # -------------------------------------------------------------- routers
    def ack(self, router_id: str, held: MembershipVersion | None, now: float) -> None:
        """`router_id` polled at `now` holding `held` (None: nothing yet)."""
        if held is None or held.incarnation != self.incarnation:
            held = MembershipVersion(self.incarnation, -1)
        self._acks[router_id] = (held, now)

    def routers_caught_up(self, version: MembershipVersion, now: float, lease_s: float) -> bool:
        """Every router that polled within `lease_s` holds `version` or a later one."""
        self._acks = {r: a for r, a in self._acks.items() if now - a[1] <= lease_s}
        return all(held.epoch >= version.epoch for held, _ in self._acks.values())
