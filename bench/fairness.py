"""`pagedserve bench fairness`: does one tenant's flood leave another tenant's latency alone?

A local server (`pagedserve serve`, `--num-workers` workers of `--model`, auth on with two
tokens: tenants A and B) is driven over the OpenAI HTTP API (`bench/openai_load.py`) in
three phases:

    B alone      B sends `--short-requests` short requests one after another, each after a
                 random pause of up to `--short-pause-ms` (0: the moment the last one ended)
    A alone      A floods: `--flood` clients, each sending its next long request when its last
                 one ended; A's output tok/s is counted in a window after the ramp
    A + B        the same flood, and B's requests again once the ramp is over; A's tok/s is
                 counted over B's window

and reports B's TTFT p50 alone and under the flood, and A's output tok/s alone and beside B.
The goal (issue 40): B's TTFT p50 under the flood within 3× alone, A's tok/s within 10% of
alone. Each arm is one server: `fair` (the default: `workers/scheduler/fair_share.py`, with
newcomer steps), `fair-no-newcomer` (`engine.fair_share.newcomer_steps: false`: B's prompt is
computed in the flood's step) and `fcfs` (`engine.fair_share.enabled: false`, the order before
fair share), so the table shows what each changes.

B pauses because a request sent the moment the last one ended reaches the worker just after
the flood's next step began (the step that ended it is the one before): it waits out nearly a
whole step, where a request that comes at a time of its own waits half of one on average.

Prompts are windows of real English text (`compare_workload.standard_library_text`) for a
model with a tokenizer, random ids for one without (tiny-llama); every request is greedy with
`ignore_eos`, so each asks for exactly its output length. (Random ids made SmolLM2's first token
a piece of a character 15 times in 20: no text, so no chunk until the next token, and TTFT
counted a second step.)

    $ pagedserve bench fairness --json fairness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.bench.bench_io import exit_on_sigterm, non_negative_float, positive_int

TOKEN_A, TOKEN_B = "bench-tenant-a", "bench-tenant-b"
# Each arm: the engine's `fair_share` section (the rest of the server's config is the default).
ARMS = {
    "fair": {},  # the default: fair share with newcomer steps
    "fair-no-newcomer": {"newcomer_steps": False},  # a newcomer's prompt joins the flood's step
    "fcfs": {"enabled": False},
}
RAMP_S = 3.0  # after the flood starts, before anything is counted
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ArmResult:
    """One arm's figures (ms, tokens per second)."""

    arm: str
    b_ttft_p50_alone_ms: float
    b_ttft_p50_flood_ms: float
    a_tok_s_alone: float
    a_tok_s_beside_b: float
    failures: int
    b_ttfts_alone_ms: tuple[float, ...] = ()  # each of B's requests, in the order sent
    b_ttfts_flood_ms: tuple[float, ...] = ()

    @property
    def ttft_ratio(self) -> float:
        return self.b_ttft_p50_flood_ms / self.b_ttft_p50_alone_ms

    @property
    def tok_s_ratio(self) -> float:
        return self.a_tok_s_beside_b / self.a_tok_s_alone


@dataclass(frozen=True)
class Prompts:
    """Where every request's prompt of `length` tokens comes from: a window of `text_ids` (the
    model's tokens of real text), or random ids where the model has no tokenizer."""

    length: int
    text_ids: tuple[int, ...] | None = None

    @classmethod
    def for_model(cls, model: str, length: int, scratch: Path) -> Prompts:
        from pagedserve.bench.compare import checkpoint_and_tokenizer
        from pagedserve.bench.compare_workload import standard_library_text

        _, tokenizer = checkpoint_and_tokenizer(model, scratch)
        if tokenizer is None:
            return cls(length)
        ids = tuple(tokenizer.encode(standard_library_text()))
        if len(ids) <= length:
            raise ValueError(f"--prompt-tokens {length}: the text has only {len(ids)} tokens")
        return cls(length, ids)

    def draw(self, rng: random.Random) -> tuple[int, ...]:
        if self.text_ids is None:
            return tuple(rng.randrange(1, 256) for _ in range(self.length))
        start = rng.randrange(len(self.text_ids) - self.length)
        return self.text_ids[start : start + self.length]


def planned(index: int, prompts: Prompts, max_tokens: int, rng: random.Random):
    from pagedserve.bench.serve_workload import PlannedRequest

    return PlannedRequest(index, 0.0, prompts.draw(rng), max_tokens)


