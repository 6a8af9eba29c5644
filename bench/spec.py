"""`pagedserve bench spec`: the same prompts with and without speculative decoding.

Arms: `off`, `ngram` (prompt lookup, k = `--num-tokens`) and, where a draft exists, `draft`
(for `tiny-llama`: the target cut to its first 2 layers, built into a temporary directory; for
another model, `--draft-model`). Two workloads of `--num-prompts` prompts each:

repetitive      the prompt quotes a passage and asks for it back (edit / copy tasks, where
                prompt lookup hits); for tiny-llama (random weights) the passage is quoted twice
non-repetitive  open-ended prompts (nothing to look up)

Requests run one at a time (the low-load case, where batching cannot help TPOT and
speculation can). Per run: output tokens/s over the run's wall time, TPOT p50/p99 over its
requests, acceptance rate and mean accepted length. Arms alternate within each repeat; every
figure is the median over `--repeats` runs with the min-max spread beside it. Greedy outputs
of every arm are compared with the `off` arm's (they must be equal).

    $ pagedserve bench spec --repeats 3 --json spec.json --markdown spec.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from pagedserve.bench.bench_io import positive_int, report

PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion it agreed "
    "to fund the new library, to repair the bridge on Mill Street, and to postpone the park.",
    "To install the tool, download the archive, unpack it into your home directory, add the "
    "bin folder to your PATH, and run the setup command once before the first use.",
    "Paged attention stores the key and value cache in fixed-size blocks, so memory is "
    "allocated as sequences grow and blocks with equal prefixes can be shared.",
    "The river rose quickly after the storm. By morning the lower fields were flooded, the "
    "road to the village was closed, and the ferry had stopped running.",
]
OPEN_PROMPTS = [
    "Write a short poem about the sea at night.",
    "Give three ideas for a birthday party for a ten-year-old.",
    "Explain why the sky is blue to a child.",
    "Describe your ideal weekend in a few sentences.",
]


def workloads(model: str, tokenizer: Any, num_prompts: int) -> dict[str, list[Any]]:
    """Prompts per workload: chat-formatted text for a real model, token ids for tiny-llama."""
    if model == "tiny-llama":
        rng = random.Random(0)
        repetitive, other = [], []
        for _ in range(num_prompts):
            passage = [rng.randrange(256) for _ in range(48)]
            repetitive.append(passage + passage[:24])
            other.append([rng.randrange(256) for _ in range(72)])
        return {"repetitive": repetitive, "non-repetitive": other}
    copy = [f"Repeat this text exactly, then stop:\n\n{p}" for p in PASSAGES]
    return {
        "repetitive": [_chat(tokenizer, copy[i % len(copy)]) for i in range(num_prompts)],
        "non-repetitive": [
            _chat(tokenizer, OPEN_PROMPTS[i % len(OPEN_PROMPTS)]) for i in range(num_prompts)
        ],
    }


def _chat(tokenizer: Any, text: str) -> str:
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        return text
    return apply([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def run_arm(llm: Any, prompts: list[Any], params: Any) -> dict[str, Any]:
    """Every prompt alone, one after another; the run's figures and outputs."""
    start = time.perf_counter()
    spec_before = llm.engine.spec_stats()
    outputs = [llm.generate([p], params)[0] for p in prompts]
    wall = time.perf_counter() - start
    spec = llm.engine.spec_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = sorted(o.metrics.tpot for o in outputs if o.metrics and o.metrics.tpot is not None)
    drafts = spec.num_draft_tokens - spec_before.num_draft_tokens
    verified = spec.num_verified - spec_before.num_verified
    return {
        "tokens_per_s": tokens / wall,
        "tpot_p50_ms": 1e3 * _quantile(tpots, 0.5),
        "tpot_p99_ms": 1e3 * _quantile(tpots, 0.99),
        "acceptance_rate": (
            (spec.num_accepted_tokens - spec_before.num_accepted_tokens) / drafts if drafts else 0
        ),
        "mean_accepted_length": (
            (spec.num_emitted_tokens - spec_before.num_emitted_tokens) / verified
            if verified
            else 1.0
        ),
        "wall_s": wall,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.workers.model.loader import load_model
    from pagedserve.workers.model.tiny_llama import save_truncated_tiny_llama
    from pagedserve.workers.offline.llm import LLM
    from pagedserve.workers.protocol.sampling import SamplingParams

    loaded = load_model(args.model)
    tmp = tempfile.TemporaryDirectory(prefix="pagedserve-spec-draft-")
    draft = args.draft_model
    if draft is None and args.model == "tiny-llama":
        draft = save_truncated_tiny_llama(tmp.name)
    arms: dict[str, dict | None] = {
        "off": None,
        "ngram": {"method": "ngram", "num_tokens": args.num_tokens},
    }
    if draft is not None:
        arms["draft"] = {"method": "draft", "num_tokens": args.num_tokens, "draft_model": draft}
    engines = {
        name: LLM(
            loaded_model=loaded, model=args.model, speculative=spec, max_model_len=args.max_len
        )
        for name, spec in arms.items()
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = workloads(args.model, loaded.tokenizer, args.num_prompts)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {a: [] for a in arms} for w in prompts}
    for llm in engines.values():  # untimed warm-up
        run_arm(llm, prompts["repetitive"][:1], SamplingParams(max_tokens=4, temperature=0.0))
    for repeat in range(args.repeats):
        order = list(arms) if repeat % 2 == 0 else list(reversed(arms))  # arms alternated
        for workload, batch in prompts.items():
            for name in order:
                runs[workload][name].append(run_arm(engines[name], batch, params))
    tmp.cleanup()
    return {"model": args.model, "draft_model": draft, "arms": arms, "summary": summarize(runs)}


METRICS = ("tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "acceptance_rate", "mean_accepted_length")


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload, arms in runs.items():
        baseline = arms["off"][0]["outputs"]
        summary[workload] = {}
        for name, arm_runs in arms.items():
            row = {"runs": len(arm_runs)}
            for metric in METRICS:
                values = [r[metric] for r in arm_runs]
                row[metric] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
            row["outputs_equal_off"] = all(r["outputs"] == baseline for r in arm_runs)
            summary[workload][name] = row
        off = summary[workload]["off"]["tokens_per_s"]["median"]
        for row in summary[workload].values():
            row["speedup"] = row["tokens_per_s"]["median"] / off
    return summary


def format_markdown(data: dict[str, Any]) -> str:
    lines = [
        f"model `{data['model']}`, draft `{data['draft_model']}`",
        "",
        "| workload | arm | tok/s (median, min-max) | speedup | TPOT p50 ms | TPOT p99 ms |"
        " acceptance | mean accepted length | outputs = off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workload, arms in data["summary"].items():
        for name, row in arms.items():
            t, p50, p99 = row["tokens_per_s"], row["tpot_p50_ms"], row["tpot_p99_ms"]
            lines.append(
                f"| {workload} | {name} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) |"
                f" {row['speedup']:.2f} | {p50['median']:.1f} ({p50['min']:.1f}-{p50['max']:.1f})"
                f" | {p99['median']:.1f} | {row['acceptance_rate']['median']:.2f} |"
                f" {row['mean_accepted_length']['median']:.2f} | {row['outputs_equal_off']} |"
            )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec",
        help="speculative decoding on and off (ngram, draft): tok/s, TPOT, acceptance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="the target (default: smollm2-135m)")
    add("--draft-model", default=None, help="draft arm's model (tiny-llama: its 2-layer cut)")
    add("--num-tokens", type=positive_int, default=3, help="k, draft tokens per step")
    add("--num-prompts", type=positive_int, default=4, help="prompts per workload")
    add("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    add("--max-len", type=positive_int, default=1024, help="max_model_len of every arm")
    add("--repeats", type=positive_int, default=3, help="timed runs per arm and workload")
    add("--json", metavar="FILE", default=None)
    add("--markdown", metavar="FILE", default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = bench(args)
    report(data, format_markdown(data), args.json, args.markdown)
    return 0
