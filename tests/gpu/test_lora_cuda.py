"""LoRA on a real GPU: the Triton shrink/expand kernel at serving sizes against the torch
reference, and an engine on CUDA serving a mixed batch of PEFT adapters (ranks 4, 8, 2) and the
base, each equal to HF + PEFT's merged model (the CPU suite runs both at toy sizes)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.lora_ops import add_lora_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "n"), [(512, 4096, 4096), (37, 4096, 14336)])
def test_triton_lora_at_serving_sizes(dtype, tokens, k, n) -> None:
    from pagedserve.kernels.lora_triton import add_lora_triton

    gen = torch.Generator().manual_seed(3)
    slots, rank = 8, 16
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = (torch.randn(slots, rank, k, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(n, slots, rank, generator=gen) * 0.05).to(dtype).permute(1, 0, 2)
    scales = torch.rand(slots, generator=gen) + 0.5
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    out = torch.randn(tokens, n, generator=gen).to(dtype)
    expected = add_lora_ref(
        out.clone().float(), x.float(), a.float(), b.float(), scales, token_slots
    )
    got = out.to(CUDA)
    add_lora_triton(got, *(t.to(CUDA) for t in (x, a, b, scales, token_slots)))
    torch.testing.assert_close(got.float().cpu(), expected, atol=0.1, rtol=0.05)


def test_an_engine_on_cuda_serves_mixed_adapters_as_merged_peft(tmp_path) -> None:
    from support.engine import Stepper
    from support.lora import make_test_adapters

    from pagedserve import LLM, SamplingParams
    from pagedserve.workers.model.tiny_llama import build_tiny_llama

    adapters = make_test_adapters(tmp_path)
    llm = LLM(
        "tiny-llama",
        device="cuda",
        block_size=16,
        num_kv_blocks=64,
        lora_modules=[f"{a.name}={a.path}" for a in adapters.values()],
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 21))
    names = [*adapters, None]
    for name in names:
        llm.engine.add_request(str(name), prompt, params, lora=name)
    outputs = Stepper(llm.engine).run_to_end()
    base = _greedy(build_tiny_llama(seed=0).eval(), prompt, params.max_tokens)
    for name in names:
        model = adapters[name].reference.model if name else None
        expected = base if name is None else _greedy(model, prompt, params.max_tokens)
        assert outputs[str(name)].outputs[0].token_ids == expected, name


@torch.inference_mode()
def _greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's forward, argmax token by token (no EOS stop: the engine ignores it too)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
