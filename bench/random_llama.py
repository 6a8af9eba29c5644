"""Save a random-weight Llama of a real model's shape as a local checkpoint, for benchmarks.

    python -m pagedserve.bench.random_llama smollm2-135m /tmp/smollm2-135m-random
    pagedserve bench offline --model /tmp/smollm2-135m-random ...

Only the shape matters to speed, so the weights are HF's own random init (seeded). No tokenizer
is written: the benchmarks send token ids drawn from the whole vocabulary, and a model without
a tokenizer is served ids in, ids out (no detokenizing).
"""

from __future__ import annotations

import argparse

# Architecture numbers of the models the CPU benchmarks use (from their config.json).
SHAPES: dict[str, dict[str, object]] = {
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
}


def save_random_llama(shape: str, path: str, seed: int = 0) -> str:
    """Write a random `LlamaForCausalLM` of `shape` (a key of `SHAPES`) to `path`.

    Returns:
        `path`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape])
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(save_random_llama(args.shape, args.path, args.seed))


if __name__ == "__main__":
    main()
