"""Building this project's C++ CPU ops with torch's extension machinery, once per machine.

Each op's shared library is named by the instruction set it was compiled for and a hash of its
source, and cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`):
it is rebuilt only when the source or flags change, and checkouts with different sources
(worktrees, versions) sharing one extensions directory each keep their own build instead of
rebuilding in turn. The build needs only the C++ compiler torch's own extension machinery uses
(`c++`, found at run time).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

# Vector flags per torch CPU capability (what torch itself dispatches to on this machine).
# CPU_CAPABILITY_* selects the matching `at::vec::Vectorized` implementation, as in torch's own
# per-capability kernel builds.
ARCH_FLAGS = {
    "AVX512": [
        *("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
        *("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def build_and_load(stem: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> None:
    """Build (first time on a machine) and load ``source`` as ``<stem>_<capability>_<hash>``,
    registering its ops with torch (`torch.ops.<library>`).

    Raises:
        RuntimeError, OSError, ImportError: when the build or the load fails.
    """
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    flags = [*ARCH_FLAGS.get(capability, []), *extra_cflags]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    cpp_extension.load(
        name=f"{stem}_{capability.lower()}_{digest}",
        sources=[str(source)],
        extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def loads(load: Callable[[], None], fallback: str) -> bool:
    """Whether ``load`` (a cached `build_and_load` call) succeeds; a failure is logged with
    what is used instead (``fallback``)."""
    try:
        load()
    except (RuntimeError, OSError, ImportError) as exc:
        logger.warning("%s: %s", fallback, exc)
        return False
    return True
