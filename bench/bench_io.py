"""Small pieces every benchmark command shares: argument types, Ray start-up, output files.

Light on purpose (no torch, no ray at import) so that `pagedserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any


def positive_int(text: str) -> int:
    """argparse type: one integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: one finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join `address`, or start a fresh local Ray, unless Ray is already initialised.

    "local" starts a new cluster even when another one runs on this machine, so a benchmark
    never lands on someone else's cluster by accident.

    Returns:
        Whether this call started (or joined) Ray, so the caller knows to shut it down.
    """
    import ray

    from pagedserve.cluster.serve.ray_startup import allow_slow_startup

    if ray.is_initialized():
        return False
    allow_slow_startup()
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def report(data: dict[str, Any], markdown: str, json_path: str | None, md_path: str | None) -> None:
    """Print a bench's Markdown report; write its data as JSON and the report, when asked."""
    print(markdown)
    if json_path:
        write_json(json_path, data)
    if md_path:
        write_text(md_path, markdown + "\n")


def exit_on_sigterm() -> None:
    """Make SIGTERM end this bench as an exception would (`SystemExit`), so that its
    `finally` blocks stop the servers it started; by default SIGTERM ends the process at
    once and leaves them running."""

    def stop(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
