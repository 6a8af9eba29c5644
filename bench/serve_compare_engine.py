"""The `engine` arm of `bench serve-compare`: our engine alone, built as the served worker's.

It answers what the serving path costs: served output tok/s ÷ engine-alone tok/s on the same
arrivals (the report's ``ours/engine``). For that the engine must be the one the `ours` arm
serves with, so nothing here restates a setting: `served_worker_layout` puts the `ours` arm's
own flags through `pagedserve serve`'s parser and config (`cluster/serve/cli.py`'s
`cluster_config_from_args`, `ClusterConfig`) and takes what worker 0 is built from
(`cluster/pool/spec.py`): its `EngineConfig`, its torch threads, its niceness and its cores.
Its threads are `PlacementConfig.worker_thread_count` where the config sets them; where it
leaves them to Ray, Ray's rule for an actor (``OMP_NUM_THREADS`` of the environment if set,
else its CPUs rounded down, at least 1: `ray._private.utils.set_omp_num_threads_if_unset`).

The engine then runs in a child process (`engine_arrivals`: the same requests at the same
arrival times, or the same closed loop; steps on a thread of their own, as the worker's are)
with that layout; its CPU seconds over the timed run are all the engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench.proc_cpu import ENGINE_ARM_ROLE
from pagedserve.bench.serve_compare_arms import ENGINE, ArmRun
from pagedserve.bench.serve_compare_server import ServerFailed
from pagedserve.bench.serve_compare_sweep import LoadPoint
from pagedserve.workers.engine.config import EngineConfig

if TYPE_CHECKING:
    from pagedserve.cluster.serve.node_layout import NodeResources


@dataclass(frozen=True)
class WorkerLayout:
    """What worker 0 of a `pagedserve serve` command is built from, and where it runs."""

    engine: EngineConfig
    threads: int
    threads_from: str  # which setting gave `threads`
    nice: int | None  # None: Ray's (the engine arm then keeps this process's)
    cpus: tuple[int, ...] | None  # None: not pinned
    num_workers: int

    def describe(self) -> str:
        where = "any core" if self.cpus is None else f"cores {list(self.cpus)}"
        nice = "inherited" if self.nice is None else self.nice
        return (
            f"{self.threads} torch thread(s) ({self.threads_from}), niceness {nice}, {where}, "
            f"attention {self.engine.attention_backend}, linear {self.engine.linear_backend}, "
            f"KV {'default' if self.engine.kv_cache_bytes is None else self.engine.kv_cache_bytes}"
            f" bytes, {self.engine.max_num_seqs} sequences at once; worker 0 of {self.num_workers}"
        )


def served_worker_layout(
    serve_flags: list[str],
    environ: dict[str, str] | os._Environ = os.environ,
    node: NodeResources | None = None,
) -> WorkerLayout:
    """Worker 0's layout under ``pagedserve serve SERVE_FLAGS`` on this (CPU) machine (or
    `node`: what `pagedserve serve` sizes from, `cluster/serve/node_layout.py`).

    Raises:
        ValueError: flags `pagedserve serve` would refuse.
    """
    from pagedserve.cluster.api.config import split_app_args
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serve import cli as serve_cli
    from pagedserve.workers.process.core_share import usable_cores

    parser = argparse.ArgumentParser(prog="pagedserve", exit_on_error=False)
    serve_cli.register(parser.add_subparsers())
    try:
        args = parser.parse_args(["serve", *serve_flags])
    except (argparse.ArgumentError, SystemExit) as error:
        raise ValueError(f"pagedserve serve refuses {serve_flags}: {error}") from None
    data = serve_cli.cluster_config_from_args(args, num_gpus=0, node=node)
    config = ClusterConfig.from_dict(split_app_args(data)[0])
    num_workers = config.scaling.num_workers
    threads = config.placement.worker_thread_count(0, num_workers)
    threads_from = "the cluster config"
    if config.placement.worker_share_cores:  # the engine alone has work: every core is its
        cores = node.num_cores if node is not None else usable_cores()
        threads, threads_from = cores, "every core: shared, and alone with work"
    elif threads is None and environ.get("OMP_NUM_THREADS", "").isdigit():
        threads, threads_from = int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS, kept by Ray"
    elif threads is None:
        threads = max(math.floor(config.placement.worker_num_cpus), 1)
        threads_from = f"Ray's default for an actor of {config.placement.worker_num_cpus:g} CPU"
    return WorkerLayout(
        engine=config.worker_engine.for_worker(config.actors.worker_name(0)),
        threads=threads,
        threads_from=threads_from,
        nice=config.placement.worker_nice,
        cpus=config.placement.worker_cpu_share(0, num_workers),
        num_workers=num_workers,
    )


def run_engine_arm(
    args: argparse.Namespace,
    layout: WorkerLayout,
    point: LoadPoint,
    workload,
    warmup,
    scratch: Path,
    repeat: int,
) -> ArmRun:
    """One timed run of the engine alone in a child process (see the module docstring)."""
    from pagedserve.bench.compare_arm import child_env
    from pagedserve.bench.openai_load import RequestRecord, summarize
    from pagedserve.bench.serve_compare_arms import print_run
    from pagedserve.bench.serve_compare_report import slo_of

    def as_json(planned) -> list[dict]:
        return [
            {"index": p.index, "arrival_s": p.arrival_s, "token_ids": list(p.token_ids),
             "max_tokens": p.max_tokens}
            for p in planned
        ]  # fmt: skip

    name = f"engine-{point.key}-{repeat + 1}"
    spec_path, out_path, log_path = (scratch / f"{name}{ext}" for ext in (".spec", ".json", ".log"))
    spec = {"engine": dataclasses.asdict(layout.engine), "nice": layout.nice,
            "cpus": layout.cpus, "concurrency": point.concurrency,
            "requests": as_json(workload), "warmup": as_json(warmup)}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    env = child_env({"OMP_NUM_THREADS": str(layout.threads)})  # as Ray gives the worker
    command = [sys.executable, "-m", ENGINE_ARM_ROLE, str(spec_path), str(out_path)]
    print(f"running the engine arm (our engine alone; log: {log_path})", flush=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, cwd=str(scratch), env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        process.wait()
    if process.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise ServerFailed(f"the engine arm exited with {process.returncode}:\n{tail}")
    out = json.loads(out_path.read_text())
    records = tuple(RequestRecord(**{**r, "chunk_times_s": tuple(r["chunk_times_s"])})
                    for r in out["records"])  # fmt: skip
    cpu_s = {ENGINE_ARM_ROLE: out["cpu_s"]}
    run = ArmRun(ENGINE, point, repeat, 0.0, records, summarize(records), cpu_s)
    print_run(run, slo_of(args))
    steps = out["step_s"]
    print(
        f"    {len(steps)} steps, median {statistics.median(steps) * 1e3:.1f} ms; ran with "
        f"{out['threads']} torch thread(s), niceness {out['nice']}; "
        f"{time.monotonic() - started:.0f} s with loading",
        flush=True,
    )
    return run
