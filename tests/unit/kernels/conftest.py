"""Fixtures for the kernel tests: where Triton kernels can run, and seeded generators."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import triton_interpreter_active


@pytest.fixture
def triton_device() -> torch.device:
    """The device Triton kernels run on here, or skip the test.

    The interpreter (CPU) wins when active, so CI on a CUDA machine with TRITON_INTERPRET=1
    still tests the interpreted path; otherwise CUDA compiles the real kernels.
    """
    if triton_interpreter_active():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip(
        "Triton kernels need CUDA or the interpreter: run with TRITON_INTERPRET=1 set before "
        "pytest starts (it must be set before triton is imported)"
    )


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed, so every test sees the same data."""
    return torch.Generator().manual_seed(1234)
