"""A moved request's KV goes worker to worker through Ray's object store, never via the router.

    source Worker ──RequestMoved(handoff: KV as an ObjectRef)──► router ──WorkerRequest.moved──►
    target Worker ── resolves the ref: the KV comes from the source's object store ──► adopt

- `by_reference` (the source, as its stream yields `RequestMoved`): the packed KV is put in
  the object store (`ray.put`, owned by the source worker) and the handoff keeps only its
  `ObjectRef`. What the router receives, holds and forwards is that ref plus the small rest
  (token ids, params, sampler state); it never resolves the ref, so the KV bytes never pass
  through it.
- `resolved` (the target, before `WorkerCore.adopt`): fetches the KV by the ref. When it
  cannot (the source died and its objects with it, or the fetch missed its deadline) the
  handoff loses its KV and the target recomputes it from the tokens: the same output, as for
  a handoff that arrives without room for its KV.
- `HeldKV` (the source): Ray frees a `ray.put` object once its owner holds no reference, and
  a ref that travels inside a streamed value is not reliably counted as borrowed by whoever
  receives it (seen: `ReferenceCountingAssertionError` on fetches a few seconds after the
  handoff, for the later branches of an n > 1 request handed off together, which the router
  continues one after another). So the source keeps its own reference until the target
  fetched the KV and said so (`Worker.release_kv`, called with `kv_owner` of the handoff),
  or `KV_HOLD_S` passed (a handoff no target ever took: its router died, every peer refused).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import ray

from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.handoff import RequestHandoff

logger = logging.getLogger(__name__)

KV_FETCH_TIMEOUT_S = 30.0  # a fetch from a peer that stopped answering must not hang adoption
KV_HOLD_S = 300.0  # the longest a source keeps handed-off KV that no target fetched


class HeldKV:
    """Owns a source worker's references to the KV it handed off, until each is fetched.

    Args:
        hold_s: how long an unfetched one is kept at most.
        clock: a monotonic clock (tests inject one).
    """

    def __init__(self, hold_s: float = KV_HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self._held: dict[str, tuple[float, ray.ObjectRef]] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._held)

    def hold(self, handoff: RequestHandoff) -> None:
        """Keep the handoff's KV object alive (a handoff without a ref: nothing to keep)."""
        self._expire()
        ref = handoff.packed_kv
        if isinstance(ref, ray.ObjectRef):
            self._held[ref.hex()] = (self.clock() + self.hold_s, ref)

    def release(self, key: str) -> None:
        """The target fetched it (or gave up): the store may free it now."""
        self._held.pop(key, None)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (deadline, _) in self._held.items() if deadline <= now]:
            del self._held[key]


def by_reference(handoff: RequestHandoff) -> RequestHandoff:
    """The handoff with its packed KV in the object store (a copy; no KV: unchanged)."""
    if handoff.packed_kv is None or isinstance(handoff.packed_kv, ray.ObjectRef):
        return handoff
    return dataclasses.replace(handoff, packed_kv=ray.put(handoff.packed_kv))


async def resolved(
    handoff: RequestHandoff, timeout_s: float = KV_FETCH_TIMEOUT_S
) -> RequestHandoff:
    """The handoff with its KV fetched by reference; without KV (recompute) when the fetch
    fails. A handoff that carries its KV inline, or none, is returned as it is. Either way
    the source's hold on the KV is released once the fetch is over (`HeldKV`)."""
    ref = handoff.packed_kv
    if not isinstance(ref, ray.ObjectRef):
        return handoff
    try:
        packed = await within(ref, timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as error:
        release_source(handoff)
        logger.warning(
            "KV of moved request %s unreachable at %s (%s): recomputing it from its tokens",
            handoff.request_id,
            handoff.source_worker,
            type(error).__name__,
        )
        return without_kv(handoff)
    release_source(handoff)
    return dataclasses.replace(handoff, packed_kv=packed)


def release_source(handoff: RequestHandoff) -> None:
    """Tell the source its hold on this handoff's KV may go (no answer awaited)."""
    ref, owner = handoff.packed_kv, handoff.kv_owner
    if isinstance(ref, ray.ObjectRef) and owner is not None:
        owner.release_kv.remote(ref.hex())


def without_kv(handoff: RequestHandoff) -> RequestHandoff:
    """The handoff as a failed fetch leaves it: no KV, so the adopter recomputes it."""
    return dataclasses.replace(handoff, packed_kv=None, num_computed_tokens=0, kv_owner=None)
