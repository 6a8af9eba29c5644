"""A worker's role in prefill/decode disaggregation (P/D): what it does with a request.

    fresh request ──route (prefix hits + load, among roles that prefill)──► prefill | mixed
    prefill worker: prompt computed, first token sampled and streamed, then the request is
        handed off (`Engine._hand_off_prefilled`, the `move` path of `cluster/pool/migration.py`)
    handed-off request ──move target (load, free blocks, among roles that decode)──► decode | mixed

`mixed` (the default) does both and never hands a request off after its prefill: a cluster of
mixed workers is a cluster without P/D. A request adopted from a peer is never handed off
again after its prefill, whatever the role, so a fallback onto a prefill worker (no decode
worker alive) cannot bounce between workers.
"""

from __future__ import annotations

import enum


class WorkerRole(enum.StrEnum):
    """What a worker is for (its value is what configs, stats and metrics show)."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def prefills(self) -> bool:
        """It takes fresh requests (their prompts are computed here)."""
        return self in _PREFILLS

    @property
    def decodes(self) -> bool:
        """It takes requests handed off after their prefill (and moved ones)."""
        return self in _DECODES

    @property
    def hands_off_after_prefill(self) -> bool:
        """A fresh request leaves it once its first token went out."""
        return self is WorkerRole.PREFILL


_PREFILLS = frozenset({WorkerRole.MIXED, WorkerRole.PREFILL})
_DECODES = frozenset({WorkerRole.MIXED, WorkerRole.DECODE})
