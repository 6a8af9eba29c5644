"""What one run of `pagedserve bench offline` was given and produced, and how it is shown.

Throughput on both sides counts the same numerator, the useful tokens sum(max_tokens_i): the HF
tokens a static batch generates past a request's target are computed but not counted (they are
reported separately, as HF's raw generated tokens, to show the waste).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

UTILIZATION_GOAL = 0.96


@dataclass(frozen=True)
class OfflineBenchConfig:
    """One run's settings, as given on the command line (``num_kv_blocks`` None: sized to fit,
    or from ``kv_cache_bytes`` when that is given)."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    num_prompts: int = 64
    min_len: int = 16
    max_len: int = 256
    length_dist: str = "uniform"
    output_len_dist: str = "uniform"
    min_tokens: int = 8
    max_tokens: int = 128
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    hf_batch_size: int = 16
    hf_sort_by_length: bool = False
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class SideResult:
    """One side's throughput over wall time (prefill included).

    ``useful_tokens`` is sum(max_tokens_i) on both sides; ``generated_tokens`` is what the side
    computed, which for HF's static batches includes tokens past each request's target.
    """

    name: str
    useful_tokens: int
    generated_tokens: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.elapsed_s

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "generated_tokens_per_s": self.generated_tokens_per_s,
        }


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
    """How far the greedy tokens of both sides agree, each request over its own target length.

    Reported, never asserted.
    """

    prompts_equal: int
    num_prompts: int
    fraction_equal: float
    mean_common_prefix: float  # mean over requests of (tokens before the first difference) / N_i


def agreement(
    ours: Sequence[list[int]], hf: Sequence[list[int]], output_lens: Sequence[int]
) -> Agreement:
    """Requests whose first ``output_lens[i]`` greedy tokens are equal on both sides, and the mean
    fraction of those tokens before the first difference."""
    equal = 0
    prefixes = []
    for a, b, target in zip(ours, hf, output_lens, strict=True):
        a, b = a[:target], b[:target]
        equal += a == b
        pairs = zip(a, b, strict=False)
        common = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
        prefixes.append(common / target)
    return Agreement(equal, len(ours), equal / len(ours), sum(prefixes) / len(prefixes))


@dataclass(frozen=True)
class OfflineBenchResult:
    config: OfflineBenchConfig
    model_name: str
    num_kv_blocks: int
    prompt_lens: list[int]
    output_lens: list[int]  # max_tokens_i, constructed
    ours: SideResult
    hf: SideResult
    kv: KVUtilization
    agreement: Agreement
    # Tensor parallelism: rank 0's wall seconds inside all-reduces/gathers during the run.
    collective_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Ours / HF in useful tokens/s."""
        return self.ours.tokens_per_s / self.hf.tokens_per_s

    @property
    def hf_waste(self) -> float:
        """Fraction of HF's generated tokens that lie past their request's target."""
        return 1.0 - self.hf.useful_tokens / self.hf.generated_tokens

    def to_json(self) -> dict[str, Any]:
        report = asdict(self)
        report["ours"], report["hf"] = self.ours.to_json(), self.hf.to_json()
        report["ratio"] = self.ratio
        report["hf_waste"] = self.hf_waste
        report["workload"] = {
            "lengths_constructed": True,
            "prompt": _length_stats(self.prompt_lens, self.config.length_dist),
            "output": _length_stats(self.output_lens, self.config.output_len_dist),
        }
        report["hf_batching"] = _hf_batching(self.config)
        report["kv"]["goal"] = UTILIZATION_GOAL
        return report


def _length_stats(lens: Sequence[int], distribution: str) -> dict[str, Any]:
    return {
        "distribution": distribution,
        "min": min(lens),
        "mean": sum(lens) / len(lens),
        "max": max(lens),
        "total": sum(lens),
    }


def _hf_batching(config: OfflineBenchConfig) -> str:
    return "sorted by prompt length" if config.hf_sort_by_length else "prompt order"


def _describe(lens: Sequence[int]) -> str:
    return f"min {min(lens)}, mean {sum(lens) / len(lens):.1f}, max {max(lens)}"


def format_summary(result: OfflineBenchResult) -> str:
    """A Markdown summary of the run."""
    c, kv, agree = result.config, result.kv, result.agreement
    caching = "on" if c.enable_prefix_caching else "off"
    goal = "meets" if kv.step_weighted >= UTILIZATION_GOAL else "below"
    output_range = (
        f"all {c.max_tokens}"
        if c.output_len_dist == "fixed"
        else f"in [{c.min_tokens}, {c.max_tokens}]"
    )
    lines = [
        "# pagedserve bench offline",
        "",
        f"model {result.model_name} ({c.dtype}, {c.device}); {c.num_prompts} prompts of random "
        f"token ids, lengths CONSTRUCTED ({c.length_dist} in [{c.min_len}, {c.max_len}], seed "
        f"{c.seed}: {_describe(result.prompt_lens)}).",
        f"output targets max_tokens_i CONSTRUCTED per request ({c.output_len_dist} "
        f"{output_range}, seed {c.seed}: {_describe(result.output_lens)}; "
        f"{sum(result.output_lens)} in all); greedy, EOS ignored on both sides.",
        f"ours: B={c.block_size}, {result.num_kv_blocks} KV blocks (KV {c.kv_cache_dtype}), "
        f"{c.kv_allocation}, "
        f"max_num_seqs {c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, "
        f"attention {c.attention_backend}, prefix caching {caching}, tensor parallel "
        f"{c.tensor_parallel_size}; each request stops at its own target.",
        f"HF: static left-padded batches of {c.hf_batch_size}, {_hf_batching(c)}; each batch "
        "generates its longest target, the first max_tokens_i tokens of each row count.",
        "",
        "| side | useful tokens | generated tokens | wall s | useful tok/s | generated tok/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side in (result.ours, result.hf):
        lines.append(
            f"| {side.name} | {side.useful_tokens} | {side.generated_tokens} | "
            f"{side.elapsed_s:.2f} | {side.tokens_per_s:.1f} | {side.generated_tokens_per_s:.1f} |"
        )
    if c.tensor_parallel_size > 1:
        share = result.collective_s / result.ours.elapsed_s
        lines += [
            "",
            f"tensor parallel {c.tensor_parallel_size}: rank 0 spent {result.collective_s:.2f} s "
            f"({share:.0%} of its wall time) in all-reduces and the LM-head gather, waiting for "
            "its peers included",
        ]
    lines += [
        "",
        f"ratio ours/HF (useful tokens/s): {result.ratio:.2f}x",
        f"HF output waste: {result.hf.generated_tokens - result.hf.useful_tokens} of "
        f"{result.hf.generated_tokens} generated tokens ({result.hf_waste:.1%}) lie past their "
        "request's target",
        f"KV utilization (useful / allocated positions, sampled after each of {kv.num_samples} "
        f"steps): step-weighted {kv.step_weighted:.2%}, time-weighted {kv.time_weighted:.2%}, "
        f"lowest sample {kv.min_sample:.2%}; goal {UTILIZATION_GOAL:.0%} (step-weighted): {goal}",
        f"peak: {kv.peak_running_seqs} running sequences, {kv.peak_used_blocks} of "
        f"{kv.total_blocks} blocks ({kv.peak_allocated_positions} positions)",
        f"greedy agreement: {agree.prompts_equal}/{agree.num_prompts} prompts equal over their "
        f"targets ({agree.fraction_equal:.1%}); mean common prefix {agree.mean_common_prefix:.1%} "
        "of each target",
    ]
    return "\n".join(lines)
