"""load_model: the built-in tiny-llama (deterministic weights) and local HF checkpoints."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagedserve.workers.model.loader import load_model
from pagedserve.workers.model.tiny_llama import TINY_LLAMA_NAME, build_tiny_llama, save_tiny_llama
from pagedserve.workers.model.tokenizer import ByteTokenizer

# sha256 over (name, bytes) of tiny-llama's seed-0 float32 state dict, sorted by name. Every
# process on every machine must build exactly these weights (workers compare generations).
TINY_LLAMA_SEED0_SHA256 = "8231b3d29ff8926e5887419db4882ea3b49dac05d923e6edc4cf97585d6b4913"
TINY_LLAMA_NUM_PARAMS = 2_903_808


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_tiny_llama_weights_depend_on_the_seed_only() -> None:
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    first = build_tiny_llama(seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    torch.manual_seed(456)
    second = build_tiny_llama(seed=0)
    assert _digest(first) == _digest(second) == TINY_LLAMA_SEED0_SHA256
    assert _digest(build_tiny_llama(seed=1)) != TINY_LLAMA_SEED0_SHA256


def test_tiny_llama_description() -> None:
    loaded = load_model(TINY_LLAMA_NAME)
    assert loaded.name == TINY_LLAMA_NAME
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim) == (
        4,
        8,
        2,
        32,
    )
    assert (loaded.vocab_size, loaded.max_model_len) == (259, 2048)
    assert loaded.eos_token_ids == frozenset({258})
    assert (loaded.dtype, loaded.device) == (torch.float32, torch.device("cpu"))
    model = loaded.model
    assert sum(p.numel() for p in model.parameters()) == TINY_LLAMA_NUM_PARAMS
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.training


def test_tiny_llama_greedy_output_is_not_degenerate() -> None:
    model = load_model(TINY_LLAMA_NAME).model
    prompt = torch.tensor([ByteTokenizer().encode("Hello, world", add_bos=True)])
    out = model.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None)
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(set(generated)) >= 16, generated


def test_saved_tiny_llama_loads_with_the_same_logits(tmp_path) -> None:
    path = save_tiny_llama(tmp_path / "tiny", seed=3)
    from_dir = load_model(path)
    built_in = load_model(TINY_LLAMA_NAME, seed=3)
    assert from_dir.name == path
    assert isinstance(from_dir.tokenizer, ByteTokenizer)
    assert from_dir.eos_token_ids == frozenset({258})
    ids = torch.tensor([[257, 72, 105, 33, 10, 200]])
    with torch.no_grad():
        assert torch.equal(from_dir.model(ids).logits, built_in.model(ids).logits)


def test_qwen2_checkpoint_loads(tmp_path) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=[5, 7],
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="bf16")
    assert loaded.tokenizer is None  # token-id prompts still work
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert (loaded.vocab_size, loaded.max_model_len) == (128, 512)
    assert loaded.eos_token_ids == frozenset({5, 7})
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_mistral_context_is_capped_by_its_sliding_window(tmp_path) -> None:
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        sliding_window=1024,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).max_model_len == 1024


@pytest.mark.parametrize("name", ["no-such-model", "tiny_llama", "meta-llama/Llama-3-8B"])
def test_unknown_model_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=f"model '{name}' is not a built-in model"):
        load_model(name)


def test_directory_without_checkpoint_is_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot load a causal LM checkpoint"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8", ""])
def test_unsupported_dtype_is_rejected(dtype: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported dtype '{dtype}'"):
        load_model(TINY_LLAMA_NAME, dtype=dtype)


@pytest.mark.parametrize(
    "dtype, expected",
    [("float16", torch.float16), ("bf16", torch.bfloat16), ("auto", torch.float32)],
)
def test_supported_dtypes(dtype: str, expected: torch.dtype) -> None:
    loaded = load_model(TINY_LLAMA_NAME, dtype=dtype)
    assert loaded.dtype == expected
    assert all(p.dtype == expected for p in loaded.model.parameters())
