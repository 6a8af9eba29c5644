"""`pagedserve generate` and `pagedserve status`: the command-line clients of a running cluster.

    pagedserve generate "Paged attention" --stream --max-tokens 64   # tokens as they arrive
    pagedserve generate "Hello" --offline                            # one engine, no cluster
    pagedserve status                                                # workers, KV use, hit rates

Both talk to Serve's gRPC proxy (`--address`, default localhost:9000); `--token` (or the
`PAGEDSERVE_TOKEN` environment variable) is sent as the bearer token when auth is on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TypedDict

from pagedserve.workers.offline import cli as offline_cli
from pagedserve.workers.protocol.sampling import SamplingKwargs

TOKEN_ENV = "PAGEDSERVE_TOKEN"


class PromptKwargs(TypedDict, total=False):
    """The prompt of a `Client.generate` call: one of the two keys."""

    prompt: str
    messages: list[dict[str, str]]  # a chat the server renders by its chat template


def register(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser(
        "generate",
        help="generate text on a running cluster (or offline with --offline)",
        description="Generate text on a running pagedserve cluster (`pagedserve serve`), "
        "or with one engine in this process (--offline).",
    )
    offline_cli.add_sampling_arguments(generate)
    _add_connection_arguments(generate)
    generate.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    generate.add_argument("--offline", action="store_true", help="no cluster: one local engine")
    offline_cli.add_engine_arguments(generate.add_argument_group("offline engine (--offline)"))
    generate.set_defaults(func=run_generate)

    status = subparsers.add_parser(
        "status", help="workers, KV usage and prefix hit rates of a running cluster"
    )
    _add_connection_arguments(status)
    status.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    status.set_defaults(func=run_status)


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default="localhost:9000", help="the cluster's gRPC address (host:port)"
    )
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default: ${TOKEN_ENV})"
    )
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


# ------------------------------------------------------------------ generate
def run_generate(args: argparse.Namespace) -> int:
    if args.offline:
        return offline_cli.run(args)
    import grpc

    from pagedserve.cluster.client import Client

    sampling = SamplingKwargs(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompts or offline_cli.DEFAULT_PROMPTS
    try:
        with Client(args.address, token=args.token, timeout=args.timeout) as client:
            for prompt in prompts:
                request = _request_of(prompt, args.chat)
                if args.stream:
                    _stream_one(client, request, sampling, args.json)
                else:
                    _generate_one(client, request, sampling, args.json)
    except grpc.RpcError as error:
        return _report_rpc_error("generate", args.address, error)
    except KeyboardInterrupt:  # the stream's call was cancelled on the way out
        return 130
    return 0


def _request_of(prompt: str, chat: bool) -> PromptKwargs:
    """The prompt, or with `--chat` a one-turn chat the server renders by its chat template."""
    if chat:
        return PromptKwargs(messages=offline_cli.chat_turns(prompt))
    return PromptKwargs(prompt=prompt)


def _generate_one(
    client: Any, request: PromptKwargs, sampling: SamplingKwargs, as_json: bool
) -> None:
    response = client.generate(**request, **sampling)
    if as_json:
        print(_to_json(response))
        return
    prompt = request.get("prompt") or request["messages"][-1]["content"]
    print(f"prompt: {prompt!r}")
    for completion in response.completions:
        print(
            f"  [{completion.index}] {completion.text!r} "
            f"({completion.finish_reason}, {len(completion.token_ids)} tokens)"
        )
    print(f"  {_usage_line(response.usage, response.metrics, response.worker_id)}")


def _stream_one(
    client: Any, request: PromptKwargs, sampling: SamplingKwargs, as_json: bool
) -> None:
    """Text to stdout as it arrives (branches marked `[j]` when n > 1); the summary to stderr."""
    multi = sampling["n"] > 1
    current = None
    for delta in client.generate_stream(**request, **sampling):
        if as_json:
            print(_to_json(delta), flush=True)
            continue
        if multi and delta.index != current:
            sys.stdout.write(f"\n[{delta.index}] " if current is not None else f"[{delta.index}] ")
            current = delta.index
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.finish_reason and not multi:
            sys.stdout.write("\n")
            print(_usage_line(delta.usage, delta.metrics, delta.worker_id), file=sys.stderr)
    if multi and not as_json:
        sys.stdout.write("\n")


def _usage_line(usage: Any, metrics: Any, worker_id: str) -> str:
    return (
        f"usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens "
        f"({usage.cached_tokens} cached); ttft {metrics.ttft_s * 1000:.1f} ms, "
        f"e2e {metrics.e2e_s * 1000:.1f} ms; {worker_id}"
    )


# -------------------------------------------------------------------- status
def run_status(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.cluster.client import Client

    try:
        with Client(args.address, token=args.token, timeout=args.timeout) as client:
            stats = client.stats()
    except grpc.RpcError as error:
        return _report_rpc_error("status", args.address, error)
    print(_to_json(stats) if args.json else format_status(stats))
    return 0


STATUS_COLUMNS = (
    ("worker", "<"),
    ("alive", "<"),
    ("inflight", ">"),
    ("waiting", ">"),
    ("running", ">"),
    ("used/total blocks", ">"),
    ("cached", ">"),
    ("KV used", ">"),
    ("prefix hit rate", ">"),
)


def format_status(stats: Any) -> str:
    """The stats as a table: one row per worker, then the cluster's totals."""
    rows = [
        _status_row(w.worker_id, w.alive, w.inflight, w, w.kv, w.prefix_hit_rate)
        for w in stats.workers
    ]
    inflight = sum(w.inflight for w in stats.workers if w.alive)
    alive = f"{stats.num_alive_workers}/{len(stats.workers)}"
    rows.append(_status_row("cluster", alive, inflight, stats, stats.kv, stats.prefix_hit_rate))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _) in enumerate(STATUS_COLUMNS)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            f"{cell:{align}{width}}"
            for cell, (_, align), width in zip(cells, STATUS_COLUMNS, widths, strict=True)
        )

    table = [line([h for h, _ in STATUS_COLUMNS]), *(line(r) for r in rows)]
    m = stats.migrations
    table.append(
        f"routing: {stats.routing_policy}; prefix index: {stats.index.entries} blocks; "
        f"migrations: {m.pulls} pulls ({m.pulled_blocks} blocks), "
        f"{m.pushes} pushes ({m.pushed_blocks} blocks), {m.moves} moves"
    )
    loras = [
        f"{w.worker_id}: "
        + ", ".join(f"{n} (resident)" if n in w.resident_loras else n for n in w.lora_adapters)
        for w in stats.workers
        if w.lora_adapters
    ]
    if loras:
        table.append(f"LoRA adapters: {'; '.join(loras)}")
    return "\n".join(table)


def _status_row(
    name: str, alive: Any, inflight: int, queues: Any, kv: Any, hit_rate: float
) -> list[str]:
    used_fraction = kv.used_blocks / kv.total_blocks if kv.total_blocks else 0.0
    alive_text = alive if isinstance(alive, str) else ("yes" if alive else "NO")
    return [
        name,
        alive_text,
        str(inflight),
        str(queues.num_waiting),
        str(queues.num_running),
        f"{kv.used_blocks}/{kv.total_blocks}",
        str(kv.cached_free_blocks),
        f"{used_fraction:.1%}",
        f"{hit_rate:.1%}",
    ]


# ------------------------------------------------------------------- helpers
def _report_rpc_error(command: str, address: str, error: Any) -> int:
    code = error.code()
    print(f"pagedserve {command}: error: {code.name}: {error.details()}", file=sys.stderr)
    if code.name == "UNAVAILABLE" and "connect" in (error.details() or "").lower():
        print(f"  is `pagedserve serve` running at {address}?", file=sys.stderr)
    return 1


def _to_json(message: Any) -> str:
    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(message, preserving_proto_field_name=True))
