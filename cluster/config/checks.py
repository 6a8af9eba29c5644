"""The field checks every config section shares: each names the field it refuses."""

from __future__ import annotations

import math
from typing import Any


def positive_finite(section: Any, *names: str) -> None:
    """Each of `names` is a finite number > 0 (NaN fails every comparison)."""
    for name in names:
        value = getattr(section, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


def non_negative_finite(section: Any, *names: str) -> None:
    """Each of `names` is a finite number >= 0."""
    for name in names:
        value = getattr(section, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def at_least(section: Any, low: int, *names: str, optional: bool = False) -> None:
    """Each of `names` is >= `low` (or None, where `optional`)."""
    for name in names:
        value = getattr(section, name)
        if optional and value is None:
            continue
        if value < low:
            or_none = " or None" if optional else ""
            raise ValueError(f"{name} must be >= {low}{or_none}, got {value}")
