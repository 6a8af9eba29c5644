"""`pagedserve bench kv-dtype`: what an 8-bit KV cache costs in accuracy on a real model.

Engines over the same weights, one with the model-dtype KV cache (the reference) and one per
`kv_cache_dtype` measured (int8 by default; several in one run share the reference's pass),
run the same held-out prompts (windows of real English text, `compare_workload.text_prompts`;
8-bit scales are computed at write time, so no text was ever used to calibrate them):

- greedy agreement: the share of prompts whose first `--max-tokens` greedy tokens are equal;
- |Δ logprob|: the log-probability of each of the reference's continuation tokens under the
  reference cache (reported as it generated them) and under the 8-bit cache (teacher forcing:
  prompt logprobs over prompt + continuation, every position computed, none from a prefix
  cache), compared position by position: max and mean over every continuation token.

    $ pagedserve bench kv-dtype --num-prompts 64 --max-tokens 32 --kv-dtype int8 fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from pagedserve.bench.bench_io import positive_int

KV_DTYPES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class KVDtypeAccuracy:
    """The figures of one run (all exact counts or plain floats)."""

    model: str
    kv_dtype: str
    reference_kv_dtype: str
    backend: str
    num_prompts: int
    prompt_lens: tuple[int, int, float]  # min, max, mean
    max_tokens: int
    prompts_agreeing: int
    mean_agreeing_prefix: float  # tokens equal before the first difference, per prompt
    scored_tokens: int
    max_abs_dlogprob: float
    mean_abs_dlogprob: float
    seconds: float  # the 8-bit cache's passes (generate, then score)

    @property
    def agreement(self) -> float:
        return self.prompts_agreeing / self.num_prompts


def _engine(loaded, kv_dtype: str, backend: str, blocks: int):
    from pagedserve import LLM

    return LLM(
        loaded_model=loaded,
        kv_cache_dtype=kv_dtype,
        attention_backend=backend,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,  # every position scored, none read from a cache
    )


def _continuations(llm, prompts, max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuations and the log-probability of each of their tokens."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = [out.outputs[0] for out in llm.generate(prompts, params)]
    tokens = [list(out.token_ids) for out in outputs]
    return tokens, [[entry.logprob for entry in out.logprobs] for out in outputs]


def _scores(llm, prompts, continuations) -> list[list[float]]:
    """Log-probabilities of each continuation's tokens after its prompt (teacher forcing)."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    texts = [p + c for p, c in zip(prompts, continuations, strict=True)]
    outputs = llm.generate(texts, params)
    scores = []
    for out, cont in zip(outputs, continuations, strict=True):
        tail = out.prompt_logprobs[-len(cont) :]
        scores.append([entry.logprob for entry in tail])
    return scores


def _progress(what: str) -> None:
    print(f"[bench kv-dtype] {what}", file=sys.stderr, flush=True)


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return index
    return len(a)


