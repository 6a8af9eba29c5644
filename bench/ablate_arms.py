"""`pagedserve bench ablate`'s arms: the baseline, the one switch each arm changes, the worker
group an arm starts (`AblateConfig.cluster`), and running the workload through one arm
(`run_arm`: its own worker group driven by a `RouterCore` in this process, every worker warmed
up first, the group stopped after). The command and its flags are in `bench/ablate.py`; the
ratios and the table in `bench/ablate_report.py`.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.serve_metrics import Delta, kv_sample_from_cluster, summarize
from pagedserve.bench.serve_runner import RunResult, run_workload
from pagedserve.bench.serve_workload import PlannedRequest
from pagedserve.workers.protocol.requests import WorkerRequest

BASELINE: dict[str, Any] = {
    "kv_allocation": "paged",
    "enable_prefix_caching": True,
    "routing_policy": "kv_aware",
    "enable_chunked_prefill": True,
    "preemption_mode": "recompute",
    "attention_backend": "torch",
    "kv_tiers": "off",
    "pd_layout": "off",
}
# (factor, setting, the values other than the baseline's)
FACTORS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("allocation", "kv_allocation", ("reserve-max",)),
    ("prefix-caching", "enable_prefix_caching", (False,)),
    ("routing", "routing_policy", ("least_loaded", "round_robin")),
    ("chunked-prefill", "enable_chunked_prefill", (False,)),
    ("preemption", "preemption_mode", ("swap",)),
    ("attention", "attention_backend", ("triton",)),
    ("tiers", "kv_tiers", ("host+disk",)),
    ("pd", "pd_layout", ("1+1",)),
)
GPU_ONLY = {("attention_backend", "triton")}


@dataclass(frozen=True)
class Arm:
    """One configuration: the baseline with at most one setting changed."""

    name: str
    factor: str | None = None
    setting: str | None = None
    value: Any = None

    def settings(self) -> dict[str, Any]:
        return {**BASELINE, **({self.setting: self.value} if self.setting else {})}


def arms(factors: list[str] | None = None) -> list[Arm]:
    """The baseline, then one arm per non-baseline value of each chosen factor."""
    chosen = [f for f in FACTORS if factors is None or f[0] in factors]
    result = [Arm("baseline")]
    for factor, setting, values in chosen:
        result += [Arm(f"{setting}={value}", factor, setting, value) for value in values]
    return result


@dataclass(frozen=True)
class AblateConfig:
    """The cluster every arm shares (besides its own switch)."""

    num_workers: int = 2
    block_size: int = 16
    num_kv_blocks: int = 160
    max_model_len: int = 1024
    max_num_seqs: int = 64
    device: str = "cpu"
    poll_interval_s: float = 0.1
    host_tier_bytes: int = 4 << 20
    disk_tier_bytes: int = 256 << 20
    model: str = "tiny-llama"

    def cluster(self, arm: Arm, tier_dir: str | None = None) -> dict[str, Any]:
        """`ClusterConfig` data of one arm's worker group (`tier_dir`: its disk tier's)."""
        settings = arm.settings()
        routing = settings.pop("routing_policy")
        layout = settings.pop("pd_layout")  # "off", or "<prefill>+<decode>" workers
        roles = {}
        if layout != "off":
            prefill, decode = (int(n) for n in layout.split("+"))
            roles = {"prefill_workers": prefill, "decode_workers": decode}
        if settings.pop("kv_tiers") != "off":
            settings |= {
                "kv_host_tier_bytes": self.host_tier_bytes,
                "kv_disk_tier_dir": tier_dir,
                "kv_disk_tier_bytes": self.disk_tier_bytes,
            }
        engine = {
            "model": self.model,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "device": self.device,
            **settings,
        }
        gpus = 1.0 / self.num_workers if self.device == "cuda" else 0.0
        name = "bench-ablate-" + arm.name.replace("=", "-").replace("_", "-").replace("+", "p")
        name = name.lower()
        return {
            "engine": engine,
            "scaling": {"num_workers": self.num_workers, **roles},
            "placement": {"worker_num_gpus": gpus},
            "routing": {"routing_policy": routing},
            "failure": {"stats_interval_s": 0.1},
            "name": name,
        }


@dataclass
class ArmResult:
    arm: Arm
    cluster: dict[str, Any]
    run: RunResult | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def max_running(self) -> int | None:
        if not self.run or not self.run.kv_samples:
            return None
        return max(s["num_running"] for s in self.run.kv_samples)


# --- one arm -------------------------------------------------------------------------------


def run_arm(
    config: AblateConfig, arm: Arm, workload: list[PlannedRequest], slo: tuple
) -> ArmResult:
    """Start the arm's worker group, run the workload through a `RouterCore`, stop the group."""
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.pool.group import start_worker_group, stop_worker_group

    tier_dir = tempfile.TemporaryDirectory(prefix="pagedserve-ablate-kv-")
    cluster = config.cluster(arm, tier_dir.name)
    result = ArmResult(arm, cluster)
    if (arm.setting, arm.value) in GPU_ONLY and config.device != "cuda":
        result.skipped = "needs a GPU (Triton kernels); this run is CPU only"
        tier_dir.cleanup()
        return result
    cluster_config = ClusterConfig.from_dict(cluster)
    index, workers = start_worker_group(cluster_config)
    try:
        result.run = asyncio.run(_drive(cluster_config, index, workers, workload, config))
    finally:
        stop_worker_group(cluster_config)
        tier_dir.cleanup()
    result.summary = summarize(result.run.records, result.run.duration_s, *slo)
    return result


