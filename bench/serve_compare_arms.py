"""The server arms of `bench serve-compare`: the command each runs, and one timed run of it.

    ours     pagedserve serve --num-workers 1 --model M --served-model-name M
                 --http-port P --grpc-port Q
    NAME     ours with the FLAGS of ``--variant NAME=FLAGS`` added
    base     ours from another install (``--baseline-python``)
    vllm     python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name M
                 --port P --host 127.0.0.1 --dtype float32, with VLLM_CPU_KVCACHE_SPACE=2

(the ``engine`` arm, our engine alone, is `serve_compare_engine`). Both sides run with their
own defaults, given only what they need to serve. ``--host 127.0.0.1`` is our server's
default interface. ``--dtype float32`` (``--vllm-dtype``): vLLM's default (``auto``)
downcasts a float32 checkpoint on the CPU to the first dtype its platform lists, bfloat16 on
x86 (`vllm/config/model.py`, `_resolve_auto_dtype`), while ours serves float32. A KV size
(``--vllm-kv-gib``, 2 GiB; ``default`` leaves it out): without one vLLM's CPU worker reserves
``gpu_memory_utilization`` (0.92) of the machine's memory and refuses to start where less
than that is free (`vllm/v1/worker/cpu_worker.py`), as on a machine shared with others;
2 GiB holds ~46,000 tokens of SmolLM2's KV. Our ``--num-workers`` is left out (the server
sizes itself) unless ``--ours-num-workers N`` sets it. The equal-settings comparison of
earlier figures is opt-in: ``--kv-cache-gib G`` gives both the same KV pool (our
``--kv-cache-bytes``, vLLM's ``VLLM_CPU_KVCACHE_SPACE``) and ``--worker-threads N`` gives our
worker N torch threads (vLLM's CPU build picks its own). A ``VLLM_CPU_KVCACHE_SPACE`` of this
environment is not passed on: these options say what vLLM gets.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench.compare_arm import child_env
from pagedserve.bench.serve_compare_server import Server, ServerFailed

if TYPE_CHECKING:  # numpy and torch stay out of `pagedserve --help`
    from pagedserve.bench.openai_load import LoadSummary, RequestRecord, Slo
    from pagedserve.bench.serve_compare_sweep import LoadPoint

OURS, VLLM, BASE, ENGINE = "ours", "vllm", "base", "engine"
VLLM_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT = "default"  # of `--ours-num-workers` and `--vllm-kv-gib`: the setting left out
VLLM_KV_GIB = 2  # what vLLM needs to start on a shared machine (see the module docstring)


@dataclass(frozen=True)
class ArmRun:
    """One timed run of one arm at one load: its records, their summary, how long the server
    took to serve, and the CPU seconds per process role of its session during the run
    (`proc_cpu`), with the client's own under ``client``."""

    arm: str
    point: LoadPoint
    repeat: int
    startup_s: float
    records: tuple[RequestRecord, ...]
    summary: LoadSummary
    cpu_s: dict[str, float]


def count_or_default(text: str) -> int | None:
    """argparse type of ``--ours-num-workers`` and ``--vllm-kv-gib``: a count >= 1, or
    ``default`` (None: the setting left out)."""
    if text == DEFAULT:
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a count >= 1 or {DEFAULT!r}, got {text!r}")


def our_flags(args: argparse.Namespace, extra: str = "") -> list[str]:
    """`pagedserve serve`'s flags of an arm of ours, less its ports: `extra` is a variant's."""
    workers = args.ours_num_workers
    flags = [] if workers is None else ["--num-workers", str(workers)]
    flags += ["--model", args.model, "--served-model-name", args.model]
    if args.kv_cache_gib is not None:
        flags += ["--kv-cache-bytes", str(args.kv_cache_gib << 30)]
    if args.worker_threads is not None:
        flags += ["--worker-threads", str(args.worker_threads)]
    return flags + shlex.split(extra)


def parse_variant(text: str) -> tuple[str, str]:
    """`NAME=FLAGS` of `--variant`: another arm of ours, with FLAGS added to its command."""
    name, sep, flags = text.partition("=")
    if not sep or not name.isidentifier() or name in (OURS, VLLM, BASE, ENGINE):
        raise ValueError(f"--variant wants NAME=FLAGS with a new NAME, got {text!r}")
    return name, flags


