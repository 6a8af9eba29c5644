"""The built-in ``tiny-llama``: a small random Llama that needs no download.

Its weights come from a seed alone, through per-parameter ``torch.Generator``s and explicit
uniform init, so every process on every machine builds bit-identical weights without touching
the global RNG. The init scales are chosen so greedy generations wander instead of repeating one
token, and so attention (hence the KV cache) visibly changes what comes next.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.workers.model.registry import TINY_LLAMA_NAME
from pagedserve.workers.model.tokenizer import BYTE_TOKENIZER_MARKER, ByteTokenizer

__all__ = ["TINY_LLAMA_NAME", "build_tiny_llama", "save_tiny_llama", "tiny_llama_config"]

_HIDDEN = 256
_INTERMEDIATE = 688
_MAX_POSITIONS = 2048

# Standard deviation of each weight kind, as a multiple of 1/sqrt(fan_in) except for the
# embedding (absolute). Embeddings a bit louder than the attention/MLP updates make the model
# follow its input; sharp q/k make attention pick out earlier tokens; a loud lm_head gives
# peaked next-token distributions. Chosen by looking at greedy outputs (see the tests).
_EMBED_STD = 1.0
_QK_GAIN = 1.5
_LM_HEAD_GAIN = 4.0


def tiny_llama_config() -> LlamaConfig:
    """The architecture of ``tiny-llama`` (vocab: 256 bytes + ``<pad>``, ``<bos>``, ``<eos>``)."""
    tok = ByteTokenizer
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=_HIDDEN,
        intermediate_size=_INTERMEDIATE,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def build_tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """``tiny-llama`` with weights determined by ``seed`` alone, on the CPU, in eval mode.

    Args:
        seed: the same seed gives bit-identical weights in any process on any machine.
        dtype: parameter dtype (weights are drawn in float32 and then cast).

    Returns:
        The model, ``sdpa`` attention; the model runner swaps in paged attention.
    """
    config = tiny_llama_config()
    # HF's constructor draws its own random init from the global RNG; keep the caller's RNG
    # untouched (we overwrite every weight below anyway).
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_init_value(name, tuple(param.shape), seed))
    return model.to(dtype).eval()


def save_tiny_llama(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Write ``tiny-llama`` as a real HF checkpoint directory (config + safetensors).

    A marker file makes ``load_tokenizer`` give the directory the byte tokenizer.

    Returns:
        ``path`` as a string.
    """
    path = os.fspath(path)
    build_tiny_llama(seed).save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, BYTE_TOKENIZER_MARKER), "w", encoding="utf-8") as f:
        json.dump({"type": "byte", "vocab_size": ByteTokenizer.vocab_size}, f)
    return path


def _init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The float32 initial value of parameter ``name``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = _init_std(name, shape)
    # One generator per parameter, seeded from (seed, name): the value does not depend on the
    # order parameters are visited in. Uniform draws are plain integer arithmetic on the
    # Mersenne twister's output, so they are identical across CPUs (unlike vectorized randn).
    generator = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
    unit = torch.rand(shape, generator=generator, dtype=torch.float64) * 2.0 - 1.0
    return (unit * (std * math.sqrt(3.0))).to(torch.float32)


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of parameter ``name``'s uniform init."""
    if name.endswith("embed_tokens.weight"):
        return _EMBED_STD
    fan_in = shape[-1]
    gain = 1.0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = _QK_GAIN
    elif name.endswith("lm_head.weight"):
        gain = _LM_HEAD_GAIN
    return gain / math.sqrt(fan_in)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def save_truncated_tiny_llama(path: str | os.PathLike[str], num_layers: int = 2) -> str:
    """tiny-llama (seed 0) cut to its first `num_layers` layers, as a checkpoint directory: a
    cheaper draft with the same vocabulary whose guesses are right part of the time."""
    full = build_tiny_llama(0)
    config = tiny_llama_config()
    config.num_hidden_layers = num_layers
    with torch.random.fork_rng(devices=[]):
        draft = type(full)(config)
    draft.load_state_dict(
        {
            name: value
            for name, value in full.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
    )
    path = os.fspath(path)
    draft.eval().save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, BYTE_TOKENIZER_MARKER), "w", encoding="utf-8") as f:
        json.dump({"type": "byte", "vocab_size": ByteTokenizer.vocab_size}, f)
    return path
