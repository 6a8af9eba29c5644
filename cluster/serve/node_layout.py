"""What `pagedserve serve` runs on a machine when the user does not say: how many workers, how
many torch threads each, how much KV each holds. Decided from the machine (`NodeResources`:
cores, NUMA nodes, memory, GPUs), only for the settings no flag or config file gave, and
printed at start-up as the decision with its reasons.

- **GPUs**: one worker per GPU (one GPU each), its KV pool a share of the device's free memory
  (the engine's own default).
- **CPUs**: one worker per NUMA node, each with one torch thread per core of its node. An
  engine's decode step on a CPU is bound by reading the weights; threads of one engine share
  that read, and a worker spanning two NUMA nodes would read half its weights across the
  interconnect. On the 2-core, one-node machine of bench/README.md ("Serving defaults"; 30
  requests at 1 req/s, 3 alternated runs each), one worker with both cores had the lowest
  TTFT p50 (each alternative 1.10-1.14x per pair) and a TPOT p50 level with two workers of one
  core each (0.99x) and 4-5% below one worker of one core, with or without the control plane
  pinned to the other core. Ray alone would give a worker one thread per reserved CPU (1).
- **KV pool on CPUs**: `CPU_KV_MEMORY_FRACTION` of the memory available at start-up, shared
  among the node's workers, at most `CPU_KV_MAX_BYTES` each. The engine's own CPU default
  (256 MiB: 5,824 positions of SmolLM2-135M) admitted ~25 requests of the saturating workload
  at a time and queued the rest (TTFT p50 21 s against vLLM's 5.6 s, which takes 92% of memory).
- **Sequences at once on CPUs**: `CPU_MAX_NUM_SEQS` (128, vLLM's CPU server's own) per worker,
  not the engine's 64. At the saturating load of bench/README.md ("Admitting 128 at once";
  160 requests at 8 req/s, 3 alternated runs) one worker admitting 128 delivered 1.08x the
  tokens a second (1.05-1.11) and its first tokens 2.6x sooner (TTFT p50 0.38x), each token
  1.57x later (still ~0.7x vLLM's); 256 delivered no more (1.08x) at TPOT 1.75x. Below 64
  requests in flight, as at 1 req/s, the bound is never reached and nothing changes.

A setting given on the command line or in `--config` always wins; so does `--address` (a
cluster that is not this machine: nothing is sized from here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU_KV_MEMORY_FRACTION = 0.4
CPU_KV_MAX_BYTES = 4 << 30
CPU_MAX_NUM_SEQS = 128
GIB = 1 << 30


@dataclass(frozen=True)
class NodeResources:
    """What this machine offers the workers: the cores this process may run on, grouped by
    NUMA node, the memory available now, and Ray's count of GPUs."""

    numa_cores: tuple[tuple[int, ...], ...]  # the usable cores of each NUMA node (non-empty)
    available_bytes: int
    num_gpus: int

    @property
    def num_cores(self) -> int:
        return sum(len(cores) for cores in self.numa_cores)

    @classmethod
    def of_this_machine(cls, num_gpus: int, sys_root: Path = Path("/")) -> NodeResources:
        usable = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        if not usable:
            usable = set(range(os.cpu_count() or 1))
        return cls(
            numa_cores=_numa_cores(usable, sys_root),
            available_bytes=_available_bytes(sys_root),
            num_gpus=num_gpus,
        )


@dataclass(frozen=True)
class NodeLayout:
    """The settings chosen for this machine (only those the user left open) and why."""

    settings: dict[str, Any]  # the sections' fields chosen, by name (`nest` places them)
    engine: dict[str, Any]  # EngineConfig fields chosen
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return "; ".join(self.reasons)


