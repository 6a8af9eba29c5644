"""A clock a test sets by hand: pass it where code takes a `clock` callable, move `now`."""

from __future__ import annotations


class ManualClock:
    """Returns `now`, which only the test changes."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