def measure(args: argparse.Namespace) -> list[KVDtypeAccuracy]:
    """Run the reference engine, then each KV dtype's, over the prompts; one report each."""
    from pagedserve.bench.compare_workload import text_prompts
    from pagedserve.workers.model.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype)
    prompts = text_prompts(
        loaded.tokenizer.encode, args.num_prompts, args.min_len, args.max_len, args.seed
    )
    blocks = sum(-(-(len(p) + args.max_tokens + 1) // 16) for p in prompts) + 8
    reference = _engine(loaded, "auto", args.backend, blocks)
    _progress(f"{len(prompts)} prompts: the reference cache generates")
    ref_tokens, ref_scores = _continuations(reference, prompts, args.max_tokens)
    backend = reference.engine.kv_cache.ops.name
    del reference  # its pool: one engine's pool alive at a time
    kv_dtypes = [args.kv_dtype] if isinstance(args.kv_dtype, str) else args.kv_dtype
    return [
        _measure_one(loaded, kv_dtype, backend, blocks, prompts, ref_tokens, ref_scores, args)
        for kv_dtype in kv_dtypes
    ]


def _measure_one(
    loaded, kv_dtype, backend, blocks, prompts, ref_tokens, ref_scores, args
) -> KVDtypeAccuracy:
    """One 8-bit cache's greedy agreement and |Δ logprob| against the reference's run."""
    start = time.perf_counter()
    quantised = _engine(loaded, kv_dtype, args.backend, blocks)
    _progress(f"the {kv_dtype} cache generates")
    q_tokens, _ = _continuations(quantised, prompts, args.max_tokens)
    _progress(f"the {kv_dtype} cache scores the reference's continuations")
    q_scores = _scores(quantised, prompts, ref_tokens)
    deltas = [
        abs(a - b)
        for ra, qa in zip(ref_scores, q_scores, strict=True)
        for a, b in zip(ra, qa, strict=True)
    ]
    prefixes = [_agreeing_prefix(a, b) for a, b in zip(ref_tokens, q_tokens, strict=True)]
    lens = [len(p) for p in prompts]
    return KVDtypeAccuracy(
        model=loaded.name,
        kv_dtype=kv_dtype,
        reference_kv_dtype=str(loaded.dtype).removeprefix("torch."),
        backend=backend,
        num_prompts=len(prompts),
        prompt_lens=(min(lens), max(lens), sum(lens) / len(lens)),
        max_tokens=args.max_tokens,
        prompts_agreeing=sum(a == b for a, b in zip(ref_tokens, q_tokens, strict=True)),
        mean_agreeing_prefix=sum(prefixes) / len(prefixes),
        scored_tokens=len(deltas),
        max_abs_dlogprob=max(deltas),
        mean_abs_dlogprob=sum(deltas) / len(deltas),
        seconds=time.perf_counter() - start,
    )


def format_report(result: KVDtypeAccuracy) -> str:
    lo, hi, mean = result.prompt_lens
    return "\n".join(
        [
            f"model {result.model}, KV {result.kv_dtype} vs {result.reference_kv_dtype} "
            f"(attention backend {result.backend})",
            f"{result.num_prompts} held-out prompts of real text, {lo}-{hi} tokens "
            f"(mean {mean:.0f}), {result.max_tokens} greedy tokens each",
            f"greedy agreement: {result.prompts_agreeing}/{result.num_prompts} prompts "
            f"({100 * result.agreement:.1f}%) equal in all {result.max_tokens} tokens; "
            f"mean equal prefix {result.mean_agreeing_prefix:.1f} tokens",
            f"|Δ logprob| of the reference's tokens over {result.scored_tokens} positions: "
            f"max {result.max_abs_dlogprob:.4f}, mean {result.mean_abs_dlogprob:.5f}",
            f"({result.seconds:.0f} s for the {result.kv_dtype} cache's two passes)",
        ]
    )


def run(args: argparse.Namespace) -> int:
    results = measure(args)
    if args.json:
        print(json.dumps([asdict(r) | {"agreement": r.agreement} for r in results], indent=2))
    else:
        print("\n\n".join(format_report(r) for r in results))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kv-dtype",
        help="accuracy of an 8-bit KV cache against the model-dtype one on a real model",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model (default: the built-in SmolLM2-135M)")
    add("--dtype", default="float32", help="weights and reference KV dtype (default: float32)")
    add(
        "--kv-dtype",
        choices=KV_DTYPES,
        nargs="+",
        default=["int8"],
        help="the KV dtypes measured, each against the same reference run (default: int8)",
    )
    add("--backend", default="auto", help="attention backend of both engines (default: auto)")
    add("--num-prompts", type=positive_int, default=64, help="held-out prompts (default: 64)")
    add("--max-tokens", type=positive_int, default=32, help="greedy tokens per prompt (32)")
    add("--min-len", type=positive_int, default=64, help="shortest prompt in tokens (64)")
    add("--max-len", type=positive_int, default=1024, help="longest prompt in tokens (1024)")
    add("--seed", type=int, default=1, help="which windows of the text (default: 1)")
    add("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)
