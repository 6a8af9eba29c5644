"""`pagedserve drain-node`: drain every worker process on this machine, and wait for them to exit.

Run it where the workers run, before the machine goes away: on KubeRay it is the Ray pods'
preStop hook, so a pod being removed (a RayService upgrade deleting the old cluster, a
scale-down) drains its workers before Kubernetes stops Ray. It sends SIGTERM to each worker
process that `workers/process/pid_files.py` lists, which drains that worker
(`workers/process/drain_signal.py`: new requests refused as `Draining`, open streams given the
worker's `drain_grace_s`, the rest handed back to the router, which replays them on a peer),
and waits until every one has exited or `timeout_s` has passed. It needs no connection to Ray:
a pod's preStop runs beside Ray's own processes and may find the head already gone.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.workers.process.pid_files import DEFAULT_PID_DIR, WorkerProcess, live_workers

DEFAULT_TIMEOUT_S = 75.0
POLL_S = 0.2


@dataclass(frozen=True)
class NodeDrain:
    """What `drain_node` did: the workers it signalled, and those still running at its end."""

    signalled: tuple[str, ...]
    still_running: tuple[str, ...]


def drain_node(
    pid_dir: str = DEFAULT_PID_DIR,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    send: Callable[[int, int], None] = os.kill,
) -> NodeDrain:
    """SIGTERM every live worker process in `pid_dir`, then wait (up to `timeout_s`) for all
    of them to exit.

    Args:
        pid_dir: where the workers of this machine write their pid files.
        timeout_s: how long to wait for them; keep it above the workers' `drain_grace_s`.
        send: how to signal a pid (`os.kill`).
    """
    workers = live_workers(pid_dir)
    signalled: list[WorkerProcess] = []
    for worker in workers:
        try:
            send(worker.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue  # exited meanwhile
        signalled.append(worker)
    end = time.monotonic() + timeout_s
    running = [w for w in signalled if w.alive()]
    while running and time.monotonic() < end:
        time.sleep(POLL_S)
        running = [w for w in running if w.alive()]
    return NodeDrain(
        signalled=tuple(w.worker_id for w in signalled),
        still_running=tuple(w.worker_id for w in running),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "drain-node",
        help="drain the worker processes on this machine and wait for them to exit",
        description="Send SIGTERM to every pagedserve worker process on this machine (each "
        "drains: refuses new requests, finishes what fits in its drain_grace_s, hands the rest "
        "back for the router to replay on a peer) and wait until they have exited. Meant for "
        "a Kubernetes preStop hook. Exits 1 if some worker was still running at --timeout-s.",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"how long to wait for the workers to exit (default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--pid-dir",
        default=DEFAULT_PID_DIR,
        help=f"where the workers write their pid files (default: {DEFAULT_PID_DIR})",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout_s) and args.timeout_s >= 0):
        print(
            f"pagedserve drain-node: error: --timeout-s must be a finite number >= 0, "
            f"got {args.timeout_s}",
            file=sys.stderr,
        )
        return 2
    result = drain_node(args.pid_dir, args.timeout_s)
    print(
        f"pagedserve drain-node: signalled {len(result.signalled)} worker(s)"
        + (f" ({', '.join(result.signalled)})" if result.signalled else ""),
        flush=True,
    )
    if result.still_running:
        print(
            f"pagedserve drain-node: still running after {args.timeout_s:g} s: "
            f"{', '.join(result.still_running)}",
            file=sys.stderr,
        )
        return 1
    return 0
