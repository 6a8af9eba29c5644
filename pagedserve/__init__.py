"""pagedserve: a distributed LLM serving cluster on Ray with a paged KV cache.

Public names load lazily so that light commands (``pagedserve kv-calc``) never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC_NAMES: dict[str, str] = {
    "LLM": "pagedserve.workers.offline.llm",
    "SamplingParams": "pagedserve.workers.protocol.sampling",
    "GuidedSpec": "pagedserve.workers.protocol.guided",
    "RequestOutput": "pagedserve.workers.engine.outputs",
    "CompletionOutput": "pagedserve.workers.engine.outputs",
    "Client": "pagedserve.cluster.client",
    "AsyncClient": "pagedserve.cluster.client",
}

__all__ = ["__version__", *_PUBLIC_NAMES]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports lazily
    from pagedserve.cluster.client import AsyncClient, Client  # noqa: F401
    from pagedserve.workers.engine.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from pagedserve.workers.offline.llm import LLM  # noqa: F401
    from pagedserve.workers.protocol.guided import GuidedSpec  # noqa: F401
    from pagedserve.workers.protocol.sampling import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    module_name = _PUBLIC_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
