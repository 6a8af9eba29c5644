"""The `engine` arm of `bench serve-compare`: our engine alone, fed the served workload.

The same requests at the same arrival times as the servers get (or, in a closed loop, the
same number of requests in flight), but added straight to an `Engine` stepped in a loop in
this one process: no Ray, no router, no proxy, no HTTP. Each token is stamped when its step
returns, so its TTFT/TPOT are what the engine alone gives under those arrivals; the gap to
`pagedserve serve` is the serving path (hops, serialisation, and the control plane's share
of the cores). With every arrival at t = 0 its tokens/s is the offline engine's on that
workload.

The engine is the served worker's (`serve_compare_engine.served_worker_layout`): its
`EngineConfig`, its torch threads (``OMP_NUM_THREADS``, set by the parent as Ray sets it for
the worker), its niceness and cores (set here first, as `Worker.__init__` does), and one thread of
its own that builds the engine and takes every step, as the worker's does
(`WorkerCore._engine_thread`). The last matters: libgomp gives each thread that starts OpenMP
work a team of its own, spins at its barriers while it manages no more threads than the
machine has cores, and throttles the spin once it manages more. Built on the main thread and
stepped on another, SmolLM2's decode steps took about twice as long as built and stepped on
one (bench/README.md, "GGUF block codes and one engine thread").

python -m pagedserve.bench.engine_arrivals SPEC.json OUT.json

SPEC: {"engine": EngineConfig's fields, "nice": int or null, "cpus": [int] or null,
"concurrency": int or null (closed loop), "share_board": a path or null (run each step
on this engine's share of the cores, as a served worker with `worker_share_cores` does,
beside whatever else takes slots on that board), "requests": [{"index", "arrival_s", "token_ids",
"max_tokens"}], "warmup": [same]}. OUT: one record per request (`openai_load.RequestRecord`
fields, as JSON), every step's seconds, the timed run's CPU seconds, and the torch threads
and niceness the engine ran with.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict


def run_requests(
    engine,
    requests: list[dict],
    prefix: str,
    step: Callable[[], list] | None = None,
    concurrency: int | None = None,
) -> tuple[list[dict], list[float]]:
    """Add each request at its arrival offset (or, with `concurrency`, whenever fewer than
    that many are unfinished), step until all are done.

    Args:
        engine: the engine (`add_request`, `has_unfinished_requests`).
        requests: the workload's requests, as `SPEC` holds them.
        prefix: of the engine's request ids, so that runs on one engine never clash.
        step: one engine step (default `engine.step`; `main` runs it on a thread of its own).
        concurrency: closed loop: requests kept in flight; their arrival is when added.

    Returns:
        Per-request records (times in s after the start) and every step's seconds.
    """
    from pagedserve.bench.openai_load import RequestRecord
    from pagedserve.workers.protocol.sampling import SamplingParams

    step = step or engine.step
    pending = sorted(requests, key=lambda r: r["arrival_s"])
    if concurrency is not None:
        pending = sorted(requests, key=lambda r: r["index"])  # workload order, as the client
    chunks: dict[int, list[float]] = {r["index"]: [] for r in requests}
    sent: dict[int, float] = {}
    ended: dict[int, float] = {}
    steps: list[float] = []
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and _due(pending[0], now, len(sent) - len(ended), concurrency):
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(f"{prefix}{r['index']}", list(r["token_ids"]), params)
            sent[r["index"]] = now if concurrency is not None else r["arrival_s"]
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0]["arrival_s"] - now))  # idle until the next one
            continue
        started = time.monotonic()
        deltas = step()
        done = time.monotonic()
        steps.append(done - started)
        for delta in deltas:
            index = int(delta.request_id.removeprefix(prefix))
            if any(c.token_ids for c in delta.completions):
                chunks[index].append(done - t0)
            if delta.finished:
                ended[index] = done - t0
    return [asdict(_record(r, sent, ended, chunks, RequestRecord)) for r in requests], steps


def _due(request: dict, now: float, in_flight: int, concurrency: int | None) -> bool:
    if concurrency is None:
        return request["arrival_s"] <= now
    return in_flight < concurrency


def _record(r: dict, sent: dict, ended: dict, chunks: dict, record_type):
    index = r["index"]
    return record_type(
        index=index,
        arrival_s=sent[index],
        prompt_tokens=len(r["token_ids"]),
        max_tokens=r["max_tokens"],
        send_s=sent[index],
        end_s=ended[index],
        chunk_times_s=tuple(chunks[index]),
        output_tokens=r["max_tokens"],
        finish_reason="length",
        http_status=None,
    )


def place(nice: int | None, cpus: Sequence[int] | None) -> None:
    """This process's niceness and cores, before the engine starts a thread (as the worker)."""
    from pagedserve.workers.process.cpu_placement import pin_process, set_niceness

    if cpus is not None:
        pin_process(cpus, what="engine arm")
    if nice is not None:
        set_niceness(nice, what="engine arm")


def _stepper_on_share(board: str | None, engine_step: Callable[[], list]) -> Callable[[], list]:
    """`engine_step`, each call on this process's share of the cores of `board` (as a served
    worker's steps: `CoreShare.take_share`), or as is without a board. The share's slot is
    freed when the process ends."""
    if board is None:
        return engine_step
    import atexit
    from pathlib import Path

    from pagedserve.workers.process.core_share import CoreShare, usable_cores

    share = CoreShare(Path(board), usable_cores())
    atexit.register(share.close)

    def step() -> list:
        share.take_share()
        return engine_step()

    return step


def main(argv: Sequence[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    place(spec.get("nice"), spec.get("cpus"))
    import torch

    from pagedserve.workers.engine.config import EngineConfig
    from pagedserve.workers.engine.engine import Engine

    # One thread builds the engine and takes its steps, as the served worker's does (see the
    # module docstring).
    with ThreadPoolExecutor(1, thread_name_prefix="engine-step") as stepper:
        engine = stepper.submit(Engine, EngineConfig(**spec["engine"])).result()

        step_on_share = _stepper_on_share(spec.get("share_board"), engine.step)

        def step() -> list:
            return stepper.submit(step_on_share).result()

        run_requests(engine, spec["warmup"], "warmup-", step)
        cpu_before = time.process_time()
        records, steps = run_requests(engine, spec["requests"], "r-", step, spec.get("concurrency"))
        cpu_s = time.process_time() - cpu_before
    threads, nice = torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0)
    out = {"records": records, "step_s": steps, "cpu_s": cpu_s, "threads": threads, "nice": nice}
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
