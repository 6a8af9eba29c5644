"""Owner leases: a request whose owner (a router replica) stops renewing is ended by the worker.

A router that dies mid-stream cannot abort what it sent, and Ray does not cancel a streaming
call whose caller is gone, so without leases a worker decodes every orphan to `max_tokens`.
Each request sent with an `owner_id` is tied to that owner's lease; the owner renews it with
every call it makes (the router's stats poll, every `stats_interval_s`). A lease not renewed
within `timeout_s` has expired and the worker aborts its requests.

Requests without an owner (offline use, tests) have no lease and never expire.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

DEFAULT_LEASE_TIMEOUT_S = 10.0


class LeaseTable:
    """Owns each owner's last renewal time and which requests each owner holds.

    Args:
        timeout_s: how long an owner's lease lasts without a renewal.
        clock: monotonic seconds (injectable so tests drive expiry without sleeping).
    """

    def __init__(
        self,
        timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"lease timeout_s must be > 0 and finite, got {timeout_s}")
        self.timeout_s = timeout_s
        self.clock = clock
        self._renewed: dict[str, float] = {}  # owner → when it last renewed
        self._owner_of: dict[str, str] = {}  # request id → owner
        self._held: dict[str, set[str]] = {}  # owner → its request ids
        self.num_expired = 0  # requests ended because their owner's lease ran out

    def renew(self, owner_id: str) -> None:
        self._renewed[owner_id] = self.clock()

    def attach(self, request_id: str, owner_id: str | None) -> None:
        """Tie an admitted request to its owner. Admission renews the lease: the owner has just
        called, and a request must not expire before its owner had a chance to renew."""
        if owner_id is None:
            return
        self._owner_of[request_id] = owner_id
        self._held.setdefault(owner_id, set()).add(request_id)
        self.renew(owner_id)

    def detach(self, request_id: str) -> None:
        """The request ended: forget it, and its owner once the owner holds nothing."""
        owner_id = self._owner_of.pop(request_id, None)
        if owner_id is None:
            return
        held = self._held[owner_id]
        held.discard(request_id)
        if not held:
            del self._held[owner_id]

    def expired(self) -> list[str]:
        """Requests whose owner has not renewed within `timeout_s`; each is reported once.

        An expired owner is forgotten, so a request whose abort is still under way is not
        reported again, and owners that only ever polled do not pile up.
        """
        now = self.clock()
        dead = [o for o, at in self._renewed.items() if now - at > self.timeout_s]
        requests = []
        for owner_id in dead:
            del self._renewed[owner_id]
            requests.extend(sorted(self._held.get(owner_id, ())))
        self.num_expired += len(requests)
        return requests

    def held_by(self, owner_id: str) -> tuple[str, ...]:
        """The requests `owner_id` has open here, sorted."""
        return tuple(sorted(self._held.get(owner_id, ())))

    @property
    def num_owners(self) -> int:
        """Owners holding at least one request here."""
        return len(self._held)
