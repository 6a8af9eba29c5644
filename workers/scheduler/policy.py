"""Scheduling policies (which sequence runs first and is preempted last) and preemption modes.

Apart from `scheduler.py` so that configs and command lines can name the choices without
importing the scheduler (and torch with it).
"""

from __future__ import annotations

import abc
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request


class PreemptionMode(StrEnum):
    """How a sequence yields its blocks when the pool runs short. `MOVE` hands the victim to a
    peer worker with its KV (see workers/transfer/handoff.py); only a worker in a cluster can use
    it, and a victim that cannot move (n > 1) is recomputed instead."""

    RECOMPUTE = "recompute"
    SWAP = "swap"
    MOVE = "move"

    @classmethod
    def of(cls, value: str) -> PreemptionMode:
        """`value` as a mode; a `ValueError` naming the field and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {value!r}"
            ) from None


PREEMPTION_MODES = tuple(mode.value for mode in PreemptionMode)


class SchedulingPolicy(abc.ABC):
    """Orders sequences: lower keys run first and are preempted last."""

    registry: ClassVar[dict[str, type[SchedulingPolicy]]] = {}
    name: ClassVar[str]

    def __init_subclass__(cls) -> None:
        SchedulingPolicy.registry[cls.name] = cls

    @abc.abstractmethod
    def key(self, request: Request) -> tuple[int, ...]:
        """The sort key of `request` under this policy."""


class FCFSPolicy(SchedulingPolicy):
    """Arrival order: no request is ever admitted before one that arrived earlier, so a
    request's wait is bounded by the work that arrived before it."""

    name = "fcfs"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_order,)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` values first (as in vLLM); arrival order breaks ties.

    No aging (nor in vLLM): a request waits as long as better-priority ones keep arriving.
    """

    name = "priority"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.priority, request.arrival_order)
