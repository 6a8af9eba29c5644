"""Imports go one way: the front door (`pagedserve.cli`) → `bench` → `cluster` → `workers` →
`kernels`. A module imports only from its own layer or the layers below it (every import,
those inside functions too); the tests' shared helpers (`tests/support`) import no benchmark.

The layers are the packages `pyproject.toml` maps (`pagedserve.cluster` is `cluster/`, and so
on); `pagedserve.proto` (generated messages) sits below them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# Highest first: each layer may import what comes after it, never what comes before.
LAYERS = [
    ("pagedserve.cli", [ROOT / "pagedserve" / "cli.py", ROOT / "pagedserve" / "__main__.py"]),
    ("pagedserve.bench", [ROOT / "bench"]),
    ("pagedserve.cluster", [ROOT / "cluster"]),
    ("pagedserve.workers", [ROOT / "workers"]),
    ("pagedserve.kernels", [ROOT / "pagedserve" / "kernels"]),
    ("pagedserve.proto", [ROOT / "pagedserve" / "proto"]),
]


def python_files(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        found.extend([path] if path.is_file() else sorted(path.rglob("*.py")))
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def layer_of(module: str) -> int | None:
    for rank, (package, _) in enumerate(LAYERS):
        if module == package or module.startswith(package + "."):
            return rank
    return None


def upward_imports(rank: int, files: list[Path]) -> list[str]:
    wrong = []
    for path in files:
        for line, module in imported_modules(path):
            target = layer_of(module)
            if target is not None and target < rank:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                wrong.append(f"{where}:{line} imports {module}")
    return wrong


@pytest.mark.parametrize("rank", range(1, len(LAYERS)), ids=[p for p, _ in LAYERS[1:]])
def test_no_layer_imports_one_above_it(rank):
    files = python_files(LAYERS[rank][1])
    assert files, f"no files found for {LAYERS[rank][0]}"
    assert upward_imports(rank, files) == []


def test_the_tests_shared_helpers_import_no_benchmark():
    files = python_files([ROOT / "tests" / "support"])
    bench = [p for p, _ in LAYERS].index("pagedserve.bench")
    assert upward_imports(bench + 1, files) == []


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "engine.py"
    module.write_text("def f():\n    from pagedserve.cluster.router import RouterCore\n")
    workers = [p for p, _ in LAYERS].index("pagedserve.workers")
    wrong = upward_imports(workers, [module])
    assert len(wrong) == 1 and "pagedserve.cluster.router" in wrong[0]
