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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import ray

from pagedserve.workers.handoff import RequestHandoff

logger = logging.getLogger(__name__)

KV_FETCH_TIMEOUT_S = 30.0  # a fetch from a peer that stopped answering must not hang adoption


def by_reference(handoff: RequestHandoff) -> RequestHandoff:
    """The handoff with its packed KV in the object store (a copy; no KV: unchanged)."""
    if handoff.packed_kv is None or isinstance(handoff.packed_kv, ray.ObjectRef):
        return handoff
    return dataclasses.replace(handoff, packed_kv=ray.put(handoff.packed_kv))


async def resolved(
    handoff: RequestHandoff, timeout_s: float = KV_FETCH_TIMEOUT_S
) -> RequestHandoff:
    """The handoff with its KV fetched by reference; without KV (recompute) when the fetch
    fails. A handoff that carries its KV inline, or none, is returned as it is."""
    ref = handoff.packed_kv
    if not isinstance(ref, ray.ObjectRef):
        return handoff
    try:
        packed = await asyncio.wait_for(ref, timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as error:
        logger.warning(
            "KV of moved request %s unreachable at %s (%s): recomputing it from its tokens",
            handoff.request_id,
            handoff.source_worker,
            type(error).__name__,
        )
        return without_kv(handoff)
    return dataclasses.replace(handoff, packed_kv=packed)


def without_kv(handoff: RequestHandoff) -> RequestHandoff:
    """The handoff as a failed fetch leaves it: no KV, so the adopter recomputes it."""
    return dataclasses.replace(handoff, packed_kv=None, num_computed_tokens=0)
