"""The `engine` arm of `bench serve-compare`: our engine alone, fed the served workload.

The same requests at the same arrival times as the servers get, but added straight to an
`Engine` stepped in a loop in this one process: no Ray, no router, no proxy, no HTTP. Each
token is stamped when its step returns, so its TTFT/TPOT are what the engine alone gives
under those arrivals; the gap to `pagedserve serve` is the serving path (hops, serialisation,
and the control plane's share of the cores). With ``--request-rate inf`` every request is
there at t = 0: its tokens/s is the offline engine's on that workload.

python -m pagedserve.bench.engine_arrivals SPEC.json OUT.json

SPEC: {"model", "kv_cache_bytes", "requests": [{"index", "arrival_s", "token_ids",
"max_tokens"}], "warmup": [same]}. OUT: one record per request (`openai_load.RequestRecord`
fields, as JSON) and the engine's step times.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict


def run_requests(engine, requests: list[dict], prefix: str) -> tuple[list[dict], list[float]]:
    """Add each request at its arrival offset, step until all are done; per-request records
    (times in s after the start) and every step's seconds."""
    from pagedserve.bench.openai_load import RequestRecord
    from pagedserve.workers.sampling_params import SamplingParams

    pending = sorted(requests, key=lambda r: r["arrival_s"])
    chunks: dict[int, list[float]] = {r["index"]: [] for r in requests}
    sent: dict[int, float] = {}
    ended: dict[int, float] = {}
    steps: list[float] = []
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and pending[0]["arrival_s"] <= now:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(f"{prefix}{r['index']}", list(r["token_ids"]), params)
            sent[r["index"]] = r["arrival_s"]
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0]["arrival_s"] - now))  # idle until the next one
            continue
        started = time.monotonic()
        deltas = engine.step()
        done = time.monotonic()
        steps.append(done - started)
        for delta in deltas:
            index = int(delta.request_id.removeprefix(prefix))
            if any(c.token_ids for c in delta.completions):
                chunks[index].append(done - t0)
            if delta.finished:
                ended[index] = done - t0
    records = [
        RequestRecord(
            index=r["index"],
            arrival_s=r["arrival_s"],
            prompt_tokens=len(r["token_ids"]),
            max_tokens=r["max_tokens"],
            send_s=sent[r["index"]],
            end_s=ended[r["index"]],
            chunk_times_s=tuple(chunks[r["index"]]),
            output_tokens=r["max_tokens"],
            finish_reason="length",
            http_status=None,
        )
        for r in requests
    ]
    return [asdict(record) for record in records], steps


def main(argv: Sequence[str]) -> int:
    from pagedserve.workers.engine import Engine
    from pagedserve.workers.engine_config import EngineConfig

    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    engine = Engine(EngineConfig(model=spec["model"], kv_cache_bytes=spec["kv_cache_bytes"]))
    run_requests(engine, spec["warmup"], "warmup-")
    records, steps = run_requests(engine, spec["requests"], "r-")
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump({"records": records, "step_s": steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