def arm_commands(args, vllm_python, variants: dict[str, str], layout) -> dict[str, str]:
    """Every arm in the order of its first run, and what it runs (for the report)."""
    ours = "pagedserve serve " + " ".join(our_flags(args)) + " --http-port P --grpc-port Q"
    arms = {OURS: ours + ("" if args.ours_python == sys.executable else f" ({args.ours_python})")}
    arms |= {name: f"ours with {flags}" for name, flags in variants.items()}
    if args.baseline_python:
        arms[BASE] = f"ours from {args.baseline_python}"
    if layout is not None:
        arms[ENGINE] = f"our engine alone, as the served worker 0: {layout.describe()}"
    if vllm_python:
        kv_gib = vllm_kv_gib(args)
        kv = f"{VLLM_KV_ENV}={kv_gib} " if kv_gib is not None else ""
        arms[VLLM] = (
            f"{kv}python -m vllm.entrypoints.openai.api_server --model DIR "
            f"--served-model-name {args.model} --port P --host 127.0.0.1 "
            f"--dtype {args.vllm_dtype} ({vllm_python})"
        )
    return arms


def our_server(
    args: argparse.Namespace,
    scratch: Path,
    log_path: Path,
    arm: str = OURS,
    extra: str = "",
    python: str = sys.executable,
) -> Server:
    """`pagedserve serve` (see the module docstring); `python`: whose install serves."""
    from pagedserve.cluster.ports import free_port

    http_port, grpc_port = free_port(), free_port()
    command = [python, "-m", "pagedserve", "serve", *our_flags(args, extra)]
    command += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    return Server(arm, command, child_env({}), str(scratch), http_port, log_path)


def vllm_kv_gib(args: argparse.Namespace) -> int | None:
    """vLLM's KV pool, GiB: ``--kv-cache-gib`` (both sides), else ``--vllm-kv-gib``."""
    return args.kv_cache_gib if args.kv_cache_gib is not None else args.vllm_kv_gib


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's environment: ours less PYTHONPATH, with its KV pool as `vllm_kv_gib` says."""
    env = child_env({})
    env.pop(VLLM_KV_ENV, None)
    if (kv_gib := vllm_kv_gib(args)) is not None:
        env[VLLM_KV_ENV] = str(kv_gib)
    return env


def vllm_server(
    args: argparse.Namespace, vllm_python: str, model_dir: str, scratch: Path, log_path: Path
) -> Server:
    """vLLM's OpenAI server (see the module docstring), run from the scratch directory so
    that it runs apart from this checkout."""
    from pagedserve.cluster.ports import free_port

    port = free_port()
    command = [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", args.model, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", args.vllm_dtype,
    ]  # fmt: skip
    return Server(VLLM, command, vllm_env(args), str(scratch), port, log_path)


async def send(base_url: str, model: str, point: LoadPoint, workload, timeout_s: float):
    """The workload at its arrival times, or through a closed loop's clients."""
    from pagedserve.bench.openai_load import run_closed_loop, run_load

    if point.concurrency is not None:
        return await run_closed_loop(base_url, model, workload, point.concurrency, timeout_s)
    return await run_load(base_url, model, workload, timeout_s)


def run_arm(
    server: Server, point: LoadPoint, workload, warmup, args: argparse.Namespace, repeat: int
) -> ArmRun:
    """Starts the server, warms it up, times the workload, and stops it (always)."""
    from pagedserve.bench.openai_load import Slo, run_load, summarize
    from pagedserve.bench.proc_cpu import client_cpu_s, cpu_by_role, session_cpu

    print(f"starting the {server.name} server (log: {server.log_path})", flush=True)
    server.start()
    try:
        startup_s = server.wait_serving(args.startup_timeout)
        print(f"  serving after {startup_s:.0f} s; warming up", flush=True)
        for record in asyncio.run(run_load(server.base_url, args.model, warmup, 300.0)):
            if not record.ok:
                raise ServerFailed(f"the {server.name} server failed a warm-up: {record.error}")
        session = server.session
        assert session is not None
        before, client_before = session_cpu(session), client_cpu_s()
        records = asyncio.run(
            send(server.base_url, args.model, point, workload, args.request_timeout)
        )
        cpu_s = cpu_by_role(before, session_cpu(session))
        cpu_s["client"] = client_cpu_s() - client_before
    finally:
        stopping = time.monotonic()
        server.stop()
        print(f"  stopped (with every process it started) in {time.monotonic() - stopping:.0f} s")
    run = ArmRun(server.name, point, repeat, startup_s, tuple(records), summarize(records), cpu_s)
    print_run(run, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    return run


def print_run(run: ArmRun, slo: Slo) -> None:
    """A run's figures as it ends: its row, its CPU by role, its failures."""
    from pagedserve.bench.serve_compare_report import cpu_cells, row_cells

    print(f"  {run.point.label}, run {run.repeat + 1} {run.arm}: " + row_cells(run, slo),
          flush=True)  # fmt: skip
    print(f"    CPU s over {run.summary.duration_s:.1f} s: " + cpu_cells(run.cpu_s), flush=True)
    for record in run.records:
        if not record.ok:
            print(f"    request {record.index} failed: {record.error}", flush=True)
