"""Pick the kernel implementation for a device: Triton on CUDA, the C++ CPU kernel on the CPU
(the torch references where it cannot be built).

The choice is made once, by the worker from its config (`backend`), and handed down as a
`KernelOps` bundle, so nothing inside the model runner branches on the backend per call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_paged, reference
from pagedserve.kernels.backends import BACKENDS


@dataclass(frozen=True)
class KernelOps:
    """One backend's implementation of every paged-KV kernel (same signatures throughout).

    Attributes:
        name: "triton", "cpu" or "torch".
    """

    name: str
    write_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    gather_blocks: Callable[..., torch.Tensor]
    scatter_blocks: Callable[..., None]


TORCH_OPS = KernelOps(
    name="torch",
    write_kv=reference.write_kv_ref,
    paged_decode_attention=reference.paged_decode_attention_ref,
    paged_prefill_attention=reference.paged_prefill_attention_ref,
    copy_blocks=reference.copy_blocks_ref,
    gather_blocks=reference.gather_blocks_ref,
    scatter_blocks=reference.scatter_blocks_ref,
)


# The CPU backend computes attention in its C++ op and shares the references' in-place movers.
CPU_OPS = dataclasses.replace(
    TORCH_OPS,
    name="cpu",
    paged_decode_attention=cpu_paged.paged_decode_attention_cpu,
    paged_prefill_attention=cpu_paged.paged_attention_cpu,
)


def triton_interpreter_active() -> bool:
    """True when Triton kernels run on the CPU through the interpreter.

    Triton decides at decoration (import) time whether `@triton.jit` compiles or interprets,
    so `TRITON_INTERPRET=1` set after `pagedserve.kernels` was imported has no effect; both
    the variable and the already-decorated kernels are checked.
    """
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve.kernels.kv_write import write_kv_kernel

    return isinstance(write_kv_kernel, InterpretedFunction)


def _triton_ops(split_decodes: bool) -> KernelOps:
    # Imported here so that a broken or missing Triton never stops the torch backend.
    from pagedserve.kernels import block_ops, decode, kv_write, prefill

    prefill_fn = prefill.paged_prefill_attention
    if split_decodes:
        prefill_fn = functools.partial(prefill_fn, split_decodes=True)
    return KernelOps(
        name="triton",
        write_kv=kv_write.write_kv,
        paged_decode_attention=decode.paged_decode_attention,
        paged_prefill_attention=prefill_fn,
        copy_blocks=block_ops.copy_blocks,
        gather_blocks=block_ops.gather_blocks,
        scatter_blocks=block_ops.scatter_blocks,
    )


def get_kernel_ops(
    backend: str = "auto", device: torch.device | str = "cpu", *, split_decodes: bool = False
) -> KernelOps:
    """Return the kernel implementation to use on `device`.

    Args:
        backend: "auto" (Triton on CUDA; elsewhere "cpu" when its C++ op builds, else
            "torch"), "triton", "cpu" (the C++ kernel, CPU pools only) or "torch" (the
            references, any device).
        device: the device the KV pool lives on.
        split_decodes: Triton only: in mixed prefill+decode batches, run the decode rows
            through the split-KV decode kernel (a second launch). Off by default until a
            GPU run has compared both (`pagedserve.bench.kernels`, mixed-batch rows).

    Returns:
        The chosen `KernelOps`.

    Raises:
        ValueError: on an unknown backend name, "cpu" on a non-CPU device or where its op
            cannot be built, or "triton" on a non-CUDA device without the Triton interpreter
            (`TRITON_INTERPRET=1` set before import).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    device_type = torch.device(device).type
    if backend == "auto":
        if device_type == "cuda":
            return _triton_ops(split_decodes)
        return CPU_OPS if device_type == "cpu" and cpu_paged.cpu_paged_available() else TORCH_OPS
    if backend == "torch":
        return TORCH_OPS
    if backend == "cpu":
        if device_type != "cpu":
            raise ValueError(f"kernel backend 'cpu' runs on CPU pools only, not {device_type!r}")
        if not cpu_paged.cpu_paged_available():
            raise ValueError(
                "kernel backend 'cpu' needs its C++ op, which did not build here (see the "
                "log); use 'torch' or 'auto'"
            )
        return CPU_OPS
    if device_type != "cuda" and not triton_interpreter_active():
        raise ValueError(
            f"kernel backend 'triton' needs a CUDA device, or TRITON_INTERPRET=1 set before "
            f"pagedserve.kernels is imported, to run on {device_type!r}; use 'torch' or 'auto'"
        )
    return _triton_ops(split_decodes)
