"""Hypothesis runs whose cases do not change with the project's unrelated code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def no_local_constants() -> Iterator[None]:
    """Draw without the literals of the project's own modules.

    Hypothesis (6.170, pinned in requirements/) draws a share of its values from the literals
    it finds in every loaded local module, so an unrelated constant anywhere in the project
    changed the cases of the block manager's state machine
    (`tests/unit/workers/kv/test_kv_manager_stateful.py`): adding int8's constants to
    `kv_quant.py` cut the host-tier loads of its derandomised run from 166 to 27, under its
    threshold. Without them its cases depend only on its own file and seed (166 loads, 381
    verify steps with drafts, 487 preempted or aborted drafts). `providers` is Hypothesis'
    internal module: a Hypothesis upgrade must check this still applies.
    """
    from hypothesis.internal.conjecture import providers

    with mock.patch.object(providers, "_get_local_constants", providers.Constants):
        providers.CONSTANTS_CACHE.cache.clear()
        try:
            yield
        finally:
            providers.CONSTANTS_CACHE.cache.clear()
