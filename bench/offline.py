"""`pagedserve bench offline`: our engine against HF `generate` on the same mixed-length prompts.

Both sides get the same constructed prompts (random token ids, lengths drawn from a chosen
distribution), the same weights and greedy decoding of exactly ``--max-tokens`` tokens each:

    ours  LLM engine, driven step by step; SamplingParams(temperature=0, ignore_eos=True)
    HF    static batches of ``--hf-batch-size`` prompts in arrival order, left-padded,
          generate(do_sample=False, max_new_tokens=min_new_tokens=N, eos_token_id=None)

It reports generated tokens/s of each side and their ratio, how many prompts got the same greedy
tokens from both, and the KV utilization (useful / allocated positions) measured during the run:
after every engine step the pool's usage is sampled, and the samples are pooled two ways,

    step-weighted   sum(useful) / sum(allocated) over the samples
    time-weighted   the same with each sample weighted by the wall time of the step before it

(samples with nothing allocated are skipped). The goal for paged allocation is >= 96%.

    $ pagedserve bench offline --num-prompts 64 --max-tokens 64 --json offline.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.workers.kv_cache_manager import ALLOCATION_MODES
from pagedserve.workers.kv_memory import blocks_needed

if TYPE_CHECKING:
    from pagedserve.workers.engine import Engine
    from pagedserve.workers.llm import LLM
    from pagedserve.workers.model_loader import LoadedModel
    from pagedserve.workers.sampling_params import SamplingParams

UTILIZATION_GOAL = 0.96
# The engine keeps this fraction of the pool free at admission (EngineConfig.watermark); the
# default pool size adds it back so the whole batch can be admitted at once.
_WATERMARK = 0.01
_WARMUP_PROMPT_LEN = 8
_WARMUP_TOKENS = 2


# --- workload -----------------------------------------------------------------------------


def _uniform_length(rng: random.Random, low: int, high: int) -> int:
    return rng.randint(low, high)


def _lognormal_length(rng: random.Random, low: int, high: int) -> int:
    """Long-tailed: median at the geometric mean of the bounds, clipped to them."""
    median = math.sqrt(low * high)
    return min(high, max(low, round(rng.lognormvariate(math.log(median), 0.6))))


LENGTH_DISTRIBUTIONS: dict[str, Callable[[random.Random, int, int], int]] = {
    "uniform": _uniform_length,
    "lognormal": _lognormal_length,
}


def make_prompts(
    num_prompts: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    excluded_ids: frozenset[int],
    *,
    distribution: str = "uniform",
    seed: int = 0,
) -> list[list[int]]:
    """Constructed prompts: random token ids (no special ids) with lengths from ``distribution``.

    Args:
        num_prompts: how many prompts.
        min_len: shortest prompt.
        max_len: longest prompt.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        excluded_ids: ids never drawn (pad, bos, eos: a prompt full of them means little).
        distribution: a key of ``LENGTH_DISTRIBUTIONS``.
        seed: the same seed gives the same prompts.

    Returns:
        One list of token ids per prompt.
    """
    draw_length = LENGTH_DISTRIBUTIONS[distribution]
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    rng = random.Random(seed)
    lengths = [draw_length(rng, min_len, max_len) for _ in range(num_prompts)]
    return [[rng.choice(allowed) for _ in range(length)] for length in lengths]


def default_num_kv_blocks(
    prompt_lens: Sequence[int], max_tokens: int, block_size: int, kv_allocation: str, max_len: int
) -> int:
    """Blocks that hold every sequence at full length at once, plus the admission watermark.

    ``paged`` needs ceil((prompt + max_tokens) / B) blocks per sequence; ``reserve-max`` reserves
    ceil(max_len / B) for each, whatever its length.
    """
    if kv_allocation == "reserve-max":
        needed = len(prompt_lens) * blocks_needed(max_len, block_size)
    else:
        needed = sum(blocks_needed(n + max_tokens, block_size) for n in prompt_lens)
    return math.ceil(needed / (1.0 - _WATERMARK)) + 1


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OfflineBenchConfig:
    """One run's settings, as given on the command line (``num_kv_blocks`` None: sized to fit)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_prompts: int = 64
    min_len: int = 16
    max_len: int = 256
    length_dist: str = "uniform"
    max_tokens: int = 64
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    hf_batch_size: int = 16


@dataclass(frozen=True)
class SideResult:
    """Throughput of one side: generated tokens over wall time (prefill included)."""

    name: str
    generated_tokens: int
    elapsed_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class KVUtilization:
    """Useful / allocated KV positions, sampled after every engine step of the run."""

    step_weighted: float
    time_weighted: float
    min_sample: float
    num_samples: int
    peak_allocated_positions: int
    peak_used_blocks: int
    total_blocks: int
    peak_running_seqs: int


@dataclass(frozen=True)
class Agreement:
    """How far the greedy tokens of both sides agree (reported, never asserted)."""

    prompts_equal: int
    num_prompts: int
    fraction_equal: float
    mean_common_prefix: float  # mean over prompts of (tokens before the first difference) / N


