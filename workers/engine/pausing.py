"""Pausing a request whose reader fell behind, and whether a step has anything to run (a part
of `Engine`, kept apart to keep `workers/engine/engine.py` to admission and the step).

A paused request keeps its blocks and stays preemptible; the scheduler skips it, and its
deadline still applies, so a step is due while a paused request's deadline has passed.
"""

from __future__ import annotations

import time


class EnginePausing:
    """The pause calls of `Engine` (which owns `_groups`, `_paused` and `guided`)."""

    def pause(self, request_id: str) -> bool:
        """Stop scheduling a request (its reader fell behind). It keeps its blocks and stays
        preemptible; deadlines still apply. False when it is unknown or already done."""
        return self._set_paused(request_id, True)

    def resume(self, request_id: str) -> bool:
        """Schedule a paused request again. False when it is unknown or already done."""
        return self._set_paused(request_id, False)

    def _set_paused(self, request_id: str, paused: bool) -> bool:
        group = self._groups.get(request_id)
        if group is None:
            return False
        for branch in group.branches:
            branch.paused = paused
        (self._paused.add if paused else self._paused.discard)(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_runnable_requests(self) -> bool:
        """Whether a step could do anything: a request not paused, or a deadline that passed."""
        if len(self._groups) > len(self._paused) or self.guided.num_parked:
            return True
        now = time.monotonic()
        deadlines = (self._groups[r].deadline for r in self._paused)
        return any(d is not None and now >= d for d in deadlines)
