"""End-to-end engine figure: `LLM` with Triton vs torch attention vs HF `generate`.

    python scripts/gpu_e2e.py [--out-dir DIR] [--dry-run]

A random-weight Llama built from a config on the GPU (default ~1.0B parameters: Llama-3.2-1B's
shape with a 32k vocabulary; bf16), because no checkpoint can travel to a lent GPU. The same
prompts (random token ids, all of one length, so HF needs no padding) go through:

- `hf_generate`: transformers' own `generate`, SDPA attention, greedy;
- `engine_triton`: pagedserve's `LLM`, Triton paged kernels;
- `engine_triton_split_decodes`: the same with mixed batches' decodes through the split kernel;
- `engine_torch`: pagedserve's `LLM`, torch reference attention.

Each row gives output tokens per second over the timed run (after a warm-up run that
compiles the kernels), the greedy agreement with HF (mean share of each completion that
matches HF's token for token before the first difference, and how many match fully), and
for Triton the kernel binaries compiled during the timed run (0 means no JIT mid-serving).
Random weights give flat logits, so bf16 rounding can flip a greedy choice: agreement
below 100% is expected and reported, not asserted. HF runs first because the engine switches
the model's attention function for good.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from pagedserve.bench.gpu_rows import RowLog, device_refusal, timer_name
from pagedserve.kernels.testing import compiled_variants

ONE_B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=32000)
TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """A random-weight Llama wrapped as the engine's `LoadedModel` (no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.workers.model.loader import LoadedModel

    config = LlamaConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
        max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return LoadedModel(
        model=model, tokenizer=None, name="random-llama", num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings, eos_token_ids=frozenset(), dtype=dtype,
        device=device,
    )  # fmt: skip


def params_b(loaded) -> float:
    return sum(p.numel() for p in loaded.model.parameters()) / 1e9


def run_hf(loaded, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
    """Greedy `generate` of every prompt in one batch; (completions, seconds)."""
    ids = torch.tensor(prompts, device=loaded.device)
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        warm = ids[:1, :8]  # a short warm-up: CUDA context, cuBLAS handles, SDPA kernels
        loaded.model.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(warm))  # fmt: skip
        _sync(loaded.device)
        start = time.perf_counter()
        out = loaded.model.generate(ids, **kwargs)
        _sync(loaded.device)
    return out[:, ids.shape[1] :].tolist(), time.perf_counter() - start


def run_engine(loaded, backend: str, split_decodes: bool, prompts, max_new: int, blocks: int):
    """(completions, seconds, compiles during the timed run) of `LLM.generate`, greedy."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.kernels import decode, prefill

    llm = LLM(
        loaded_model=loaded,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        attention_backend=backend,
        num_kv_blocks=blocks,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        split_decodes=split_decodes,
    )
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], SamplingParams(max_tokens=4, temperature=0.0))
    kernels = (decode.decode_split_kernel, decode.decode_reduce_kernel, prefill.prefill_kernel)
    before = [compiled_variants(k) for k in kernels]
    _sync(loaded.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync(loaded.device)
    seconds = time.perf_counter() - start
    after = [compiled_variants(k) for k in kernels]
    compiles = None if None in before + after else sum(after) - sum(before)
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    return completions, seconds, compiles


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int]:
    """(mean share of each completion equal to ref before the first difference, full matches)."""
    shares, full = [], 0
    for a, b in zip(ours, ref, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        shares.append(n / max(len(b), 1))
        full += a == b
    return sum(shares) / max(len(shares), 1), full


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--out-dir", type=pathlib.Path)
    p.add_argument("--skip", default="", help="comma list of arms to skip")
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU interpreter")
    args = p.parse_args(argv)
    args.shape, args.dtype, args.device = ONE_B, torch.bfloat16, torch.device("cuda")
    if args.dry_run:
        args.shape, args.dtype, args.device = TINY, torch.float32, torch.device("cpu")
        args.num_prompts, args.prompt_len, args.max_new = 3, 12, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (refused := device_refusal(args.dry_run, "gpu_e2e")) is not None:
        return refused
    rows_path = args.out_dir / "bench_rows.jsonl" if args.out_dir else None
    log = RowLog(rows_path, "e2e")
    loaded = build_model(args.shape, args.dtype, args.device, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, args.shape["vocab"], (args.num_prompts, args.prompt_len),
                            generator=gen).tolist()  # fmt: skip
    common = dict(params_b=params_b(loaded), prompts=args.num_prompts,
                  prompt_len=args.prompt_len, max_new=args.max_new, dtype=str(args.dtype),
                  timer=timer_name(args.device))  # fmt: skip
    ref, seconds = run_hf(loaded, prompts, args.max_new)
    new_tokens = args.num_prompts * args.max_new
    log.add(arm="hf_generate", tokens_per_s=new_tokens / seconds, seconds=seconds, **common)
    blocks = args.num_prompts * -(-(args.prompt_len + args.max_new) // 16) + 64
    arms = [("engine_triton", "triton", False), ("engine_triton_split_decodes", "triton", True),
            ("engine_torch", "torch", False)]  # fmt: skip
    for arm, backend, split in arms:
        if arm in args.skip.split(","):
            continue
        try:
            outs, seconds, compiles = run_engine(
                loaded, backend, split, prompts, args.max_new, blocks
            )
        except Exception as exc:  # one arm failing must not hide the others
            log.add(arm=arm, error=f"{type(exc).__name__}: {exc}"[:300], **common)
            continue
        share, full = agreement(outs, ref)
        log.add(arm=arm, tokens_per_s=new_tokens / seconds, seconds=seconds,
                greedy_match_share=share, full_matches=full, compiles_in_timed_run=compiles,
                **common)  # fmt: skip
    if args.out_dir:
        (args.out_dir / "e2e.json").write_text(json.dumps({"rows": log.rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
