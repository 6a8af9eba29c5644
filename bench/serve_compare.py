"""`pagedserve bench serve-compare`: our server beside vLLM's OpenAI server, over HTTP.

`bench compare` times the engines offline; this times the servers as a user meets them. One
client (`openai_load`: aiohttp, streamed ``/v1/completions``) sends the same workload to each:
``--num-requests`` prompts of real text as token ids (random ids for ``tiny-llama``), lengths
uniform in [``--min-input-len``, ``--max-input-len``], arriving as a seeded Poisson process at
``--request-rate``, each asking for exactly ``--output-len`` greedy tokens (``ignore_eos``).

One server runs at a time, each in a session of its own: started, polled until
``GET /v1/models`` answers, warmed up by ``--warmup-requests`` short requests (not timed), sent
the workload, then stopped (SIGTERM, SIGKILL to its process group after 60 s) and waited for
until no process of its session is left (our server's local Ray included) before the next one
starts. Every timed run gets a fresh server, so no prefix cache carries over; the arms take
turns (ours, vLLM, vLLM, ours, ...) for ``--repeats`` runs each, so that a change in the
machine's load falls on both.
Both get the same KV pool (``--kv-cache-gib``: our ``--kv-cache-bytes``, vLLM's
``VLLM_CPU_KVCACHE_SPACE``), every core of the machine (our worker's ``--worker-threads``, default
the core count: Ray would otherwise give the engine one thread per reserved CPU, 1, while vLLM's
CPU build uses every core) and the same served model name.

vLLM is the peer when ``--vllm-python`` (or ``$PAGEDSERVE_VLLM_PYTHON``) names the Python of a
virtual environment with ``vllm-cpu`` installed (see bench/README.md); without it, or for
``tiny-llama`` (no real tokenizer, which vLLM's server needs), its arm is left out and said so.
It runs from a scratch directory, never from this checkout.

Reported per arm, each run and the median over runs: TTFT p50/p99, TPOT p50/p99, E2E p50,
output tokens/s and failures; and ours/vLLM of TTFT p50 and TPOT p50 per alternated pair.

    $ pagedserve bench serve-compare --vllm-python ~/vllm-env/bin/python --json sc.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench.bench_io import positive_int
from pagedserve.bench.compare_arm import VLLM_PYTHON_ENV, vllm_python_of

if TYPE_CHECKING:
    from pagedserve.bench.openai_load import LoadSummary, RequestRecord
    from pagedserve.bench.serve_workload import PlannedRequest

VLLM_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
STOP_GRACE_S = 60.0  # SIGTERM, then this long before SIGKILL
WARMUP_LEN = 16
WARMUP_TOKENS = 4


class ServerFailed(RuntimeError):
    """A server exited or never answered; the message carries its log's tail."""


@dataclass(frozen=True)
class ArmRun:
    """One timed run of one arm: its records, their summary, and how long the server took."""

    arm: str
    repeat: int
    startup_s: float
    records: tuple[RequestRecord, ...]
    summary: LoadSummary
    # CPU seconds per process role of the server's session during the timed run (`proc_cpu`),
    # and the client's own: where the cores went while tokens streamed.
    cpu_s: dict[str, float] = field(default_factory=dict)


