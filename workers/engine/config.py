"""The engine's one typed config: model, KV pool, scheduling and kernels."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from pagedserve.kernels.backends import BACKENDS, LINEAR_BACKENDS
from pagedserve.workers.kv.manager import ALLOCATION_MODES, AllocationMode
from pagedserve.workers.lora.config import LoraConfig, parse_lora_modules
from pagedserve.workers.model.registry import DEFAULT_MODEL
from pagedserve.workers.scheduler.fair_share import FairShareConfig
from pagedserve.workers.scheduler.policy import (
    PREEMPTION_MODES,
    PreemptionMode,
    SchedulingPolicy,
)
from pagedserve.workers.spec.config import SpeculativeConfig

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
CUDA_KV_MEMORY_FRACTION = 0.8
# Weights and KV dtypes by the names a user may write, each to its torch name (model_loader
# maps them to torch's dtypes); "auto" is the checkpoint's own.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
AUTO_DTYPE = "auto"
# KV pool dtypes (`kv_cache_dtype`): the model's own, or 8-bit codes, symmetric int8 or fp8
# (`fp8` = `fp8_e4m3`, torch's float8_e4m3fn), with a float32 scale per (token, KV head) row
# (`pagedserve/kernels/kv_quant.py`).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker's engine is built from.

    Attributes:
        model: a built-in name (`smollm2-135m`, the default, or `tiny-llama`), a local HF
            checkpoint directory or a `.gguf` file (see `model.registry`); None: the default.
        dtype: weights and KV dtype: `float32`, `float16`, `bfloat16` (or `fp32`/`fp16`/
            `bf16`/`half`), or `auto` for the checkpoint's own.
        device: `cpu` or `cuda` (a worker on a GPU machine gets `cuda`).
        seed: weight seed of `tiny-llama` and of the sampler's unseeded requests.
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks in the pool; wins over `kv_cache_bytes`.
        kv_cache_dtype: the KV pool's dtype: `auto` (the model's dtype), `int8` (symmetric),
            or `fp8` (`fp8_e4m3`; or `fp8_e5m2`): 8 bits per value with a float32 scale per
            token and KV head computed as it is written; the same byte budget holds 2x the
            positions of a 16-bit pool and 4x a float32 one (scales, 4 bytes per row, counted
            apart). See `docs/kv-dtype.md`.
        kv_cache_bytes: KV pool size in bytes. With neither, the pool takes 256 MiB on the CPU
            or 80% of free device memory on CUDA (per rank with tensor parallelism: what
            cuda:0 has free beside rank 0's shard of the weights); `pagedserve serve` sizes a
            CPU worker's pool from the machine's available memory instead
            (`cluster/serve/node_layout.py`).
        num_swap_blocks: CPU swap slots for preempted requests (None: as many as KV blocks with
            `swap` preemption, else none).
        attention_backend: `auto` (Triton on CUDA; on the CPU the C++ `cpu` kernel, or `torch`
            where it cannot be built), `triton`, `cpu` or `torch` (the plain-torch reference).
        linear_backend: the fused decoder's projections on the CPU: `auto` (`gguf` for
            float32 weights on an AVX-512 CPU, else `onednn` for float32 where this torch has
            oneDNN and for bfloat16 where the CPU also has native bfloat16 arithmetic, else
            `torch`), `gguf` (a weight whose float32 values are exactly GGUF Q4_1 or Q8_0
            block codes, as a dequantised GGUF file's are, is kept as those codes: the same
            weights from 5-6x fewer bytes; other weights as `onednn`), `onednn` (weights
            packed once at load into oneDNN's blocked layout: a second copy of the projection
            weights, beside the model's own) or `torch` (`nn.functional.linear`). Elsewhere,
            and for a model run through HF's modules, `torch`.
        enable_prefix_caching: reuse cached KV blocks of equal prefixes.
        kv_allocation: `paged` (blocks as tokens arrive) or `reserve-max` (a whole context per
            request, the baseline paging is measured against).
        watermark: fraction of blocks kept free when admitting a new request, so running ones
            can grow.
        max_model_len: longest sequence, prompt plus output (None: the model's context).
        max_num_seqs: sequences running at once. `pagedserve serve` on CPUs admits 128 per
            worker unless told (vLLM's CPU server's own; `cluster/serve/node_layout.py`).
        max_num_batched_tokens: tokens per step (the scheduler's budget).
        enable_chunked_prefill: split long prompts into chunks that share steps with decodes.
        scheduling_policy: `fcfs` or `priority` (lower values first).
        preemption_mode: how a sequence yields its blocks when the pool runs short:
            `recompute`, `swap` (to the CPU swap area) or `move` (to a peer; cluster only).
        max_waiting: new requests queued at most; past it `add_request` raises `Overloaded` at
            once (None: unbounded, as offline use wants).
        split_decodes: Triton: decodes of a mixed prefill+decode batch through the split
            decode kernel (a second launch), so a long decode among prefills is spread over
            many programs.
        speculative: speculative decoding (`SpeculativeConfig`, or a dict of its fields);
            None: off.
        kv_host_tier_bytes: bytes of CPU memory for cached KV blocks evicted from the device
            pool (the host tier; 0: off). Evicted blocks are copied there instead of dropped
            and loaded back when a request's prefix hits them.
        kv_disk_tier_dir: directory of the disk tier (None: off): cached blocks evicted from
            the host tier (or from the device, without one) are written there in the
            background, survive a restart and are announced again. In a cluster each worker
            uses its own subdirectory, named after the worker.
        kv_disk_tier_bytes: bytes of files the disk tier may hold (required with
            kv_disk_tier_dir).
        fair_share: how the scheduler shares the engine among tenants (`FairShareConfig`, or
            a dict of its fields; `workers/scheduler/fair_share.py`): on by default, a no-op with
            one tenant. In a cluster, the tenants' weights come from the cluster's `tenants`.
        grammar_compile_timeout_s: how long a request with a grammar (structured outputs)
            waits for it to compile before it fails with finish reason `error`; compiles run
            off the step, so a slow one never holds back other requests.
        max_beam_width: the widest beam search (`n` with `use_beam_search`) a request may
            ask for; a wider one is refused naming `n`.
        tensor_parallel_size: ranks (devices) the model and its KV pool are split over
            (`workers/tp/`; vLLM's name): each rank holds its share of the attention heads,
            KV heads, MLP rows and vocabulary, and one all-reduce joins them after attention
            and after the MLP of each layer. At most the model's KV heads; on the CPU each
            rank is a process with `cores / k` threads. `kv_cache_bytes` is per rank.
        max_loras: LoRA adapters on the device at once: one step serves requests of at most
            this many adapters (and the base model); others wait for a slot (`workers/lora/`).
        max_lora_rank: the largest LoRA rank an adapter may have; a larger one is refused at
            load.
        max_cpu_loras: parsed LoRA adapters kept in host memory (least recently used out;
            an adapter out of it is read again from its directory when next used).
        lora_modules: LoRA adapters loaded at start, as `NAME=PATH` entries (PEFT's format:
            `adapter_config.json` + `adapter_model.safetensors`); a request selects one with
            `model: NAME`.
    """

    model: str | None = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    kv_cache_bytes: int | None = None
    num_swap_blocks: int | None = None
    attention_backend: str = field(default="auto", metadata={"choices": BACKENDS})
    linear_backend: str = field(default="auto", metadata={"choices": LINEAR_BACKENDS})
    enable_prefix_caching: bool = True
    kv_allocation: AllocationMode = field(
        default=AllocationMode.PAGED, metadata={"choices": ALLOCATION_MODES}
    )
    watermark: float = 0.01
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SchedulingPolicy.registry})
    preemption_mode: PreemptionMode = field(
        default=PreemptionMode.RECOMPUTE, metadata={"choices": PREEMPTION_MODES}
    )
    max_waiting: int | None = None
    split_decodes: bool = False
    speculative: SpeculativeConfig | None = None
    kv_host_tier_bytes: int = 0
    kv_disk_tier_dir: str | None = None
    kv_disk_tier_bytes: int = 0
    grammar_compile_timeout_s: float = 30.0
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    max_beam_width: int = 8
    tensor_parallel_size: int = 1
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 64
    lora_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A dict (from `LLM(speculative={...})` or YAML) becomes the typed config here, once.
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if isinstance(self.fair_share, dict):
            object.__setattr__(self, "fair_share", FairShareConfig(**self.fair_share))
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}"
            )
        if self.kv_allocation not in ALLOCATION_MODES:
            raise ValueError(
                f"kv_allocation must be one of {ALLOCATION_MODES}, got {self.kv_allocation!r}"
            )
        object.__setattr__(self, "kv_allocation", AllocationMode(self.kv_allocation))
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {timeout!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        LoraConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # checks them
        parse_lora_modules(self.lora_modules)
        if self.lora_modules and tp > 1:  # the sharded decoder has no adapter hooks
            raise ValueError("lora_modules: LoRA adapters need tensor_parallel_size 1")
        self._check_names()
        self._check_scheduling()
        self._check_tiers()

    def _check_names(self) -> None:
        """The names a worker would only refuse once it loads: dtype, device, backend."""
        dtype = str(self.dtype).removeprefix("torch.").lower()
        if dtype != AUTO_DTYPE and dtype not in DTYPE_NAMES:
            known = ", ".join([*DTYPE_NAMES, AUTO_DTYPE])
            raise ValueError(f"dtype must be one of {known}, got {self.dtype!r}")
        if not _DEVICE.fullmatch(str(self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}"
            )

    def _check_scheduling(self) -> None:
        """What the worker's scheduler and block manager refuse, refused where it is set."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_beam_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        if not (isinstance(self.watermark, int | float) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.scheduling_policy not in SchedulingPolicy.registry:
            known = tuple(SchedulingPolicy.registry)
            raise ValueError(
                f"scheduling_policy must be one of {known}, got {self.scheduling_policy!r}"
            )
        object.__setattr__(self, "preemption_mode", PreemptionMode.of(self.preemption_mode))

    def _check_tiers(self) -> None:
        for name in ("kv_host_tier_bytes", "kv_disk_tier_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.kv_disk_tier_dir is not None:
            if not str(self.kv_disk_tier_dir).strip():
                raise ValueError("kv_disk_tier_dir must not be empty")
            if self.kv_disk_tier_bytes == 0:
                raise ValueError("kv_disk_tier_bytes must be > 0 when kv_disk_tier_dir is set")
        elif self.kv_disk_tier_bytes:
            raise ValueError("kv_disk_tier_bytes is set but kv_disk_tier_dir is not")
        if (self.kv_host_tier_bytes or self.kv_disk_tier_dir) and not self.enable_prefix_caching:
            raise ValueError("the KV host and disk tiers need enable_prefix_caching")

    def for_worker(self, worker_id: str) -> EngineConfig:
        """This config for one worker of a cluster: its own disk-tier subdirectory, so that
        workers on one machine never share files and a restarted worker finds its own."""
        if self.kv_disk_tier_dir is None:
            return self
        directory = os.path.join(self.kv_disk_tier_dir, _safe_path_part(worker_id))
        return dataclasses.replace(self, kv_disk_tier_dir=directory)


def _safe_path_part(name: str) -> str:
    """`name` usable as one path component (worker names are `[A-Za-z0-9_.-]` already)."""
    part = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return "_" if part in ("", ".", "..") else part