async def _drive(cluster_config, index, workers, workload, config: AblateConfig) -> RunResult:
    from pagedserve.cluster.router.config import RouterConfig
    from pagedserve.cluster.router.router import RouterCore

    core = RouterCore(RouterConfig.of(cluster_config), index, workers)
    try:
        await core.start()
        await asyncio.gather(*(_warm_up(wid, handle) for wid, handle in workers.items()))

        async def poll(t_s: float) -> dict[str, Any]:
            return kv_sample_from_cluster(t_s, await core.cluster_stats())

        return await run_workload(
            workload,
            _core_sender(core),
            poll,
            poll_interval_s=config.poll_interval_s,
            error_reason=core_error_reason,
        )
    finally:
        await core.close()


def core_error_reason(error: BaseException) -> str:
    """`Type: message` of the error a worker raised (unwrapped from Ray's task error)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    return f"{type(error).__name__}: {error}"


def _core_sender(core):
    async def send(planned: PlannedRequest):
        from pagedserve.workers.protocol.requests import GenerateRequest
        from pagedserve.workers.protocol.sampling import SamplingParams

        params = SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(
            params=params,
            prompt_token_ids=list(planned.token_ids),
            request_id=f"ablate-{planned.index}",
        )
        async for delta in core.generate(request):
            metrics, usage = delta.metrics, delta.usage
            yield Delta(
                num_tokens=len(delta.token_ids),
                finish_reason=delta.finish_reason,
                prompt_tokens=usage.prompt_tokens if usage else None,
                cached_tokens=usage.cached_tokens if usage else None,
                queue_time_s=metrics.queue_time if metrics else None,
                worker_ttft_s=metrics.ttft if metrics else None,
                preemptions=metrics.num_preemptions if metrics else None,
                worker_id=delta.worker_id,
                error=delta.error,
            )

    return send


async def _warm_up(worker_id: str, handle: Any) -> None:
    """One short request straight to the worker: its first forward is slow, keep it out."""
    from pagedserve.workers.protocol.sampling import SamplingParams

    rng = random.Random(f"warm-up {worker_id}")
    tokens = [rng.randrange(256) for _ in range(24)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for ref in handle.generate.remote(
        WorkerRequest.fresh(f"warm-up-{worker_id}", tokens, params)
    ):
        await ref
