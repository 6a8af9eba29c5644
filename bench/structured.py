"""`pagedserve bench structured`: the cost of a JSON schema on a batch.

Two arms over the same batch of `--batch` chat prompts, `--max-tokens` output tokens each,
greedy: `free` (no grammar) and `schema` (a JSON schema of six fields, compiled before the timed
runs, so every timed run hits the cache). Per arm: output tokens/s over the run's wall time;
for `schema` also the time the engine spent building and applying the token masks per step
(`workers/structured/masking.py`), and whether every output validates as JSON. Compile time:
a schema never seen (a fresh property name makes it new) against the same schema again (the
cache). Arms alternate within each repeat; figures are the median over `--repeats` runs.

    $ pagedserve bench structured --batch 32 --repeats 3 --json structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedserve.bench.bench_io import positive_int, write_json

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "mayor": {"type": ["string", "null"], "maxLength": 24},
    },
    "required": ["city", "country", "population", "capital", "districts", "mayor"],
}
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Quebec", "Perth", "Bergen", "Cusco"]


class MaskTimer:
    """Wraps the sampler's mask step to add up its time and count its calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self) -> MaskTimer:
        from pagedserve.workers.sampling import sampler

        self._module, self._original = sampler, sampler.apply_token_constraints

        def timed(logits, rows, backend):
            start = time.perf_counter()
            self._original(logits, rows, backend)
            self.seconds += time.perf_counter() - start
            self.calls += 1

        sampler.apply_token_constraints = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self._module.apply_token_constraints = self._original


def prompts_for(llm: Any, batch: int) -> list[str]:
    from pagedserve.workers.model.tokenizer import render_chat

    tokenizer = llm.get_tokenizer()
    texts = [f"Describe {CITIES[i % len(CITIES)]} as a JSON object." for i in range(batch)]
    if getattr(tokenizer, "has_chat_template", False):
        return [render_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return texts


def run_arm(llm: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    with MaskTimer() as masks:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "mask_ms_per_step": 1e3 * masks.seconds / masks.calls if masks.calls else 0.0,
        "valid_json": sum(_is_json(t) for t in texts),
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def compile_times(llm: Any) -> dict[str, float]:
    """Milliseconds to compile a schema never seen, and the same schema again (cached)."""
    from pagedserve.workers.protocol.guided import GuidedSpec

    compiler = llm.engine.guided.compiler
    # A property name never used before: a new grammar (a new description would not be).
    fresh_name = f"field_{time.time_ns()}"
    properties = {**SCHEMA["properties"], fresh_name: {"type": "integer"}}
    fresh = GuidedSpec.json_schema({**SCHEMA, "properties": properties})
    start = time.perf_counter()
    compiler.compile_now(fresh)
    new_ms = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile_now(fresh)
    return {"new_ms": new_ms, "cached_ms": 1e3 * (time.perf_counter() - start)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.workers.protocol.guided import GuidedSpec

    llm = LLM(args.model, max_num_seqs=max(args.batch, 1))
    prompts = prompts_for(llm, args.batch)
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    schema = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, guided=GuidedSpec.json_schema(SCHEMA)
    )
    arms = {"free": free, "schema": schema}
    llm.generate(prompts[:2], schema)  # compiles the schema: every timed run hits the cache
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, params in arms.items():
            runs[name].append(run_arm(llm, prompts, params))
    summary = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    cost = 1 - summary["schema"]["tokens_per_s"] / summary["free"]["tokens_per_s"]
    return {
        "model": args.model,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "arms": summary,
        "tokens_per_s_cost": cost,
        "compile": compile_times(llm),
    }


def format_text(data: dict[str, Any]) -> str:
    free, schema = data["arms"]["free"], data["arms"]["schema"]
    return "\n".join(
        [
            f"bench structured: {data['model']}, batch {data['batch']}, "
            f"{data['max_tokens']} tokens, median of {data['repeats']}",
            f"  free    {free['tokens_per_s']:8.1f} tok/s",
            f"  schema  {schema['tokens_per_s']:8.1f} tok/s  "
            f"({100 * data['tokens_per_s_cost']:.1f}% cost), "
            f"masks {schema['mask_ms_per_step']:.2f} ms/step, "
            f"{schema['valid_json']:.0f}/{data['batch']} valid JSON",
            f"  compile: new schema {data['compile']['new_ms']:.1f} ms, "
            f"cached {data['compile']['cached_ms']:.3f} ms",
        ]
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "structured",
        help="a batch with and without a JSON schema: tok/s, mask time, compile time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="the model (default: smollm2-135m)")
    add("--batch", type=positive_int, default=32, help="requests in the batch")
    add("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    add("--repeats", type=positive_int, default=3, help="timed runs per arm")
    add("--json", metavar="FILE", default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = bench(args)
    print(format_text(data))
    if args.json:
        write_json(args.json, data)
    return 0