@dataclass(frozen=True)
class OfflineBenchResult:
    config: OfflineBenchConfig
    model_name: str
    num_kv_blocks: int
    prompt_lens: list[int]
    ours: SideResult
    hf: SideResult
    ratio: float  # ours / HF tokens/s
    kv: KVUtilization
    agreement: Agreement

    def to_json(self) -> dict[str, Any]:
        report = asdict(self)
        lens = self.prompt_lens
        report["workload"] = {
            "lengths_constructed": True,
            "distribution": self.config.length_dist,
            "min": min(lens),
            "mean": sum(lens) / len(lens),
            "max": max(lens),
            "prompt_tokens": sum(lens),
        }
        report["kv"]["goal"] = UTILIZATION_GOAL
        return report


def _side(name: str, generated_tokens: int, elapsed_s: float) -> SideResult:
    return SideResult(name, generated_tokens, elapsed_s, generated_tokens / elapsed_s)


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
    params: SamplingParams,
    recorder: _UsageRecorder | None,
) -> tuple[list[list[int]], float]:
    """Run ``prompts`` through ``engine`` step by step.

    Returns:
        The output token ids in prompt order, and the wall time of adding and stepping (the
        usage sampling between steps is not counted).
    """
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"offline-{index}", prompt, params)
    elapsed = time.perf_counter() - started
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        step_outputs = engine.step()
        step_s = time.perf_counter() - step_started
        elapsed += step_s
        for output in step_outputs:
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        if recorder is not None:
            recorder.sample(engine, step_s)
    return [outputs[f"offline-{i}"] for i in range(len(prompts))], elapsed


# --- HF baseline --------------------------------------------------------------------------


def _pad_token_id(loaded: LoadedModel) -> int:
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return min(loaded.eos_token_ids, default=0)


def run_hf(
    hf_model: Any, prompts: Sequence[list[int]], max_tokens: int, batch_size: int, pad_id: int
) -> tuple[list[list[int]], float]:
    """HF ``generate`` over static batches of ``batch_size`` prompts in order, left-padded.

    ``eos_token_id=None`` turns EOS off (no stop, no masking), the HF side of ``ignore_eos``.

    Returns:
        The generated token ids in prompt order, and the total wall time.

    Raises:
        RuntimeError: a sequence came back shorter than ``max_tokens``.
    """
    import torch

    device = hf_model.device
    outputs: list[list[int]] = []
    elapsed = 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        _sync(device)
        started = time.perf_counter()
        generated = hf_model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
        new_tokens = generated[:, width:].tolist()  # .tolist() waits for the device
        elapsed += time.perf_counter() - started
        if any(len(tokens) != max_tokens for tokens in new_tokens):
            raise RuntimeError(f"HF generate stopped before {max_tokens} tokens")
        outputs.extend(new_tokens)
    return outputs, elapsed


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# --- the benchmark ------------------------------------------------------------------------


def agreement(ours: Sequence[list[int]], hf: Sequence[list[int]], max_tokens: int) -> Agreement:
    """Prompts with equal greedy tokens, and the mean fraction of tokens before a difference."""
    equal = sum(a == b for a, b in zip(ours, hf, strict=True))
    prefixes = []
    for a, b in zip(ours, hf, strict=True):
        pairs = zip(a, b, strict=False)
        common = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
        prefixes.append(common / max_tokens)
    return Agreement(equal, len(ours), equal / len(ours), sum(prefixes) / len(prefixes))


def run_offline_bench(config: OfflineBenchConfig) -> OfflineBenchResult:
    """Load the model once, run both sides on the same prompts and compare them.

    The HF copy is taken before the engine exists: the engine's runner switches the loaded
    model to paged attention for good.
    """
    import copy

    import torch

    from pagedserve import SamplingParams
    from pagedserve.workers.model_loader import load_model

    # --seed picks the workload; tiny-llama's weights stay those of seed 0.
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    hf_model = copy.deepcopy(loaded.model)
    pad_id = _pad_token_id(loaded)
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
    prompt_lens = [len(p) for p in prompts]
    llm = _build_llm(loaded, config, prompt_lens)
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)

    warmup = make_prompts(
        2, _WARMUP_PROMPT_LEN, 2 * _WARMUP_PROMPT_LEN, loaded.vocab_size, special, seed=-1
    )
    warmup_params = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        run_engine(llm.engine, warmup, warmup_params, recorder=None)
        run_hf(hf_model, warmup, _WARMUP_TOKENS, len(warmup), pad_id)

        recorder = _UsageRecorder()
        ours_tokens, ours_s = run_engine(llm.engine, prompts, params, recorder)
        hf_tokens, hf_s = run_hf(hf_model, prompts, config.max_tokens, config.hf_batch_size, pad_id)

    generated = config.num_prompts * config.max_tokens
    ours, hf = _side("pagedserve", generated, ours_s), _side("hf-generate", generated, hf_s)
    return OfflineBenchResult(
        config=config,
        model_name=loaded.name,
        num_kv_blocks=llm.engine.kv.pool.num_blocks,
        prompt_lens=prompt_lens,
        ours=ours,
        hf=hf,
        ratio=ours.tokens_per_s / hf.tokens_per_s,
        kv=recorder.result(llm.engine.kv.pool.num_blocks),
        agreement=agreement(ours_tokens, hf_tokens, config.max_tokens),
    )