class Driver:
    """Sends one tenant's requests over one HTTP session (its bearer token); the records of
    everything it sent, times in seconds after the shared `t0`."""

    def __init__(self, base_url: str, model: str, token: str, t0: float) -> None:
        from pagedserve.bench.openai_load import client_session

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.t0 = t0
        self.session = client_session(600.0, {"authorization": f"Bearer {token}"})
        self.records: list = []

    async def send(self, request) -> None:
        from pagedserve.bench.openai_load import send_request

        record = await send_request(self.session, self.url, self.model, request, self.t0)
        self.records.append(record)

    async def close(self) -> None:
        await self.session.close()


async def sequential(
    driver: Driver, count: int, args, prompts: Prompts, rng: random.Random, pauses: random.Random
) -> tuple[float, float]:
    """B's short requests one after another, each after a pause drawn from [0,
    `args.short_pause_ms`] (from `pauses`, so that the prompts drawn from `rng` do not depend on
    it); (first send, last end), seconds after t0."""
    start = time.monotonic() - driver.t0
    for i in range(count):
        await asyncio.sleep(pauses.uniform(0.0, args.short_pause_ms / 1e3))
        await driver.send(planned(i, prompts, args.short_tokens, rng))
    return start, time.monotonic() - driver.t0


async def flood(
    driver: Driver, args, prompts: Prompts, rng: random.Random, stop: asyncio.Event
) -> None:
    """`args.flood` clients of A, each sending its next long request when its last ended (its
    first one shorter, by a random share), until `stop` is set; returns when the last of their
    requests has ended, so that every request's record (its chunks' times) is kept: a request
    cancelled mid-stream would leave no record, and the windows would lose the tokens of
    everything in flight at the end."""

    async def client(k: int) -> None:
        # The first request asks for a random share of the output length, so that the flood's
        # requests end at spread-out times from the start, as a flood that has run for a while
        # does (its requests' ages are spread evenly). Started together with equal lengths, they
        # would end together and be admitted together: A's rate would swing in waves as long as
        # a request (~20 s) and each window would catch a different phase of them.
        max_tokens = rng.randint(1, args.flood_tokens)
        i = 0
        while not stop.is_set():
            await driver.send(planned(k * 1_000_000 + i, prompts, max_tokens, rng))
            max_tokens = args.flood_tokens
            i += 1

    await asyncio.gather(*(client(k) for k in range(args.flood)))


def tokens_in(records, start: float, end: float) -> float:
    """Output tokens whose chunks arrived in [start, end] (a chunk's share of its request's
    tokens: a server may send several tokens in one chunk)."""
    total = 0.0
    for record in records:
        chunks = record.chunk_times_s
        if not chunks:
            continue
        per_chunk = (record.output_tokens or record.max_tokens) / len(chunks)
        total += per_chunk * sum(start <= t <= end for t in chunks)
    return total


def ttfts_ms(records) -> tuple[float, ...]:
    return tuple(r.ttft_s * 1e3 for r in records if r.ok and r.ttft_s is not None)


def p50(values: tuple[float, ...]) -> float:
    return statistics.median(values) if values else float("nan")


