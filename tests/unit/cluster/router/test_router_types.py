"""The router's request and failure types come from the protocol (`workers/protocol/`), so that
light modules (API errors, gRPC conversion, benches) never import `RouterCore` and Ray with it,
and never reach them through a router module that only uses them."""

from __future__ import annotations

import ast
from pathlib import Path

from pagedserve.workers.protocol import errors, requests

REPO = Path(__file__).resolve().parents[4]
TYPE_NAMES = {"GenerateRequest", "NoWorkerAvailable", "WorkerLost"}
ROUTER_MODULES = {"pagedserve.cluster.router.router", "pagedserve.cluster.router.types"}


def _imports_from_router(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ROUTER_MODULES
        for alias in node.names
    }


def test_no_module_imports_the_router_types_from_the_router():
    assert set(vars(errors)) | set(vars(requests)) >= TYPE_NAMES
    sources = [
        p
        for folder in ("pagedserve", "cluster", "workers", "bench", "tests", "scripts")
        for p in (REPO / folder).rglob("*.py")
    ]
    offenders = {
        str(p.relative_to(REPO)): sorted(names)
        for p in sources
        if (names := _imports_from_router(p) & TYPE_NAMES)
    }
    assert offenders == {}
