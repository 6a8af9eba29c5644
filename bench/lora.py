"""`pagedserve bench lora`: tokens/s with 1, 4 and 16 LoRA adapters against the base alone, on
the same arrivals; and what loading an adapter costs.

Adapters are written in PEFT's format into a temporary directory (random A and B of rank
`--rank` on q/k/v/o and gate/up/down; the bench needs no `peft`). Every arm runs the same
`--num-requests` prompts arriving at the same offsets (all at once by default: the engine's
throughput; or Poisson at `--rate` per second, seeded),
on one engine per arm; request i runs on adapter i mod k (the base arm: none). With the default
`max_loras` of 4, the 16-adapter arm also pays for slots changing hands (`slot loads`).

Per run: output tokens/s over the run's wall time, and the steps' count. Arms alternate within
each repeat; every figure is the median over `--repeats` runs with the min-max spread beside it.
Load time: reading and checking one adapter from disk (`load_lora`), and copying it into a
device slot (`LoraRegistry.assign`), each the median of `--repeats` x 4 loads.

    $ pagedserve bench lora --model smollm2-135m --repeats 3 --json lora.json --markdown lora.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.bench.bench_io import positive_int, report

ARMS = (0, 1, 4, 16)  # adapters in the workload; 0 is the base model alone
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, model: Any, rank: int, seed: int) -> str:
    """A random LoRA over ``model``'s Llama-family linears, saved as PEFT does."""
    import torch
    from safetensors.torch import save_file

    from pagedserve.workers.lora.adapter import model_shapes

    shapes = model_shapes(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(len(model.model.layers)):
        for target, shape in shapes.items():
            group = "self_attn" if target in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            a = torch.randn(rank, shape.in_features, generator=generator) * 0.02
            b = torch.randn(shape.out_features, rank, generator=generator) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def workload(vocab: int, args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    """(arrival offset in s, prompt ids) per request, the same for every arm."""
    rng = random.Random(0)
    now, requests = 0.0, []
    for _ in range(args.num_requests):
        requests.append((now, [rng.randrange(3, vocab) for _ in range(args.prompt_len)]))
        now += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    return requests


def run_arm(llm: Any, requests: list, num_adapters: int, params: Any, prefix: str) -> dict:
    """Add each request at its offset (adapter i mod k), step until all are done."""
    engine = llm.engine
    pending = list(enumerate(requests))
    tokens, steps = 0, 0
    loads_before = engine.loras.num_slot_loads
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (_, prompt) = pending.pop(0)
            lora = f"a{i % num_adapters}" if num_adapters else None
            engine.add_request(f"{prefix}{i}", prompt, params, lora=lora)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        for delta in engine.step():
            tokens += sum(len(c.token_ids) for c in delta.completions)
        steps += 1
    wall = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "steps": steps,
        "slot_loads": engine.loras.num_slot_loads - loads_before,
    }


def load_times(llm: Any, paths: list[str], repeats: int) -> dict[str, float]:
    """Median ms to read and check an adapter, and to copy one into a device slot."""
    registry = llm.engine.loras
    reads, copies = [], []
    for i in range(repeats * 4):
        path = paths[i % len(paths)]
        started = time.perf_counter()
        adapter = llm.engine.load_lora(f"t{i}", path)
        reads.append(time.perf_counter() - started)
        registry._slot_of.clear()  # every slot free: the copy alone is timed
        started = time.perf_counter()
        registry.assign({adapter.key})
        copies.append(time.perf_counter() - started)
        llm.engine.unload_lora(f"t{i}")
    return {"read_ms": 1e3 * statistics.median(reads), "slot_ms": 1e3 * statistics.median(copies)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedserve.workers.model.loader import load_model
    from pagedserve.workers.offline.llm import LLM
    from pagedserve.workers.protocol.sampling import SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tmp = tempfile.TemporaryDirectory(prefix="pagedserve-bench-lora-")
    paths = [
        write_adapter(Path(tmp.name) / f"a{i}", loaded.model, args.rank, seed=i)
        for i in range(max(ARMS))
    ]
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    llms = {
        k: LLM(
            loaded_model=loaded,
            model=args.model,
            max_model_len=args.max_len,
            max_loras=args.max_loras,
            max_lora_rank=max(args.max_lora_rank, args.rank),
            lora_modules=modules[:k],
        )
        for k in ARMS
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = workload(loaded.vocab_size, args)
    warmup = [(0.0, requests[0][1])] * 2
    for k, llm in llms.items():  # untimed warm-up
        run_arm(llm, warmup, k, SamplingParams(max_tokens=2, temperature=0.0), "w-")
    runs: dict[int, list[dict]] = {k: [] for k in ARMS}
    for repeat in range(args.repeats):
        order = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
        for k in order:
            runs[k].append(run_arm(llms[k], requests, k, params, f"r{repeat}-"))
    loads = load_times(llms[1], paths, args.repeats)
    tmp.cleanup()
    return {
        "model": args.model,
        "rank": args.rank,
        "max_loras": args.max_loras,
        "max_lora_rank": max(args.max_lora_rank, args.rank),
        "num_requests": args.num_requests,
        "rate": args.rate,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "load_average": os.getloadavg(),
        "cpus": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "summary": summarize(runs),
        "load": loads,
    }


def summarize(runs: dict[int, list[dict]]) -> dict[str, Any]:
    summary = {}
    base = statistics.median(r["tokens_per_s"] for r in runs[0])
    for k, arm_runs in runs.items():
        rates = [r["tokens_per_s"] for r in arm_runs]
        summary[str(k)] = {
            "runs": len(arm_runs),
            "tokens_per_s": {
                "median": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
            },
            "of_base": statistics.median(rates) / base,
            "slot_loads": statistics.median(r["slot_loads"] for r in arm_runs),
            "steps": statistics.median(r["steps"] for r in arm_runs),
        }
    return summary


def format_markdown(data: dict[str, Any]) -> str:
    load = data["load_average"]
    arrivals = f"at {data['rate']}/s" if data["rate"] else "at once"
    lines = [
        f"model `{data['model']}`, rank {data['rank']} on all 7 projections, max_loras "
        f"{data['max_loras']}, max_lora_rank {data['max_lora_rank']}; "
        f"{data['num_requests']} requests "
        f"{arrivals} "
        f"({data['prompt_len']} prompt + {data['max_tokens']} output tokens); "
        f"{data['cpus']} CPUs, {data['threads']} torch threads, load average at the end "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
        "",
        "| adapters | tok/s (median, min-max) | of base | slot loads per run | steps |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, row in data["summary"].items():
        t = row["tokens_per_s"]
        name = "base alone" if k == "0" else k
        lines.append(
            f"| {name} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | "
            f"{row['of_base']:.2f} | {row['slot_loads']:.0f} | {row['steps']:.0f} |"
        )
    loads = data["load"]
    lines += [
        "",
        f"adapter load: read and check {loads['read_ms']:.1f} ms, copy into a device slot "
        f"{loads['slot_ms']:.1f} ms (medians)",
    ]
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lora",
        help="LoRA: tok/s with 1, 4, 16 adapters vs the base alone; adapter load time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="the base model (default: smollm2-135m)")
    add("--rank", type=positive_int, default=8, help="every adapter's rank")
    add("--max-loras", type=positive_int, default=4, help="adapters resident per step")
    add(
        "--max-lora-rank",
        type=positive_int,
        default=16,
        help="the slots' width (default 16, the engine's; at least --rank)",
    )
    add("--num-requests", type=positive_int, default=32, help="requests per run")
    add(
        "--rate",
        type=float,
        default=0.0,
        help="arrivals per second (Poisson, seeded); 0 (the default): all at the start",
    )
    add("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    add("--max-tokens", type=positive_int, default=32, help="output tokens per request")
    add("--max-len", type=positive_int, default=1024, help="max_model_len of every arm")
    add("--repeats", type=positive_int, default=3, help="timed runs per arm")
    add(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: torch's; 1 steadies a machine others load)",
    )
    add("--json", metavar="FILE", default=None)
    add("--markdown", metavar="FILE", default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = bench(args)
    report(data, format_markdown(data), args.json, args.markdown)
    return 0
