"""`import pagedserve.kernels` leaves Triton alone until a Triton kernel is asked for."""

from __future__ import annotations

import subprocess
import sys

import pagedserve.kernels as kernels

PROBE = """
import sys
import pagedserve.kernels as kernels
assert kernels.get_kernel_ops("torch", "cpu") is kernels.TORCH_OPS
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("pagedserve.kernels."))
print(" ".join(loaded))
"""


def test_importing_the_package_and_the_torch_backend_import_no_triton():
    # A fresh interpreter: this test process may have imported Triton already.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    assert "triton" not in out
    assert not {"block_ops", "decode", "kv_write", "prefill"} & {m.rsplit(".", 1)[-1] for m in out}


def test_triton_names_resolve_on_first_use_to_the_kernel_modules():
    from pagedserve.kernels import decode, kv_write

    assert kernels.write_kv is kv_write.write_kv
    assert kernels.paged_decode_attention is decode.paged_decode_attention
    assert {"write_kv", "copy_blocks"} <= set(dir(kernels))
