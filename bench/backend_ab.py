"""Attention backends head to head on one engine workload, arms alternated in one process.

    python -m pagedserve.bench.backend_ab --model /tmp/smollm2-135m --arms torch,cpu --runs 3
    python -m pagedserve.bench.backend_ab --profile --num-prompts 32 --max-tokens 16 ...

`pagedserve bench offline` compares our engine with HF; this compares our engine with itself
under each `--arms` backend: the model is loaded once, and every run builds a fresh `LLM` per
arm (a new pool, an empty prefix cache) and drives the same requests through the offline
benchmark's `run_engine`, arms in turn (torch, cpu, torch, cpu, ...) so that load from other
processes falls on both. It prints tokens/s per run, the median and the spread (max - min) of
each arm, and with `--profile` one more run per arm under torch.profiler: the top operators by
self CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve.bench.offline import _greedy_params, _special_ids, run_engine
from pagedserve.bench.offline_hf import pad_token_id
from pagedserve.bench.offline_workload import (
    default_num_kv_blocks,
    make_output_lens,
    make_prompts,
)
from pagedserve.workers.model.loader import load_model
from pagedserve.workers.offline.llm import LLM


def _workload(args: argparse.Namespace, loaded) -> tuple[list[list[int]], list[int]]:
    special = _special_ids(loaded, pad_token_id(loaded))
    prompts = make_prompts(
        args.num_prompts, args.min_len, args.max_len, loaded.vocab_size, special, seed=args.seed
    )
    output_lens = make_output_lens(
        args.num_prompts, args.min_tokens, args.max_tokens, distribution=args.output_len_dist
    )
    return prompts, output_lens


def _one_run(loaded, backend: str, args, prompts, output_lens) -> tuple[float, float]:
    """Useful tokens per wall second and per CPU second (this process, all threads) of one
    fresh engine on the workload. CPU seconds move less with other processes' load."""
    blocks = default_num_kv_blocks(
        [len(p) for p in prompts], output_lens, args.block_size, "paged", loaded.max_model_len
    )
    llm = LLM(
        loaded_model=loaded,
        block_size=args.block_size,
        num_kv_blocks=blocks,
        attention_backend=backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    warmup = [prompts[0][:8], prompts[1][:8]]
    run_engine(llm.engine, warmup, _greedy_params([2, 2]), recorder=None)
    cpu_started = time.process_time()
    _, elapsed = run_engine(llm.engine, prompts, _greedy_params(output_lens), recorder=None)
    cpu_s = time.process_time() - cpu_started
    return sum(output_lens) / elapsed, sum(output_lens) / cpu_s


def _profile(loaded, backend: str, args, prompts, output_lens) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _one_run(loaded, backend, args, prompts, output_lens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)


def _summary(results: dict[str, list[tuple[float, float]]]) -> str:
    lines = [
        "| arm | tok/s median | min-max | tok/CPU-s median | min-max |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm, pairs in results.items():
        cells = []
        for rates in zip(*pairs, strict=True):
            cells += [f"{statistics.median(rates):.1f}", f"{min(rates):.1f}-{max(rates):.1f}"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default=None, help="tiny-llama (default) or a local checkpoint directory")
    add("--arms", default="torch,cpu", help="comma-separated attention backends")
    add("--runs", type=int, default=3, help="runs per arm")
    add("--num-prompts", type=int, default=32)
    add("--min-len", type=int, default=16)
    add("--max-len", type=int, default=256)
    add("--min-tokens", type=int, default=8)
    add("--max-tokens", type=int, default=64)
    add("--output-len-dist", default="uniform", choices=("fixed", "uniform", "lognormal"))
    add("--seed", type=int, default=0)
    add("--block-size", type=int, default=16)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add("--profile", action="store_true", help="also profile one run per arm")
    add("--profile-rows", type=int, default=12)
    add("--json", metavar="FILE", default=None)
    args = parser.parse_args()
    arms = args.arms.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model)
    prompts, output_lens = _workload(args, loaded)
    print(
        f"model {loaded.name}; {len(prompts)} prompts, lengths {args.min_len}-{args.max_len} "
        f"(mean {statistics.mean(map(len, prompts)):.0f}); {sum(output_lens)} output tokens; "
        f"torch threads {torch.get_num_threads()}"
    )
    results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    with torch.inference_mode():
        for run in range(args.runs):
            for arm in arms:
                started = time.perf_counter()
                results[arm].append(_one_run(loaded, arm, args, prompts, output_lens))
                wall, cpu = results[arm][-1]
                print(
                    f"run {run} {arm:>6}: {wall:7.1f} tok/s, {cpu:7.1f} tok/CPU-s "
                    f"({time.perf_counter() - started:.1f} s)",
                    flush=True,
                )
        if args.runs:
            print(_summary(results))
        tables = {}
        if args.profile:
            for arm in arms:
                tables[arm] = _profile(loaded, arm, args, prompts, output_lens)
                print(f"\n## profile: {arm}\n{tables[arm]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "tok_per_s": results, "profiles": tables}, f, indent=2)


if __name__ == "__main__":
    main()
