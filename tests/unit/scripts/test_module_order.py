"""The order scripts/test.sh's processes take the modules in (tests/support/module_order.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from support.module_order import LONGEST_FIRST, OWN_RAY, TESTS, order_modules


@dataclass(frozen=True)
class Item:
    """What `order_modules` reads of a pytest item."""

    path: Path
    name: str


def test_every_listed_module_exists():
    """A renamed module would silently lose its place: the lists name files that are there."""
    missing = [name for name in (*OWN_RAY, *LONGEST_FIRST) if not (TESTS / name).is_file()]
    assert missing == []


def test_integration_first_own_ray_leading_then_the_longest_keeping_each_module_together():
    paths = [
        "integration/test_api_grpc.py",
        "unit/bench/test_ports.py",
        LONGEST_FIRST[1],
        "integration/test_cluster.py",
        OWN_RAY[1],
        LONGEST_FIRST[0],
        OWN_RAY[0],
    ]
    items = [Item(TESTS / path, f"t{i}{j}") for i, path in enumerate(paths) for j in range(2)]
    ordered = [
        (item.path.relative_to(TESTS).as_posix(), item.name) for item in order_modules(items)
    ]
    expected_modules = [
        OWN_RAY[0],
        OWN_RAY[1],
        "integration/test_api_grpc.py",
        "integration/test_cluster.py",
        LONGEST_FIRST[0],
        LONGEST_FIRST[1],
        "unit/bench/test_ports.py",
    ]
    assert [path for path, _ in ordered[::2]] == expected_modules
    # Each module's tests stay together and in their own order.
    assert all(
        a[0] == b[0] and a[1] < b[1] for a, b in zip(ordered[::2], ordered[1::2], strict=True)
    )
