"""`pagedserve bench offline`: our engine against HF `generate` on the same mixed-length requests.

Both sides get the same constructed requests (random token ids; prompt lengths and per-request
output targets ``max_tokens_i`` drawn with the seed, see ``offline_workload``), the same weights
and greedy decoding of exactly ``max_tokens_i`` useful tokens per request:

    ours  LLM engine, driven step by step; request i gets
          SamplingParams(max_tokens=max_tokens_i, temperature=0, ignore_eos=True)
    HF    static batches of ``--hf-batch-size`` prompts (in prompt order, or sorted by prompt
          length with ``--hf-sort-by-length``), left-padded; a batch runs
          generate(do_sample=False, max_new_tokens=min_new_tokens=max(max_tokens_i in batch),
          eos_token_id=None) and row i keeps its first max_tokens_i tokens (``offline_hf``)

Real requests differ in output length and the server cannot know it in advance; a static batch
computes until its longest member is done, while the engine retires each request at its own
target. ``--output-len-dist fixed`` gives every request ``--max-tokens`` (no output-side waste).

It reports useful tokens/s of each side (both count sum(max_tokens_i)) and their ratio, HF's raw
generated tokens, how many requests got the same greedy tokens from both, and the KV utilization
(useful / allocated positions) measured during the run: after every engine step the pool's usage
is sampled, and the samples are pooled two ways,

    step-weighted   sum(useful) / sum(allocated) over the samples
    time-weighted   the same with each sample weighted by the wall time of the step before it

(samples with nothing allocated are skipped). The goal for paged allocation is >= 96%.

    $ pagedserve bench offline --num-prompts 64 --max-tokens 128 --json offline.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.offline_hf import pad_token_id, run_hf
from pagedserve.bench.offline_report import (
    KVUtilization,
    OfflineBenchConfig,
    OfflineBenchResult,
    SideResult,
    agreement,
    format_summary,
)
from pagedserve.bench.offline_workload import (
    LENGTH_DISTRIBUTIONS,
    OUTPUT_LEN_DISTRIBUTIONS,
    default_num_kv_blocks,
    make_output_lens,
    make_prompts,
)
from pagedserve.kernels.backends import BACKENDS
from pagedserve.workers.engine.config import KV_CACHE_DTYPES
from pagedserve.workers.kv.manager import ALLOCATION_MODES

if TYPE_CHECKING:
    from pagedserve.workers.engine.engine import Engine
    from pagedserve.workers.model.loader import LoadedModel
    from pagedserve.workers.offline.llm import LLM
    from pagedserve.workers.protocol.sampling import SamplingParams

_WARMUP_PROMPT_LEN = 8
_WARMUP_TOKENS = 2


# --- our engine ---------------------------------------------------------------------------


class _UsageRecorder:
    """Pools KV usage samples taken after each engine step (see the module docstring)."""

    def __init__(self) -> None:
        self.useful = self.allocated = 0
        self.weighted_useful = self.weighted_allocated = 0.0
        self.min_sample = 1.0
        self.num_samples = self.peak_allocated = self.peak_used_blocks = self.peak_running = 0

    def sample(self, engine: Engine, step_s: float) -> None:
        self.peak_running = max(self.peak_running, len(engine.scheduler.running))
        usage = engine.kv.usage()
        if usage.allocated_positions == 0:
            return
        self.num_samples += 1
        self.useful += usage.useful_tokens
        self.allocated += usage.allocated_positions
        self.weighted_useful += step_s * usage.useful_tokens
        self.weighted_allocated += step_s * usage.allocated_positions
        self.min_sample = min(self.min_sample, usage.utilization)
        self.peak_allocated = max(self.peak_allocated, usage.allocated_positions)
        self.peak_used_blocks = max(self.peak_used_blocks, usage.used_blocks)

    def result(self, total_blocks: int) -> KVUtilization:
        return KVUtilization(
            step_weighted=self.useful / self.allocated if self.allocated else 1.0,
            time_weighted=(
                self.weighted_useful / self.weighted_allocated if self.weighted_allocated else 1.0
            ),
            min_sample=self.min_sample,
            num_samples=self.num_samples,
            peak_allocated_positions=self.peak_allocated,
            peak_used_blocks=self.peak_used_blocks,
            total_blocks=total_blocks,
            peak_running_seqs=self.peak_running,
        )


def run_engine(
    engine: Engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    recorder: _UsageRecorder | None,
) -> tuple[list[list[int]], float]:
    """Run ``prompts`` through ``engine`` step by step, prompt i with ``params[i]``.

    Returns:
        The output token ids in prompt order, and the wall time of adding and stepping (the
        usage sampling between steps is not counted).

    Raises:
        RuntimeError: a request did not produce exactly its ``max_tokens``.
    """
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"offline-{index}", prompt, request_params)
    elapsed = time.perf_counter() - started
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        step_outputs = engine.step()
        step_s = time.perf_counter() - step_started
        elapsed += step_s
        for delta in step_outputs:  # each step reports only new tokens: add them up
            for completion in delta.completions:
                if completion.index == 0:
                    outputs.setdefault(delta.request_id, []).extend(completion.token_ids)
        if recorder is not None:
            recorder.sample(engine, step_s)
    ordered = [outputs[f"offline-{i}"] for i in range(len(prompts))]
    for index, (tokens, request_params) in enumerate(zip(ordered, params, strict=True)):
        if len(tokens) != request_params.max_tokens:
            raise RuntimeError(
                f"request {index} produced {len(tokens)} tokens, not {request_params.max_tokens}"
            )
    return ordered, elapsed


# --- the benchmark ------------------------------------------------------------------------


def run_offline_bench(config: OfflineBenchConfig) -> OfflineBenchResult:
    """Load the model once, run both sides on the same requests and compare them.

    The HF copy is taken before the engine exists: the engine's runner switches the loaded
    model to paged attention for good.
    """
    import copy

    import torch

    from pagedserve.workers.model.loader import load_model

    # --seed picks the workload; tiny-llama's weights stay those of seed 0.
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    hf_model = copy.deepcopy(loaded.model)
    pad_id = pad_token_id(loaded)
    special = _special_ids(loaded, pad_id)
    prompts = make_prompts(
        config.num_prompts,
        config.min_len,
        config.max_len,
        loaded.vocab_size,
        special,
        distribution=config.length_dist,
        seed=config.seed,
    )
    output_lens = make_output_lens(
        config.num_prompts,
        config.min_tokens,
        config.max_tokens,
        distribution=config.output_len_dist,
        seed=config.seed,
    )
    prompt_lens = [len(p) for p in prompts]
    llm = _build_llm(loaded, config, prompt_lens, output_lens)

    warmup = make_prompts(
        2, _WARMUP_PROMPT_LEN, 2 * _WARMUP_PROMPT_LEN, loaded.vocab_size, special, seed=-1
    )
    warmup_lens = [_WARMUP_TOKENS] * len(warmup)
    with torch.inference_mode():
        run_engine(llm.engine, warmup, _greedy_params(warmup_lens), recorder=None)
        run_hf(hf_model, warmup, warmup_lens, len(warmup), pad_id)

        recorder = _UsageRecorder()
        collective_before = _collective_s(llm.engine)
        ours_tokens, ours_s = run_engine(llm.engine, prompts, _greedy_params(output_lens), recorder)
        collective_s = _collective_s(llm.engine) - collective_before
        llm.engine.close()  # a tensor-parallel group's ranks stop here, before HF runs
        hf = run_hf(
            hf_model,
            prompts,
            output_lens,
            config.hf_batch_size,
            pad_id,
            sort_by_length=config.hf_sort_by_length,
        )

    useful = sum(output_lens)
    return OfflineBenchResult(
        config=config,
        model_name=loaded.name,
        num_kv_blocks=llm.engine.kv.pool.num_blocks,
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        ours=SideResult("pagedserve", useful, sum(len(t) for t in ours_tokens), ours_s),
        hf=SideResult("hf-generate", useful, hf.generated_tokens, hf.elapsed_s),
        kv=recorder.result(llm.engine.kv.pool.num_blocks),
        agreement=agreement(ours_tokens, hf.outputs, output_lens),
        collective_s=collective_s,
    )


def _collective_s(engine: Engine) -> float:
    """Rank 0's seconds in collectives so far (0 without tensor parallelism)."""
    return getattr(engine.runner, "collective_seconds", 0.0)


