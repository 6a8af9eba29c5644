"""How `pagedserve bench compare` talks to the engines it measures, each in its own process.

An arm is a long-lived child process. It reads its `ArmSpec` (JSON, path on its command line),
loads the model, runs the warm-up requests, and prints ``ready``. Then for each ``run`` line on
its stdin it generates every prompt once, greedily, exactly ``max_tokens`` tokens each
(``ignore_eos``), and prints one `ArmRun` as a JSON line; ``quit`` ends it.

Only `generate` is timed: process start, model loading and the warm-up are not. Every arm
gets the same KV pool (`kv_cache_gib`: vLLM's `VLLM_CPU_KVCACHE_SPACE`, our `kv_cache_bytes`),
so that neither runs fewer sequences at once for want of memory the other has. Prefix caching
is off in every arm: each timed run repeats the same prompts, and a cache kept from the run
before would turn the later runs' prefills into hits. The vLLM arm (`compare_vllm_arm.py`)
speaks the same protocol with no import from this package, since it runs in vLLM's own
virtual environment.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

READY = "ready"
RUN = "run"
QUIT = "quit"


@dataclass(frozen=True)
class ArmSpec:
    """What an arm loads and generates."""

    model_dir: str  # an HF checkpoint directory (the GGUF model's converted copy)
    dtype: str
    prompts: list[list[int]]
    max_tokens: int
    warmup_prompts: list[list[int]]
    warmup_tokens: int
    has_tokenizer: bool
    kv_cache_gib: int  # the KV pool of every arm: the same memory on each side

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ArmSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class ArmRun:
    """One timed `generate` of every prompt."""

    seconds: float
    outputs: list[list[int]]

    @classmethod
    def from_json(cls, text: str) -> ArmRun:
        data = json.loads(text)
        return cls(float(data["seconds"]), [list(map(int, o)) for o in data["outputs"]])