async def run_phases(base_url: str, args, prompts: Prompts) -> dict:
    """B alone; then under A's flood, `args.rounds` rounds of (A alone for `window_s`, then B's
    share of its requests): A's tok/s alone and beside B come from alternating windows of the
    same flood, so a drift of the machine's speed falls on both alike."""
    rng, pauses = random.Random(args.seed), random.Random(args.seed + 1)
    t0 = time.monotonic()
    a, b = (Driver(base_url, args.model, token, t0) for token in (TOKEN_A, TOKEN_B))
    try:
        await sequential(b, 3, args, prompts, rng, pauses)  # warm-up: both workers' first steps
        b.records.clear()
        await sequential(b, args.short_requests, args, prompts, rng, pauses)
        b_alone = ttfts_ms(b.records)
        b.records.clear()
        stop = asyncio.Event()
        task = asyncio.create_task(flood(a, args, prompts, rng, stop))
        await asyncio.sleep(RAMP_S)
        alone, beside = [], []
        per_round = -(-args.short_requests // args.rounds)
        for _ in range(args.rounds):
            start = time.monotonic() - t0
            await asyncio.sleep(args.window_s)
            alone.append((start, time.monotonic() - t0))
            beside.append(await sequential(b, per_round, args, prompts, rng, pauses))
        stop.set()
        await task  # A's requests in flight run to their end: their tokens count
        b_flood = ttfts_ms(b.records)
        return {
            "b_ttft_p50_alone_ms": p50(b_alone),
            "b_ttft_p50_flood_ms": p50(b_flood),
            "a_tok_s_alone": rate(a.records, alone),
            "a_tok_s_beside_b": rate(a.records, beside),
            "failures": sum(not r.ok for r in a.records + b.records),
            "b_ttfts_alone_ms": b_alone,
            "b_ttfts_flood_ms": b_flood,
        }
    finally:
        await a.close()
        await b.close()


def rate(records, windows: list[tuple[float, float]]) -> float:
    """Output tokens per second over the windows."""
    tokens = sum(tokens_in(records, start, end) for start, end in windows)
    return tokens / sum(end - start for start, end in windows)


def server_config(args, fair_share: dict) -> dict:
    placement = {}
    for name in ("worker_nice", "control_nice"):  # None: the server's default
        if getattr(args, name) is not None:
            placement[name] = getattr(args, name)
    return {
        "scaling": {"num_workers": args.num_workers},
        "placement": placement,
        "engine": {"model": args.model, "fair_share": fair_share},
        "auth": {"tokens": [TOKEN_A, TOKEN_B]},
    }


def run_arm(arm: str, args, prompts: Prompts, scratch: Path) -> ArmResult:
    import yaml

    from pagedserve.bench.compare_arm import child_env
    from pagedserve.bench.serve_compare_server import Server
    from pagedserve.cluster.ports import free_port

    config_path = scratch / f"{arm}.yaml"
    config_path.write_text(yaml.safe_dump(server_config(args, ARMS[arm])))
    http_port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", "--config", str(config_path)]
    command += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    command += ["--served-model-name", args.model]
    log_path = scratch / f"{arm}.log"
    server = Server(arm, command, child_env({}), str(scratch), http_port, log_path, "/health")
    server.start()
    try:
        print(f"{arm}: started in {server.wait_serving(START_TIMEOUT_S):.0f} s", flush=True)
        figures = asyncio.run(run_phases(server.base_url, args, prompts))
    finally:
        server.stop()
    return ArmResult(arm, **figures)


def table(results: list[ArmResult]) -> str:
    rows = [
        "| arm | B TTFT p50 alone | B TTFT p50 under flood | × | A tok/s alone | "
        "A tok/s beside B | ratio | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.arm} | {r.b_ttft_p50_alone_ms:.0f} ms | {r.b_ttft_p50_flood_ms:.0f} ms | "
            f"{r.ttft_ratio:.1f} | {r.a_tok_s_alone:.0f} | {r.a_tok_s_beside_b:.0f} | "
            f"{r.tok_s_ratio:.2f} | {r.failures} |"
        )
    return "\n".join(rows)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fairness",
        help="one tenant floods, another sends short requests: the second's TTFT and the "
        "first's tok/s, with fair share on and off",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model the workers serve (default: the built-in)")
    add("--num-workers", type=positive_int, default=1)
    add("--arms", default="fair,fcfs", help=f"comma-separated, of: {', '.join(ARMS)}")
    add("--flood", type=positive_int, default=120, help="tenant A's concurrent clients")
    add("--flood-tokens", type=positive_int, default=256, help="output tokens of A's requests")
    add("--short-requests", type=positive_int, default=20, help="tenant B's requests")
    add("--short-tokens", type=positive_int, default=8, help="output tokens of B's requests")
    add(
        "--short-pause-ms",
        type=non_negative_float,
        default=1000.0,
        help="before each of B's requests, a pause drawn from [0, this] (0: back to back, "
        "each arriving just after a step of the flood began)",
    )
    add("--prompt-tokens", type=positive_int, default=32, help="prompt tokens of every request")
    add("--rounds", type=positive_int, default=5, help="alternations of A alone and A + B")
    add("--window-s", type=float, default=4.0, help="seconds of each window of A alone")
    add(
        "--worker-nice",
        type=int,
        default=None,
        help="the workers' niceness (default: the server's)",
    )
    add(
        "--control-nice",
        type=int,
        default=None,
        help="the router's and proxies' niceness (default: the server's, 5: below the workers)",
    )
    add("--seed", type=int, default=0)
    add("--json", default=None, help="write the figures here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        print(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    exit_on_sigterm()  # a stopped bench stops its server
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as scratch:
        try:
            prompts = Prompts.for_model(args.model, args.prompt_tokens, Path(scratch))
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
        results = []
        for arm in arms:
            results.append(run_arm(arm, args, prompts, Path(scratch)))
            print(table(results[-1:]), flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0