def plan(data: dict[str, Any], node: NodeResources) -> NodeLayout:
    """The layout for `node`, filling only what `data` (the user's cluster config, its
    sections nested, with its `engine` mapping) leaves unset.

    P/D roles count as workers: without `num_workers`, the pool holds at least
    `prefill_workers + decode_workers`, and at least 2 once roles are set.
    """
    engine = data.get("engine") or {}
    roles = (_given(data, "prefill_workers") or 0) + (_given(data, "decode_workers") or 0)
    settings: dict[str, Any] = {}
    chosen_engine: dict[str, Any] = {}
    reasons: dict[str, str] = {}  # the setting → why its value; only kept ones are printed
    # A tensor-parallel worker spans k devices (`docs/tensor-parallel.md`); its KV budget is
    # per rank.
    ranks = engine.get("tensor_parallel_size") or 1
    ranks = ranks if isinstance(ranks, int) and ranks >= 1 else 1  # the config check names it
    if node.num_gpus:
        groups = max(1, node.num_gpus // ranks)
        settings.update(num_workers=groups, worker_num_gpus=1.0)
        chosen_engine["device"] = "cuda"
        reasons["num_workers"] = f"{node.num_gpus} GPU(s): one worker per GPU" + (
            f" group of {ranks} (tensor parallel)" if ranks > 1 else ""
        )
        return _only_unset(data, engine, settings, chosen_engine, reasons)
    nodes = len(node.numa_cores)
    workers = max(nodes, roles, 2 if roles else 1)
    settings["num_workers"] = workers
    reasons["num_workers"] = f"{node.num_cores} core(s) on {nodes} NUMA node(s): " + (
        f"{workers} worker(s) for {roles} P/D role(s)" if roles > nodes else f"{workers} worker(s)"
    )
    num_workers = _given(data, "num_workers")
    num_workers = workers if num_workers is None else num_workers
    if not isinstance(num_workers, int) or num_workers < 1:  # the config check names it
        return _only_unset(data, engine, settings, chosen_engine, reasons)
    if _given(data, "worker_cpus") is None:  # pinned workers get a thread per core of their slice
        threads = _threads_per_worker(node, num_workers)
        settings["worker_threads"] = threads
        reasons["worker_threads"] = (
            f"{threads} torch thread(s) per worker (its share of {node.num_cores} core(s) "
            f"among {num_workers} worker(s))"
        )
    chosen_engine["max_num_seqs"] = CPU_MAX_NUM_SEQS
    reasons["max_num_seqs"] = f"{CPU_MAX_NUM_SEQS} sequences at once per worker"
    share = int(node.available_bytes * CPU_KV_MEMORY_FRACTION) // (num_workers * ranks)
    kv = min(CPU_KV_MAX_BYTES, share)
    if kv > 0:
        chosen_engine["kv_cache_bytes"] = kv
        reasons["kv_cache_bytes"] = (
            f"KV pool {kv / GIB:.1f} GiB per worker{' rank' if ranks > 1 else ''} "
            f"({CPU_KV_MEMORY_FRACTION:.0%} of "
            f"{node.available_bytes / GIB:.1f} GiB available, at most "
            f"{CPU_KV_MAX_BYTES / GIB:.0f} GiB each)"
        )
    return _only_unset(data, engine, settings, chosen_engine, reasons)


def _only_unset(
    data: dict[str, Any],
    engine: dict[str, Any],
    settings: dict[str, Any],
    chosen_engine: dict[str, Any],
    reasons: dict[str, str],
) -> NodeLayout:
    """The chosen settings the user left unset, and the reasons of those only."""
    kept = {k: v for k, v in settings.items() if _given(data, k) is None}
    kept_engine = {k: v for k, v in chosen_engine.items() if engine.get(k) is None}
    if "num_kv_blocks" in engine and engine["num_kv_blocks"] is not None:
        kept_engine.pop("kv_cache_bytes", None)  # the user's block count wins over bytes
    said = tuple(why for name, why in reasons.items() if name in kept or name in kept_engine)
    return NodeLayout(kept, kept_engine, said)


def _given(data: dict[str, Any], name: str) -> Any:
    """The value `data` gives the field `name` in its section (None: not given)."""
    from pagedserve.cluster.config import SECTION_OF

    section = data.get(SECTION_OF[name])
    return section.get(name) if isinstance(section, dict) else None  # else the check names it


def _threads_per_worker(node: NodeResources, num_workers: int) -> int:
    """Each worker's share of the cores: a NUMA node's cores when there is a worker per node,
    else the machine's cores split evenly (at least 1)."""
    if num_workers == len(node.numa_cores):
        return max(1, min(len(cores) for cores in node.numa_cores))
    return max(1, node.num_cores // num_workers)


def _numa_cores(usable: set[int], sys_root: Path) -> tuple[tuple[int, ...], ...]:
    """The usable cores of each NUMA node that has any (one group when the machine does not
    say: no /sys/devices/system/node)."""
    from pagedserve.workers.process.cpu_placement import parse_cpu_list

    nodes = []
    for cpulist in sorted((sys_root / "sys/devices/system/node").glob("node[0-9]*/cpulist")):
        text = cpulist.read_text().strip()
        cores = tuple(c for c in parse_cpu_list(text, str(cpulist)) if c in usable) if text else ()
        if cores:
            nodes.append(cores)
    return tuple(nodes) or (tuple(sorted(usable)),)


def _available_bytes(sys_root: Path) -> int:
    """`MemAvailable` of /proc/meminfo (0 where there is none: the pool keeps its default)."""
    try:
        for line in (sys_root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
