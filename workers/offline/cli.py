"""The offline engine behind `pagedserve generate --offline`: its flags and its run.

`pagedserve.cluster.client_cli` registers the `generate` command and calls `run` here for
`--offline`, so prompts and sampling flags are shared between the cluster and offline paths.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedserve.workers.config_flags import add_config_flags, config_flags_set
from pagedserve.workers.engine.config import EngineConfig


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompts and sampling flags, shared with the cluster's `pagedserve generate`."""
    parser.add_argument("prompts", nargs="*", help="prompts (default: a few built-in ones)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("-n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message (chat template)"
    )


# `--seed` is the sampling seed of `add_sampling_arguments`; `max_waiting` bounds a queue that
# offline generation never has.
ENGINE_FIELDS_WITHOUT_FLAGS = ("seed", "max_waiting")


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags of the engine built in this process: `EngineConfig`'s fields."""
    add_config_flags(parser, EngineConfig, exclude=ENGINE_FIELDS_WITHOUT_FLAGS)


DEFAULT_PROMPTS = ["Paged attention stores the KV cache in blocks", "Hello, world"]


def chat_turns(prompt: str) -> list[dict[str, str]]:
    """A one-turn chat: `prompt` as the user's message."""
    return [{"role": "user", "content": prompt}]


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pagedserve import LLM, SamplingParams
    from pagedserve.workers.model.tokenizer import render_chat

    try:
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(**config_flags_set(args, EngineConfig))
    except ValueError as error:
        print(f"pagedserve generate: error: {error}", file=sys.stderr)
        return 2
    prompts = args.prompts or DEFAULT_PROMPTS
    try:
        inputs = (
            [render_chat(llm.get_tokenizer(), chat_turns(p)) for p in prompts]
            if args.chat
            else prompts
        )
    except ValueError as error:
        print(f"pagedserve generate: error: {error}", file=sys.stderr)
        return 2
    outputs = llm.generate(inputs, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        if args.json:
            print(json.dumps(asdict(output), default=str))
            continue
        print(f"prompt: {prompt!r}")
        if output.error:
            print(f"  error: {output.error}")
        for completion in output.outputs:
            print(
                f"  [{completion.index}] {completion.text!r} ({completion.finish_reason}, "
                f"{len(completion.token_ids)} tokens)"
            )
        m = output.metrics
        if m.ttft is not None:
            print(
                f"  ttft {m.ttft * 1000:.1f} ms, e2e {m.e2e * 1000:.1f} ms, "
                f"cached prompt tokens {output.num_cached_tokens}"
            )
    usage = llm.stats()
    print(
        f"KV pool: {usage.total_blocks} blocks of {usage.block_size} tokens, "
        f"prefix hits {usage.prefix_hits_tokens}/{usage.prefix_queries_tokens} tokens"
    )
    return 1 if any(o.error for o in outputs) else 0
