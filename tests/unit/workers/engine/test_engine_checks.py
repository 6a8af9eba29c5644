"""`check_engine`: what a worker's start would refuse, found without loading weights, each
naming the `EngineConfig` field at fault (`pagedserve serve` turns it into the flag)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.workers.engine.checks import (
    EngineConfigError,
    ModelShape,
    check_engine,
    model_shape,
)
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.tiny_llama import save_tiny_llama

TINY = {"model": "tiny-llama"}
# tiny-llama: 4 layers, 2 KV heads of 32: a float32 block of 16 tokens is 16 × 2·4·2·32·4 bytes.
TINY_BLOCK_BYTES = 16 * 2 * 4 * 2 * 32 * 4


def refused(**fields) -> EngineConfigError:
    with pytest.raises(EngineConfigError) as raised:
        check_engine(EngineConfig(**fields))
    return raised.value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-checkpoint"))


def test_a_good_config_gives_the_model_shape():
    assert check_engine(EngineConfig(**TINY)) == ModelShape(4, 2, 32, "float32", 2048)


def test_a_checkpoint_directory_is_read_like_the_built_in_model(checkpoint):
    assert model_shape(checkpoint, "bfloat16", "model") == ModelShape(4, 2, 32, "bfloat16", 2048)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"model": "/nonexistent/model"}, "model"),
        ({**TINY, "kv_cache_bytes": TINY_BLOCK_BYTES - 1}, "kv_cache_bytes"),
        ({**TINY, "device": "cuda"}, "device"),
        ({**TINY, "max_model_len": 2049}, "max_model_len"),
        ({**TINY, "block_size": 4096}, "block_size"),
        ({**TINY, "enable_chunked_prefill": False, "max_num_batched_tokens": 100},
         "max_num_batched_tokens"),
        ({**TINY, "attention_backend": "triton"}, "attention_backend"),
        ({**TINY, "speculative": {"method": "draft", "draft_model": "/nope"}},
         "speculative.draft_model"),
    ],
)  # fmt: skip
def test_each_mistake_names_its_field(monkeypatch, fields, field):
    if field == "device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # scripts/test.sh sets it
    assert refused(**fields).field == field


def test_the_kv_budget_is_the_pools_own_arithmetic():
    """The check passes exactly where the worker's pool sizing (`KVCache`) gets a block."""
    dims = {"block_size": 16, "num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
    assert KVCache.num_blocks_for_budget(TINY_BLOCK_BYTES, dtype=torch.float32, **dims) == 1
    check_engine(EngineConfig(**TINY, kv_cache_bytes=TINY_BLOCK_BYTES))
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.num_blocks_for_budget(TINY_BLOCK_BYTES - 1, dtype=torch.float32, **dims)
    error = refused(**TINY, kv_cache_bytes=TINY_BLOCK_BYTES - 1)
    assert f"give at least {TINY_BLOCK_BYTES}" in str(error)
    check_engine(EngineConfig(**TINY, kv_cache_bytes=1, num_kv_blocks=4))  # blocks win


def test_a_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    error = refused(model=str(tmp_path))
    assert error.field == "model" and "config.json does not load" in str(error)


def test_a_checkpoint_without_weights(checkpoint, tmp_path):
    for name in ("config.json", "pagedserve_tokenizer.json"):
        os.symlink(os.path.join(checkpoint, name), tmp_path / name)
    error = refused(model=str(tmp_path))
    assert error.field == "model" and "holds no weights" in str(error)


def test_tokenizer_files_that_do_not_load(checkpoint, tmp_path):
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(checkpoint, name), tmp_path / name)
    (tmp_path / "tokenizer.json").write_text("{broken", encoding="utf-8")
    error = refused(model=str(tmp_path))
    assert error.field == "model" and "tokenizer files do not load" in str(error)


def test_an_unwritable_disk_tier_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    fields = {**TINY, "kv_disk_tier_dir": str(blocker / "tier"), "kv_disk_tier_bytes": 1 << 20}
    assert refused(**fields).field == "kv_disk_tier_dir"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": "fp8"}, "dtype must be one of"),
        ({"device": "mps"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"watermark": 1.0}, r"watermark must be in \[0, 1\)"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of"),
    ],
)
def test_what_only_a_worker_refused_is_refused_where_the_config_is_built(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