def _greedy_params(output_lens: Sequence[int]) -> list[SamplingParams]:
    from pagedserve import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]


def _special_ids(loaded: LoadedModel, pad_id: int) -> frozenset[int]:
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    return frozenset({pad_id, *loaded.eos_token_ids, *([] if bos is None else [bos])})


def _build_llm(
    loaded: LoadedModel, config: OfflineBenchConfig, prompt_lens: list[int], output_lens: list[int]
) -> LLM:
    from pagedserve import LLM

    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None and config.kv_cache_bytes is None:
        num_kv_blocks = default_num_kv_blocks(
            prompt_lens,
            output_lens,
            config.block_size,
            config.kv_allocation,
            loaded.max_model_len,
        )
    return LLM(
        loaded_model=loaded,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        kv_cache_bytes=config.kv_cache_bytes,
        kv_cache_dtype=config.kv_cache_dtype,
        attention_backend=config.attention_backend,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_allocation=config.kv_allocation,
        tensor_parallel_size=config.tensor_parallel_size,
    )


# --- command line -------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "offline",
        help="useful tokens/s of our engine vs HF generate on mixed-length requests, KV use",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default=None, help="smollm2-135m (default), tiny-llama, a dir or a .gguf file")
    add("--dtype", default="float32")
    add("--device", default="cpu")
    add("--num-prompts", type=positive_int, default=64)
    add("--min-len", type=positive_int, default=16, help="shortest prompt")
    add("--max-len", type=positive_int, default=256, help="longest prompt")
    add("--length-dist", choices=sorted(LENGTH_DISTRIBUTIONS), default="uniform")
    add(
        "--output-len-dist",
        choices=sorted(OUTPUT_LEN_DISTRIBUTIONS),
        default="uniform",
        help="how each request's output target max_tokens_i is drawn (fixed: all --max-tokens)",
    )
    add("--min-tokens", type=positive_int, default=8, help="shortest output target (not fixed)")
    add("--max-tokens", type=positive_int, default=128, help="longest output target")
    add("--seed", type=int, default=0)
    add("--block-size", type=positive_int, default=16)
    add("--num-kv-blocks", type=positive_int, default=None, help="default: enough for the batch")
    add("--kv-cache-bytes", type=positive_int, default=None, help="size the pool by bytes")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto, int8 or fp8")
    add("--max-num-seqs", type=positive_int, default=64)
    add("--max-num-batched-tokens", type=positive_int, default=2048)
    add("--attention-backend", choices=BACKENDS, default="auto")
    add("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--kv-allocation", choices=ALLOCATION_MODES, default="paged")
    add("--hf-batch-size", type=positive_int, default=16)
    add(
        "--hf-sort-by-length",
        action="store_true",
        help="HF: sort prompts by length before batching (less padding; default: prompt order)",
    )
    add(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks our engine's model is split over (docs/tensor-parallel.md)",
    )
    add("--json", metavar="FILE", default=None, help="also write the config and results here")
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.min_len > args.max_len:
        args._parser.error(f"--min-len ({args.min_len}) is above --max-len ({args.max_len})")
    if args.output_len_dist != "fixed" and args.min_tokens > args.max_tokens:
        args._parser.error(
            f"--min-tokens ({args.min_tokens}) is above --max-tokens ({args.max_tokens})"
        )
    config = OfflineBenchConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_prompts=args.num_prompts,
        min_len=args.min_len,
        max_len=args.max_len,
        length_dist=args.length_dist,
        output_len_dist=args.output_len_dist,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.prefix_caching,
        kv_allocation=args.kv_allocation,
        hf_batch_size=args.hf_batch_size,
        hf_sort_by_length=args.hf_sort_by_length,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    result = run_offline_bench(config)
    print(format_summary(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
            f.write("\n")
    return 0