class Server:
    """One server process and the session it leads, which it owns: started, polled until it
    serves, and stopped with every process it started (our server's local Ray included)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], cwd: str,
                 port: int, log_path: Path) -> None:  # fmt: skip
        self.name = name
        self.command = command
        self.env = env
        self.cwd = cwd
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._process: subprocess.Popen | None = None

    @property
    def session(self) -> int | None:
        """The session (and process group) the server leads, while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        with open(self.log_path, "w", encoding="utf-8") as log:  # the child keeps its own fd
            self._process = subprocess.Popen(
                self.command, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_serving(self, timeout_s: float) -> float:
        """Polls ``GET /v1/models`` until it answers 200; returns the seconds that took."""
        assert self._process is not None, "not started"
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self._process.poll() is not None:
                raise self._failed(f"exited (code {self._process.returncode}) while starting")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass  # not listening yet (or answering 503 while it loads)
            time.sleep(1.0)
        raise self._failed(f"did not serve within {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM to the server, SIGKILL to its group after `STOP_GRACE_S`; returns once no
        process of its session is left.

        SIGTERM goes to the server alone, not its group: our server's group holds Ray's GCS
        and raylet, and killing them under it made its Serve shutdown hang until SIGKILL. Ray
        puts each of its workers in a group of their own, but they stay in the session
        `start_new_session` opened: the session is what is waited for, so that none of them
        shares the CPUs with the next arm.
        """
        process, self._process = self._process, None
        if process is None:
            return
        session = process.pid  # a session (and group) leader: its pid names both
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"  the {self.name} server outlived SIGTERM by {STOP_GRACE_S:.0f} s: SIGKILL")
            _signal_group(session, signal.SIGKILL)
            process.wait()
        if _session_gone(session, STOP_GRACE_S):
            return
        left = session_members(session)
        print(f"  the {self.name} server's processes {left} outlived it: SIGKILL")
        for pid in left:  # what outlived its parent's shutdown
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not _session_gone(session, 10.0):
            left = session_members(session)
            print(f"WARNING: the {self.name} server left processes {left}", flush=True)

    def _failed(self, what: str) -> ServerFailed:
        try:
            tail = "".join(self.log_path.read_text(errors="replace").splitlines(True)[-40:])
        except OSError:
            tail = "(no log)"
        return ServerFailed(
            f"the {self.name} server {what}; last lines of {self.log_path}:\n{tail}"
        )


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def session_members(session: int) -> list[int]:
    """Live processes (zombies left out) of a session, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # exited while we looked
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _session_gone(session: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while session_members(session):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# ------------------------------------------------------------------- the arms
def our_server(
    args: argparse.Namespace,
    scratch: Path,
    log_path: Path,
    arm: str = "ours",
    extra: str = "",
    python: str = sys.executable,
) -> Server:
    """`pagedserve serve` with one worker; `extra`: more of its flags (a variant arm's);
    `python`: whose install serves (another checkout's, for the `base` arm)."""
    from pagedserve.bench.compare_arm import child_env
    from pagedserve.bench.ports import free_port

    http_port, grpc_port = free_port(), free_port()
    command = [
        python, "-m", "pagedserve", "serve", "--num-workers", "1",
        "--model", args.model, "--served-model-name", args.model,
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--kv-cache-bytes", str(args.kv_cache_gib << 30),
        "--worker-threads", str(args.worker_threads),
    ]  # fmt: skip
    command += shlex.split(extra)
    env = child_env({})
    return Server(arm, command, env, str(scratch), http_port, log_path)


def vllm_server(
    args: argparse.Namespace, vllm_python: str, model_dir: str, scratch: Path, log_path: Path
) -> Server:
    from pagedserve.bench.compare_arm import child_env
    from pagedserve.bench.ports import free_port

    port = free_port()
    command = [
        vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", args.model, "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--seed", "0",
    ]  # fmt: skip
    # The scratch directory as cwd: the peer runs apart from this checkout.
    env = child_env({VLLM_KV_ENV: str(args.kv_cache_gib)})
    return Server("vllm", command, env, str(scratch), port, log_path)


def make_workload(
    tokenizer, num: int, min_len: int, max_len: int, max_tokens: int, rate: float, seed: int
) -> list[PlannedRequest]:
    """Prompts (real text, or random ids without a tokenizer) at seeded Poisson arrivals."""
    from pagedserve.bench.compare_workload import random_prompts, text_prompts
    from pagedserve.bench.serve_workload import PlannedRequest, arrival_times

    if tokenizer is not None:
        prompts = text_prompts(tokenizer.encode, num, min_len, max_len, seed)
    else:
        prompts = random_prompts(num, min_len, max_len, range(3, 256), seed)
    arrivals = arrival_times(num, rate, 1.0, random.Random(f"serve-compare/{seed}"))
    return [
        PlannedRequest(i, arrival, tuple(prompt), max_tokens)
        for i, (arrival, prompt) in enumerate(zip(arrivals, prompts, strict=True))
    ]


def run_arm(server: Server, workload, warmup, args: argparse.Namespace, repeat: int) -> ArmRun:
    """Starts the server, warms it up, times the workload, and stops it (always)."""
    from pagedserve.bench.openai_load import run_load, summarize
    from pagedserve.bench.proc_cpu import client_cpu_s, cpu_by_role, session_cpu

    print(f"starting the {server.name} server (log: {server.log_path})", flush=True)
    server.start()
    try:
        startup_s = server.wait_serving(args.startup_timeout)
        print(f"  serving after {startup_s:.0f} s; warming up", flush=True)
        for record in asyncio.run(run_load(server.base_url, args.model, warmup, 300.0)):
            if not record.ok:
                raise ServerFailed(f"the {server.name} server failed a warm-up: {record.error}")
        session = server.session
        before, client_before = session_cpu(session), client_cpu_s()
        records = asyncio.run(run_load(server.base_url, args.model, workload, args.request_timeout))
        cpu_s = cpu_by_role(before, session_cpu(session))
        cpu_s["client"] = client_cpu_s() - client_before
    finally:
        stopping = time.monotonic()
        server.stop()
        print(f"  stopped (with every process it started) in {time.monotonic() - stopping:.0f} s")
    summary = summarize(records)
    print(f"  run {repeat + 1} {server.name}: " + _row_cells(summary), flush=True)
    print(f"    CPU s over {summary.duration_s:.1f} s: " + _cpu_cells(cpu_s), flush=True)
    for record in records:
        if not record.ok:
            print(f"    request {record.index} failed: {record.error}", flush=True)
    return ArmRun(server.name, repeat, startup_s, tuple(records), summary, cpu_s)


def run_engine_arm(
    args: argparse.Namespace, workload, warmup, scratch: Path, log_path: Path, repeat: int
) -> ArmRun:
    """Our engine alone in a child process (`engine_arrivals`), the same requests added at
    the same arrival times, as many torch threads as our worker gets."""
    from pagedserve.bench.compare_arm import child_env
    from pagedserve.bench.openai_load import RequestRecord, summarize

    def as_json(planned) -> list[dict]:
        return [
            {"index": p.index, "arrival_s": p.arrival_s, "token_ids": list(p.token_ids),
             "max_tokens": p.max_tokens}
            for p in planned
        ]  # fmt: skip

    spec_path, out_path = scratch / "engine-spec.json", scratch / f"engine-{repeat}.json"
    spec = {"model": args.model, "kv_cache_bytes": args.kv_cache_gib << 30,
            "requests": as_json(workload), "warmup": as_json(warmup)}  # fmt: skip
    spec_path.write_text(json.dumps(spec))
    env = child_env({"OMP_NUM_THREADS": str(args.worker_threads)})
    command = [sys.executable, "-m", "pagedserve.bench.engine_arrivals", str(spec_path),
               str(out_path)]  # fmt: skip
    print("running the engine arm (our engine alone, same arrivals)", flush=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, cwd=str(scratch), env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        process.wait()
    if process.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
        raise ServerFailed(f"the engine arm exited with {process.returncode}:\n{tail}")
    out = json.loads(out_path.read_text())
    records = tuple(RequestRecord(**{**r, "chunk_times_s": tuple(r["chunk_times_s"])})
                    for r in out["records"])  # fmt: skip
    summary = summarize(records)
    steps = sorted(out["step_s"])
    cpu_s = {"engine steps": sum(steps)}
    print(f"  run {repeat + 1} engine: " + _row_cells(summary), flush=True)
    print(f"    {len(steps)} steps, median {steps[len(steps) // 2] * 1e3:.1f} ms, "
          f"{time.monotonic() - started:.0f} s with loading", flush=True)  # fmt: skip
    return ArmRun("engine", repeat, 0.0, records, summary, cpu_s)


def _cpu_cells(cpu_s: dict[str, float], shown: int = 8) -> str:
    """The roles that spent the most CPU, then the total."""
    top = list(cpu_s.items())[:shown]
    return ", ".join(f"{role} {s:.1f}" for role, s in top) + f"; total {sum(cpu_s.values()):.1f}"


def serve_compare(args: argparse.Namespace, vllm_python: str | None, scratch: Path):
    """Every timed run, in the order they ran, and the workload they shared."""
    from pagedserve.bench.compare import checkpoint_and_tokenizer
    from pagedserve.workers.model_registry import TINY_LLAMA_NAME

    tokenizer = model_dir = None
    if args.model == TINY_LLAMA_NAME:  # random weights and a byte tokenizer: random ids
        print("vLLM left out: tiny-llama has no real tokenizer, which vLLM's server needs")
        vllm_python = None
    else:
        model_dir, tokenizer = checkpoint_and_tokenizer(args.model, scratch)
    workload = make_workload(
        tokenizer,
        args.num_requests,
        args.min_input_len,
        args.max_input_len,
        args.output_len,
        args.request_rate,
        args.seed,
    )
    warmup = make_workload(tokenizer, args.warmup_requests, WARMUP_LEN, WARMUP_LEN,
                           WARMUP_TOKENS, float("inf"), args.seed + 1)  # fmt: skip
    variants = dict(parse_variant(v) for v in args.variant)
    base = ["base"] if args.baseline_python else []
    engine = ["engine"] if args.engine_arm else []
    arms = ["ours", *variants, *base, *engine] + (["vllm"] if vllm_python else [])
    runs = []
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else arms[::-1]:
            log_path = scratch / f"{arm}-{repeat + 1}.log"
            if arm == "engine":
                runs.append(run_engine_arm(args, workload, warmup, scratch, log_path, repeat))
                continue
            server = (
                our_server(args, scratch, log_path, python=args.ours_python)
                if arm == "ours"
                else our_server(args, scratch, log_path, arm, variants[arm])
                if arm in variants
                else our_server(args, scratch, log_path, arm, python=args.baseline_python)
                if arm == "base"
                else vllm_server(args, vllm_python, model_dir, scratch, log_path)
            )
            runs.append(run_arm(server, workload, warmup, args, repeat))
    return runs, workload


# ------------------------------------------------------------------- the report
COLUMNS = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "out tok/s", "failures")


def _row_cells(s: LoadSummary) -> str:
    figures = (s.ttft_p50_ms, s.ttft_p99_ms, s.tpot_p50_ms, s.tpot_p99_ms, s.e2e_p50_ms)
    cells = "".join(f"{f:>10.1f}" for f in figures)
    return cells + f"{s.output_tokens_per_s:>11.1f}{s.failures:>10d}"


def median_summary(summaries: list[LoadSummary]) -> dict[str, float]:
    """The median of every figure over runs (failures: their total)."""
    figures = {
        name: statistics.median(getattr(s, name) for s in summaries)
        for name in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                     "e2e_p50_ms", "output_tokens_per_s")
    }  # fmt: skip
    figures["failures"] = sum(s.failures for s in summaries)
    return figures


def parse_variant(text: str) -> tuple[str, str]:
    """`NAME=FLAGS` of `--variant`: another arm of ours, with FLAGS added to its command."""
    name, sep, flags = text.partition("=")
    if not sep or not name.isidentifier() or name in ("ours", "vllm"):
        raise ValueError(f"--variant wants NAME=FLAGS with a new NAME, got {text!r}")
    return name, flags


def pair_ratios(
    runs: list[ArmRun], arm: str = "ours", peer: str = "vllm"
) -> dict[str, list[float]]:
    """`arm` / `peer` of TTFT p50, TPOT p50 and tok/s, one per alternated pair (empty without
    either)."""
    mine = [r.summary for r in runs if r.arm == arm]
    theirs = [r.summary for r in runs if r.arm == peer]
    if not theirs or not mine:
        return {}
    return {
        name: [getattr(o, name) / getattr(p, name) for o, p in zip(mine, theirs, strict=True)]
        for name in ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s")
    }


def format_report(args: argparse.Namespace, runs: list[ArmRun], workload) -> str:
    lens = [len(p.token_ids) for p in workload]
    lines = [
        f"model {args.model}: {len(workload)} requests, prompts {min(lens)}-{max(lens)} tokens "
        f"(mean {statistics.mean(lens):.0f}), {args.output_len} greedy tokens each, Poisson at "
        f"{args.request_rate} req/s over {workload[-1].arrival_s:.1f} s; "
        f"{args.repeats} alternated runs per arm (latencies in ms)",
        f"{'arm':<6}{'run':>7}" + "".join(f"{c:>10}" for c in COLUMNS[:5]) + f"{COLUMNS[5]:>11}"
        f"{COLUMNS[6]:>10}",
    ]  # fmt: skip
    for arm in dict.fromkeys(r.arm for r in runs):
        mine = [r for r in runs if r.arm == arm]
        for r in mine:
            lines.append(f"{arm:<6}{r.repeat + 1:>7}" + _row_cells(r.summary))
        m = median_summary([r.summary for r in mine])
        lines.append(
            f"{arm:<6}{'median':>7}"
            + "".join(f"{v:>10.1f}" for k, v in m.items() if k.endswith("_ms"))
            + f"{m['output_tokens_per_s']:>11.1f}{m['failures']:>10d}"
        )
    arms = list(dict.fromkeys(r.arm for r in runs))
    peer = "vllm" if "vllm" in arms else "ours"
    pairs = [(a, pair_ratios(runs, a, peer)) for a in arms if a != peer]
    for arm, name, ratios in [(a, n, r) for a, of in pairs for n, r in of.items()]:
        label = name.removesuffix("_ms").replace("_", " ").upper().replace(" P", " p")
        label = "out tok/s" if name == "output_tokens_per_s" else label
        lines.append(
            f"{arm}/{peer} {label} per pair: median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}; "
            + " ".join(f"{r:.2f}" for r in ratios) + ")"
        )  # fmt: skip
    uncounted = [r for run in runs for r in run.records if r.ok and r.output_tokens is None]
    if uncounted:
        reasons = sorted({str(r.finish_reason) for r in uncounted})
        lines.append(
            f"WARNING: {len(uncounted)} requests finished other than 'length' "
            f"({', '.join(reasons)}): their token counts are unknown, left out of TPOT and tok/s"
        )
    return "\n".join(lines)


def to_json(args: argparse.Namespace, runs: list[ArmRun], workload) -> dict:
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"}
    return {
        "config": config,
        "workload": [
            {"index": p.index, "arrival_s": p.arrival_s, "prompt_tokens": len(p.token_ids)}
            for p in workload
        ],
        "runs": [
            {
                "arm": r.arm,
                "repeat": r.repeat,
                "startup_s": r.startup_s,
                "summary": asdict(r.summary),
                "cpu_s": r.cpu_s,
                "records": [
                    asdict(x) | {"ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "e2e_s": x.e2e_s}
                    for x in r.records
                ],
            }
            for r in runs
        ],
        "median": {
            arm: median_summary([r.summary for r in runs if r.arm == arm])
            for arm in dict.fromkeys(r.arm for r in runs)
        },
        "pair_ratios": {
            arm: pair_ratios(runs, arm)
            for arm in dict.fromkeys(r.arm for r in runs)
            if arm != "vllm"
        },
    }


# ------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    from pagedserve.workers.model_registry import TINY_LLAMA_NAME

    if args.min_input_len > args.max_input_len:
        args._parser.error(
            f"--min-input-len ({args.min_input_len}) is above --max-input-len "
            f"({args.max_input_len})"
        )
    if args.request_rate <= 0:
        args._parser.error("--request-rate must be > 0")
    if args.warmup_requests < 0:
        args._parser.error("--warmup-requests must be >= 0")
    vllm_python = vllm_python_of(args)
    with tempfile.TemporaryDirectory(prefix="pagedserve-serve-compare-") as scratch:
        try:
            runs, workload = serve_compare(args, vllm_python, Path(scratch))
        finally:
            if args.log_dir:  # the servers' logs outlive the scratch directory
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                for log in Path(scratch).glob("*.log"):
                    shutil.copy(log, Path(args.log_dir) / log.name)
    print(format_report(args, runs, workload))
    if vllm_python is None and args.model != TINY_LLAMA_NAME:
        print(f"vLLM left out: give --vllm-python or ${VLLM_PYTHON_ENV} (see bench/README.md)")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(args, runs, workload), indent=1) + "\n")
    return 0


def _kv_gib_default() -> int:
    """$VLLM_CPU_KVCACHE_SPACE when set (then both arms get it), else 2 GiB."""
    value = os.environ.get(VLLM_KV_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-compare",
        help="TTFT/TPOT over HTTP: our server and vLLM's OpenAI server, same Poisson workload",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m or tiny-llama (no vLLM arm)")
    add("--vllm-python", default=None, help=f"vLLM's Python (default: ${VLLM_PYTHON_ENV})")
    add("--num-requests", type=positive_int, default=30)
    add("--min-input-len", type=positive_int, default=32, help="shortest prompt, tokens")
    add("--max-input-len", type=positive_int, default=256, help="longest prompt, tokens")
    add("--output-len", type=positive_int, default=32, help="greedy tokens per request")
    add("--request-rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    add("--repeats", type=positive_int, default=2, help="timed runs per arm, alternated")
    add(
        "--worker-threads",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="our worker's torch threads (default: every core, as vLLM's CPU build uses)",
    )
    add("--variant", action="append", default=[], metavar="NAME=FLAGS",
        help="another arm of ours: `pagedserve serve` with FLAGS added (repeatable)")  # fmt: skip
    add("--engine-arm", action="store_true",
        help="an arm `engine`: our engine alone in one process, the same requests at the "
        "same arrival times (no Ray, router, proxy or HTTP)")  # fmt: skip
    add(
        "--ours-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the Python whose install serves the `ours` arm (default: this one)",
    )
    add(
        "--baseline-python",
        default=None,
        metavar="PYTHON",
        help="an arm `base`: the same server from another install (e.g. a checkout of main)",
    )
    add("--warmup-requests", type=int, default=2, help="untimed requests after each start")
    add("--kv-cache-gib", type=positive_int, default=_kv_gib_default(),
        help=f"KV pool of both servers, GiB (default: ${VLLM_KV_ENV} or 2)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--startup-timeout", type=float, default=600.0, help="seconds for a server to serve")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--json", metavar="FILE", default=None, help="config, every record and the summaries")
    add("--log-dir", default=None, help="keep the servers' logs here")
    parser.set_defaults(func=run, _parser=parser)
