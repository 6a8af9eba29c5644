"""Tensor parallelism on GPUs: k = 2 ranks over NCCL with the Triton kernels give k = 1's greedy
tokens on the real model (float32, so rounding cannot flip a near tie), under prefix hits,
preemption and ngram speculation; and a move-shaped export/import round trip is exact. The
group loads its own model on the host: cuda:0 gains only rank 0's shard and pool, never the
whole model.
Skipped without two CUDA GPUs (scripts/gpu_check.sh runs it where the lent machine has them)."""

from __future__ import annotations

import pytest
import torch
from support.engine import finish_clean
from support.real_model import SMOLLM2

from pagedserve import LLM, SamplingParams
from pagedserve.workers.model.loader import load_model
from pagedserve.workers.tp.shard_bytes import model_shards, shard_weight_bytes

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CONFIG = dict(
    device="cuda",
    block_size=16,
    num_kv_blocks=24,
    watermark=0.0,
    max_num_batched_tokens=128,
    speculative={"method": "ngram", "num_tokens": 3},
)


def test_k2_over_nccl_equals_k1():
    loaded = load_model(SMOLLM2, device="cuda")
    tokenizer = loaded.tokenizer
    texts = ["The capital of France is", "def fib(n):\n    ", "1, 2, 3, 4, 5, 6,"] * 2
    prompts = [tokenizer.encode(text) for text in texts]
    prompts += [prompts[0] + prompts[1], prompts[0] + prompts[2]]  # prefix hits
    single = LLM(loaded_model=loaded, **CONFIG)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    finish_clean(single)
    before = torch.cuda.memory_allocated(0)
    group = LLM(SMOLLM2, tensor_parallel_size=2, **CONFIG)  # loads on the host, then releases
    try:
        engine = group.engine
        assert engine.device == torch.device("cuda", 0) and engine.loaded.device.type == "meta"
        rank0 = model_shards(engine.loaded, 2)[0]
        shard = shard_weight_bytes(engine.loaded.model, rank0, engine.loaded.head_dim)
        grown = torch.cuda.memory_allocated(0) - before
        assert grown < shard + engine.kv_cache.local.device_bytes + (16 << 20)
        outputs = group.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
        kv = group.engine.kv_cache
        packed = kv.export_blocks([0, 1])
        kv.import_blocks(packed, [2, 3])
        assert torch.equal(kv.export_blocks([2, 3]), packed)
        finish_clean(group)
    finally:
        group.engine.close()


def test_more_ranks_than_gpus_is_refused_naming_the_flag():
    loaded = load_model("tiny-llama", device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(loaded_model=loaded, device="cuda", tensor_parallel_size=torch.cuda.device_count() + 1)
