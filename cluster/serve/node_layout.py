"""What `pagedserve serve` runs on a machine when the user does not say: how many workers, how
many torch threads each, how much KV each holds. Decided from the machine (`NodeResources`:
cores, NUMA nodes, memory, GPUs), only for the settings no flag or config file gave, and
printed at start-up as the decision with its reasons.

- **GPUs**: one worker per GPU (one GPU each), its KV pool a share of the device's free memory
  (the engine's own default).
- **CPUs**: `WORKERS_PER_NUMA_NODE` (2) workers per NUMA node that share the machine's cores
  (`worker_share_cores`, `workers/process/core_share.py`): each step runs on the cores
  divided among the workers that have work, and routing gathers light traffic on one of them
  (`kv_aware` packing, `cluster/routing/policies.py`), so under light load one worker runs on
  every core and under heavy load each runs on its own half. On the 2-core machine of
  bench/README.md ("Cores that follow the load", "Packing by requests"; alternated runs),
  at 8 req/s this delivered 1.25x the tokens a second of one worker on both cores, and
  against two workers of one core each 1.08x on one day, 0.95-0.97x on the next; at 1 req/s
  its TTFT and TPOT p50 were level with one worker's (five pairs), where two fixed workers
  took 1.37x its TTFT. One
  worker per NUMA node, with one torch thread per core of its node, where a node has one
  core, a worker is tensor parallel (its ranks split the cores), or the copies of the
  weights would pass `CPU_WEIGHTS_MEMORY_FRACTION` of the memory available. A worker spanning
  two NUMA nodes would read half its weights across the interconnect; Ray alone would give a
  worker one thread per reserved CPU (1).
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
WORKERS_PER_NUMA_NODE = 2
CPU_WEIGHTS_MEMORY_FRACTION = 0.25
GGUF_WIDENING = 8  # 4-bit codes widened to float32, the worst case
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
    # Workers share the cores only where threads and pinning are left to the layout, and a
    # worker is one process (a tensor-parallel one's ranks split the cores at start).
    share_given = _given(data, "worker_share_cores")
    own_threads = (
        _given(data, "worker_threads") is not None or _given(data, "worker_cpus") is not None
    )
    sharing = share_given is not False and not own_threads and ranks == 1
    per_node, why = _workers_per_numa_node(node, engine.get("model")) if sharing else (1, "")
    workers = max(nodes * per_node, roles, 2 if roles else 1)
    settings["num_workers"] = workers
    for_roles = roles and roles >= nodes * per_node
    reasons["num_workers"] = f"{node.num_cores} core(s) on {nodes} NUMA node(s): " + (
        f"{workers} worker(s) for {roles} P/D role(s)" if for_roles else f"{workers} worker(s){why}"
    )
    num_workers = _given(data, "num_workers")
    num_workers = workers if num_workers is None else num_workers
    if not isinstance(num_workers, int) or num_workers < 1:  # the config check names it
        return _only_unset(data, engine, settings, chosen_engine, reasons)
    # Pinned workers get a thread per core of their slice; given threads are the user's.
    if not own_threads:
        if sharing and (num_workers > 1 or share_given):
            settings["worker_share_cores"] = True
            reasons["worker_share_cores"] = (
                f"the workers share the {node.num_cores} core(s): each step runs on the cores "
                "divided among the workers that have work (all of them while one alone has), "
                "and light traffic gathers on one worker"
            )
        else:
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


def _workers_per_numa_node(node: NodeResources, model: Any) -> tuple[int, str]:
    """`WORKERS_PER_NUMA_NODE` sharing each NUMA node's cores, or one where a node has a
    single core or that many copies of the model's weights would not fit in
    `CPU_WEIGHTS_MEMORY_FRACTION` of the memory available; with why, for the start-up line."""
    if min(len(cores) for cores in node.numa_cores) < WORKERS_PER_NUMA_NODE:
        return 1, ""
    copies = WORKERS_PER_NUMA_NODE * len(node.numa_cores)
    weights = model_weight_bytes(model)
    budget = node.available_bytes * CPU_WEIGHTS_MEMORY_FRACTION
    if weights is not None and node.available_bytes and copies * weights > budget:
        return 1, (
            f" (one per NUMA node: {copies} copies of the model's ~{weights / GIB:.1f} GiB "
            f"would pass {CPU_WEIGHTS_MEMORY_FRACTION:.0%} of "
            f"{node.available_bytes / GIB:.1f} GiB available)"
        )
    return WORKERS_PER_NUMA_NODE, f" ({WORKERS_PER_NUMA_NODE} per NUMA node)"


def model_weight_bytes(model: Any) -> int | None:
    """An upper bound of the memory one worker's copy of `model`'s weights takes, from its
    files' sizes (a GGUF file's codes may be widened to float32: `GGUF_WIDENING` times its
    size); None where the files are not found (the start-up checks name a wrong model)."""
    from pagedserve.workers.model.registry import BUILTIN_GGUF, DEFAULT_MODEL, TINY_LLAMA_NAME

    name = DEFAULT_MODEL if model is None else str(model)
    if name == TINY_LLAMA_NAME:
        return 0
    try:
        path = Path(BUILTIN_GGUF[name].locate()) if name in BUILTIN_GGUF else Path(name)
        if path.is_file():
            return path.stat().st_size * (GGUF_WIDENING if path.suffix.lower() == ".gguf" else 1)
        if path.is_dir():
            weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
            return sum(p.stat().st_size for p in weights)
    except (OSError, ValueError):  # unreadable, or a built-in model not installed
        return None
    return None  # no such file or directory


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
