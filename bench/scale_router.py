"""One router replica of `pagedserve bench scale`: a real `RouterCore` in its own process.

`ScaleRouter` (a Ray actor, so its process CPU is its own) builds a `RouterCore` over the
simulated workers and the real prefix index, and sends its share of the load from inside the
same process: each request goes through `RouterCore.generate` at its arrival time, exactly as
Serve's router replica would take it from the proxy (the proxy hop is not measured). The time
of each routing decision is taken around `RouterCore.route` on this instance (a wrapper that
only reads the clocks), so the routing code runs unchanged.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pagedserve.bench.scale_report import RequestResult, RouterRun
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams


def process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class ScaleRouter:
    """Owns one `RouterCore` and the decision times measured around its `route`.

    Args:
        config: the router config the core gets.
        index: the prefix index actor.
        workers: worker id → (simulated) worker handle.
    """

    def __init__(self, config: RouterConfig, index: Any, workers: dict[str, Any]) -> None:
        self.core = RouterCore(config, index, workers)
        self.route_s: list[float] = []
        self.route_cpu_s: list[float] = []
        route = self.core.route

        async def timed_route(*args: Any, **kwargs: Any) -> Any:
            # Wall time, and this thread's CPU time: on a contended machine the OS may take
            # the core away mid-decision, which the wall time counts and the CPU time not.
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return await route(*args, **kwargs)
            finally:
                self.route_s.append(time.perf_counter() - start)
                self.route_cpu_s.append(time.thread_time() - cpu)

        self.core.route = timed_route

    async def start(self) -> int:
        """Wait for every worker and the first view sync; returns the workers alive."""
        await self.core.start()
        return sum(w.alive for w in self.core.workers.values())

    async def run(
        self,
        plan: list[tuple[int, float, tuple[int, ...]]],
        salt: str,
        max_tokens: int,
        start_at: float,
    ) -> RouterRun:
        """Send `plan` ((index, arrival_s, prompt) each) from wall-clock `start_at` on."""
        self.route_s, self.route_cpu_s = [], []
        view_before = self.core.view.stats().entries_applied
        cpu_before = process_cpu_s()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(self._send(i, t0 + at, prompt, salt, max_tokens) for i, at, prompt in plan)
        )
        window = time.perf_counter() - t0
        return RouterRun(
            requests=tuple(results),
            route_s=tuple(self.route_s),
            route_cpu_s=tuple(self.route_cpu_s),
            cpu_s=process_cpu_s() - cpu_before,
            view_entries=self.core.view.stats().entries_applied - view_before,
            window_s=window,
        )

    async def _send(
        self, index: int, at: float, prompt: tuple[int, ...], salt: str, max_tokens: int
    ) -> RequestResult:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        request = GenerateRequest(
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            prompt_token_ids=list(prompt),
            request_id=f"{salt}-{index}",
            cache_salt=salt,
        )
        tokens, cached, error = 0, 0, None
        try:
            async for delta in self.core.generate(request):
                tokens += len(delta.token_ids)
                if delta.usage is not None:
                    cached = delta.usage.cached_tokens
                error = error or delta.error
        except Exception as e:  # counted; one failure must not end the run
            error = f"{type(e).__name__}: {e}"
        return RequestResult(index, time.perf_counter() - at, tokens, len(prompt), cached, error)

    async def inflight(self) -> int:
        return self.core.num_inflight

    async def close(self) -> None:
        await self.core.close()
