"""Batched LoRA (`lora_ops`, `lora_triton`) against the token-by-token reference: mixed slots
(base tokens among them), zero-padded smaller ranks, a column slice of a wider output."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.lora_ops import add_lora_ref, add_lora_torch, lora_mask


def _case(gen, tokens, k, n, slots_count, rank, dtype):
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = torch.randn(slots_count, rank, k, generator=gen).to(dtype)
    b = torch.randn(slots_count, n, rank, generator=gen).to(dtype)
    a[1, rank // 2 :] = 0  # slot 1 holds a smaller rank, zero-padded
    b[1, :, rank // 2 :] = 0
    scales = torch.rand(slots_count, generator=gen) + 0.5
    slots = torch.randint(-1, slots_count, (tokens,), generator=gen)
    out = torch.randn(tokens, n, generator=gen).to(dtype)
    return out, x, a, b, scales, slots


def _tolerance(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-1, "rtol": 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "n", "rank"), [(7, 32, 48, 8), (1, 16, 8, 4)])
def test_torch_path_equals_the_reference(gen, dtype, tokens, k, n, rank):
    out, x, a, b, scales, slots = _case(gen, tokens, k, n, 3, rank, dtype)
    expected = add_lora_ref(out.clone(), x, a, b, scales, slots)
    got = add_lora_torch(out.clone(), x, a, b, scales, slots)
    torch.testing.assert_close(got, expected, **_tolerance(dtype))
    base = slots < 0
    assert torch.equal(got[base], out[base])  # the base model's tokens are left alone


def test_the_mask_holds_each_tokens_own_slot_scaled(gen):
    mask = lora_mask(torch.tensor([1, -1, 0]), torch.tensor([2.0, 3.0]), 2, torch.float32)
    assert mask.tolist() == [[0, 0, 3, 3], [0, 0, 0, 0], [2, 2, 0, 0]]


@pytest.mark.parametrize("num_slots", [2, 3])
def test_the_engines_layout_and_a_prefix_of_slots(gen, num_slots):
    """B stored [N, S, R] (handed out as its [S, N, R] view), only the first S' slots used."""
    out, x, a, b, scales, slots = _case(gen, 9, 24, 40, 3, 4, torch.float32)
    slots = slots.clamp(max=num_slots - 1)
    stored = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    expected = add_lora_ref(out.clone(), x, a, b, scales, slots)
    got = add_lora_torch(out.clone(), x, a, stored, scales, slots, num_slots)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_wrong_shapes_are_refused(gen):
    out, x, a, b, scales, slots = _case(gen, 4, 16, 8, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="slots must be"):
        add_lora_torch(out, x, a, b, scales, slots.int())
    with pytest.raises(ValueError, match="do not match"):
        add_lora_torch(out, x[:, :8], a, b, scales, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "n", "rank"), [(5, 40, 24, 8), (3, 16, 70, 4)])
def test_triton_kernel_equals_the_reference(triton_device, gen, dtype, tokens, k, n, rank):
    from pagedserve.kernels.lora_triton import add_lora_triton

    wide, x, a, b, scales, slots = _case(gen, tokens, k, n + 6, 3, rank, dtype)
    b = b[:, :n].permute(1, 0, 2).contiguous().permute(1, 0, 2)  # the engine's layout
    expected = wide.clone()
    add_lora_ref(expected[:, 3 : 3 + n], x, a, b, scales, slots)
    moved = [t.to(triton_device) for t in (wide, x, a, b, scales, slots)]
    got = moved[0].clone()
    add_lora_triton(got[:, 3 : 3 + n], *moved[1:])  # a column slice, as q of fused q/k/v
    torch.testing.assert_close(got.cpu(), expected, **_tolerance(dtype))
