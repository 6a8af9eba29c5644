"""gguf_blocks: float32 weights that are exactly GGUF Q4_1/Q8_0 codes are kept as those codes,
compute the float32 layer (the same weights, bit for bit), give each row the same bits whatever
the batch, and anything that is not exactly a code is left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from pagedserve.kernels.cpu_blocks import (
    FORMAT_Q4_1,
    FORMAT_Q8_0,
    block_dequantize,
    blocks_available,
)
from pagedserve.workers.model.cpu_linear import Projection, describe_block_codes
from pagedserve.workers.model.gguf_blocks import find_block_codes

pytestmark = pytest.mark.skipif(not blocks_available(), reason="the block-code op needs AVX-512")

GGUF_TYPES = {FORMAT_Q4_1: GGMLQuantizationType.Q4_1, FORMAT_Q8_0: GGMLQuantizationType.Q8_0}


def gguf_weight(rows: int, cols: int, fmt: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as a GGUF checkpoint dequantised by gguf's own code holds it."""
    values = np.random.default_rng(seed).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    qtype = GGUF_TYPES[fmt]
    return torch.from_numpy(quants.dequantize(quants.quantize(values, qtype), qtype).copy())


@pytest.mark.parametrize("fmt", [FORMAT_Q4_1, FORMAT_Q8_0], ids=["Q4_1", "Q8_0"])
def test_gguf_codes_are_found_and_decode_to_the_same_bits(fmt: int):
    weight = gguf_weight(96, 320, fmt)
    codes = find_block_codes(weight)
    assert codes is not None and codes.fmt == fmt
    assert torch.equal(block_dequantize(codes.codes, 96, 320, fmt), weight)
    assert codes.nbytes == 96 * 320 * (0.625 if fmt == FORMAT_Q4_1 else 1.0625)


@pytest.mark.parametrize("fmt", [FORMAT_Q4_1, FORMAT_Q8_0], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 300])
def test_the_layer_from_codes_is_the_float32_layer(fmt: int, rows: int):
    weight = gguf_weight(160, 576, fmt, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    out = find_block_codes(weight)(x)
    reference = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", [FORMAT_Q4_1, FORMAT_Q8_0], ids=["Q4_1", "Q8_0"])
def test_a_row_has_the_same_bits_whatever_the_row_count(fmt: int, threads: int):
    weight = gguf_weight(1024, 576, fmt)
    codes = find_block_codes(weight)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([codes(x[i : i + 1]) for i in (0, 5, 6, 299)])
        for rows in (1, 3, 6, 7, 13, 64, 300):
            batch = codes(x[:rows])
            for index, row in enumerate((0, 5, 6, 299)):
                if row < rows:
                    assert torch.equal(batch[row], alone[index]), (rows, row)
    finally:
        torch.set_num_threads(before)


def test_weights_that_are_not_exactly_codes_are_left_alone():
    weight = gguf_weight(64, 64, FORMAT_Q4_1)
    nudged = weight.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))
    assert find_block_codes(nudged) is None
    assert find_block_codes(torch.randn(64, 64)) is None
    assert find_block_codes(weight.to(torch.bfloat16)) is None
    assert find_block_codes(gguf_weight(40, 64, FORMAT_Q4_1)) is None  # rows: not whole tiles
    assert find_block_codes(weight[:, :48].contiguous()) is None  # columns: not whole blocks


def test_a_projection_keeps_codes_adds_its_bias_and_packs_other_weights_for_onednn():
    weight = gguf_weight(64, 128, FORMAT_Q4_1)
    bias = torch.randn(64)
    x = torch.randn(3, 128)
    from_codes = Projection.of(weight, bias, "gguf")
    assert from_codes.blocks is not None
    torch.testing.assert_close(from_codes(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    plain = Projection.of(torch.randn(64, 128), None, "gguf")
    assert plain.blocks is None and plain.packed
    summary = describe_block_codes([from_codes, plain])
    assert summary.startswith("1 of 2 projections kept as GGUF block codes (Q4_1 1)")
