"""The names of an app's named Ray actors, so that every part finds the same ones and two
apps can share a Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActorNames:
    """Where an app's actors live and what they are called.

    Attributes:
        name: prefix of the actors' names.
        namespace: Ray namespace of the named actors (index, pool, workers).
    """

    name: str = "pagedserve"
    namespace: str = "pagedserve"

    def worker_name(self, index: int) -> str:
        return f"{self.name}-worker-{index}"

    @property
    def pool_name(self) -> str:
        return f"{self.name}-worker-pool"

    @property
    def index_name(self) -> str:
        return f"{self.name}-prefix-index"
