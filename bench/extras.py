"""The optional `bench` extra: matplotlib (plots) and tqdm (progress bars).

A server install leaves them out (`pip install pagedserve`); the bench commands that need one
say what to install instead of failing with a traceback. `require_bench_extra` checks before a
long run starts, and `pagedserve`'s `main` turns any later import failure of these modules into
the same message and exit status 2.
"""

from __future__ import annotations

import importlib

BENCH_EXTRA_MODULES = ("matplotlib", "tqdm")
INSTALL_HINT = "install pagedserve[bench] (pip install -e '.[bench]')"


def is_missing_bench_extra(error: ModuleNotFoundError) -> bool:
    """Whether `error` is the import of a `bench` extra module that is not installed."""
    return (error.name or "").partition(".")[0] in BENCH_EXTRA_MODULES


def missing_extra_message(error: ModuleNotFoundError) -> str:
    return f"{error.name} is not installed: {INSTALL_HINT}"


def require_bench_extra(*modules: str) -> None:
    """Import `modules` now, so a missing one fails before the run, not after it.

    Raises:
        ModuleNotFoundError: naming the module and what to install.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not is_missing_bench_extra(error):
                raise
            raise ModuleNotFoundError(missing_extra_message(error), name=error.name) from None