def _special_ids(loaded: LoadedModel, pad_id: int) -> frozenset[int]:
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    return frozenset({pad_id, *loaded.eos_token_ids, *([] if bos is None else [bos])})


def _build_llm(loaded: LoadedModel, config: OfflineBenchConfig, prompt_lens: list[int]) -> LLM:
    from pagedserve import LLM

    num_kv_blocks = config.num_kv_blocks or default_num_kv_blocks(
        prompt_lens,
        config.max_tokens,
        config.block_size,
        config.kv_allocation,
        loaded.max_model_len,
    )
    return LLM(
        loaded_model=loaded,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        attention_backend=config.attention_backend,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_allocation=config.kv_allocation,
    )


# --- report -------------------------------------------------------------------------------


def format_summary(result: OfflineBenchResult) -> str:
    """A Markdown summary of the run."""
    c, kv, agree = result.config, result.kv, result.agreement
    lens = result.prompt_lens
    caching = "on" if c.enable_prefix_caching else "off"
    goal = "meets" if kv.step_weighted >= UTILIZATION_GOAL else "below"
    lines = [
        "# pagedserve bench offline",
        "",
        f"model {result.model_name} ({c.dtype}, {c.device}); {c.num_prompts} prompts of random "
        f"token ids, lengths CONSTRUCTED ({c.length_dist} in [{c.min_len}, {c.max_len}], seed "
        f"{c.seed}: min {min(lens)}, mean {sum(lens) / len(lens):.1f}, max {max(lens)}); "
        f"{c.max_tokens} greedy tokens each (EOS ignored on both sides).",
        f"ours: B={c.block_size}, {result.num_kv_blocks} KV blocks, {c.kv_allocation}, "
        f"max_num_seqs {c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, "
        f"attention {c.attention_backend}, prefix caching {caching}."
        f" HF: static left-padded batches of {c.hf_batch_size} in prompt order.",
        "",
        "| side | generated tokens | wall s | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for side in (result.ours, result.hf):
        lines.append(
            f"| {side.name} | {side.generated_tokens} | {side.elapsed_s:.2f} | "
            f"{side.tokens_per_s:.1f} |"
        )
    lines += [
        "",
        f"ratio ours/HF: {result.ratio:.2f}x",
        f"KV utilization (useful / allocated positions, sampled after each of {kv.num_samples} "
        f"steps): step-weighted {kv.step_weighted:.2%}, time-weighted {kv.time_weighted:.2%}, "
        f"lowest sample {kv.min_sample:.2%}; goal {UTILIZATION_GOAL:.0%} (step-weighted): {goal}",
        f"peak: {kv.peak_running_seqs} running sequences, {kv.peak_used_blocks} of "
        f"{kv.total_blocks} blocks ({kv.peak_allocated_positions} positions)",
        f"greedy agreement: {agree.prompts_equal}/{agree.num_prompts} prompts equal "
        f"({agree.fraction_equal:.1%}); mean common prefix {agree.mean_common_prefix:.1%} of "
        f"{c.max_tokens} tokens",
    ]
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "offline",
        help="tokens/s of our engine vs HF generate on mixed-length prompts, and KV utilization",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default=None, help="tiny-llama (default) or a local HF checkpoint directory")
    add("--dtype", default="float32")
    add("--device", default="cpu")
    add("--num-prompts", type=_positive_int, default=64)
    add("--min-len", type=_positive_int, default=16, help="shortest prompt")
    add("--max-len", type=_positive_int, default=256, help="longest prompt")
    add("--length-dist", choices=sorted(LENGTH_DISTRIBUTIONS), default="uniform")
    add("--max-tokens", type=_positive_int, default=64, help="tokens generated per prompt")
    add("--seed", type=int, default=0)
    add("--block-size", type=_positive_int, default=16)
    add("--num-kv-blocks", type=_positive_int, default=None, help="default: enough for the batch")
    add("--max-num-seqs", type=_positive_int, default=64)
    add("--max-num-batched-tokens", type=_positive_int, default=2048)
    add("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    add("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--kv-allocation", choices=ALLOCATION_MODES, default="paged")
    add("--hf-batch-size", type=_positive_int, default=16)
    add("--json", metavar="FILE", default=None, help="also write the config and results here")
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.min_len > args.max_len:
        args._parser.error(f"--min-len ({args.min_len}) is above --max-len ({args.max_len})")
    config = OfflineBenchConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_prompts=args.num_prompts,
        min_len=args.min_len,
        max_len=args.max_len,
        length_dist=args.length_dist,
        max_tokens=args.max_tokens,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.prefix_caching,
        kv_allocation=args.kv_allocation,
        hf_batch_size=args.hf_batch_size,
    )
    result = run_offline_bench(config)
    print(format_summary(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
            f.write("\n")
    return 0
