"""Imports go one way: the front door (`pagedserve.cli`) → `bench` → `cluster` → `workers` →
`kernels`. A module imports only from its own layer or the layers below it (every import,
those inside functions too); the tests' shared helpers (`tests/support`) import no benchmark.

The layers are the packages `pyproject.toml` maps (`pagedserve.cluster` is `cluster/`, and so
on); `pagedserve.proto` (generated messages) sits below them all.

Inside `cluster/` and `workers/` the subpackages import each other both ways (the engine and
the KV cache manager, the router and the routing policies), with two exceptions kept here
(`INNER_RULES`): the router's side (`router/`, `routing/`, `index/`, `pool/`) imports neither
the front ends (`api/`) nor the `serve` process (`serve/`) that sit above it, and nothing of the
engine's side imports the worker actor (`worker/`) or the offline front door (`offline/`) built
on top of it (only `telemetry/`, which names the worker's stream types, may).

The protocol (`workers/protocol/`: what crosses a process boundary) may be imported from
everywhere, so it imports nothing of the project but its own modules and the torch-free helpers
in `PROTOCOL_HELPERS` (each named with what it lends and importing nothing of the project
itself): no cycle can run through it, and no process pays for more than the messages.
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

# (what is checked, the files, the packages they may not import)
INNER_RULES = [
    (
        "the router side imports no front end",
        [ROOT / "cluster" / name for name in ("router", "routing", "index", "pool")],
        ["pagedserve.cluster.api", "pagedserve.cluster.serve"],
    ),
    (
        "the engine side imports no worker actor",
        [
            path
            for path in sorted((ROOT / "workers").iterdir())
            if path.name not in {"worker", "telemetry", "offline", "__pycache__"}
            and (path.suffix == ".py" or (path / "__init__.py").exists())
        ],
        ["pagedserve.workers.worker", "pagedserve.workers.offline"],
    ),
]


PROTOCOL = "pagedserve.workers.protocol"
# Modules outside the protocol that it may import → what it takes from each.
PROTOCOL_HELPERS = {
    "pagedserve.workers.kv.memory": "`blocks_needed`, to check a handoff's KV shape",
    "pagedserve.workers.beam.checks": "`check_beam_search`, SamplingParams' beam field checks",
}


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
    module.write_text("def f():\n    from pagedserve.cluster.router.router import RouterCore\n")
    workers = [p for p, _ in LAYERS].index("pagedserve.workers")
    wrong = upward_imports(workers, [module])
    assert len(wrong) == 1 and "pagedserve.cluster.router.router" in wrong[0]


def forbidden_imports(files: list[Path], forbidden: list[str]) -> list[str]:
    wrong = []
    for path in files:
        for line, module in imported_modules(path):
            if any(module == name or module.startswith(name + ".") for name in forbidden):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                wrong.append(f"{where}:{line} imports {module}")
    return wrong


@pytest.mark.parametrize(
    ("paths", "forbidden"), [rule[1:] for rule in INNER_RULES], ids=[r[0] for r in INNER_RULES]
)
def test_no_subpackage_imports_one_above_it(paths, forbidden):
    files = python_files(paths)
    assert all(path.exists() for path in paths) and files
    assert forbidden_imports(files, forbidden) == []


def test_the_inner_check_sees_an_import_of_the_actor(tmp_path):
    module = tmp_path / "scheduler.py"
    module.write_text("from pagedserve.workers.worker.stream import DeltaBuffer\n")
    (_, _, forbidden) = INNER_RULES[1]
    assert len(forbidden_imports([module], forbidden)) == 1


def project_imports(files: list[Path]) -> list[tuple[str, str]]:
    """(where, module) of every import of a project module (`pagedserve.*`) in the files."""
    found = []
    for path in files:
        for line, module in imported_modules(path):
            if module == "pagedserve" or module.startswith("pagedserve."):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append((f"{where}:{line}", module))
    return found


def outside_the_protocol(files: list[Path]) -> list[str]:
    return [
        f"{where} imports {module}"
        for where, module in project_imports(files)
        if not module.startswith(PROTOCOL + ".") and module not in PROTOCOL_HELPERS
    ]


def test_the_protocol_imports_only_itself_and_its_helpers():
    files = python_files([ROOT / "workers" / "protocol"])
    assert files
    assert outside_the_protocol(files) == []


def test_the_protocol_helpers_import_nothing_of_the_project():
    helpers = [
        ROOT / "workers" / (name.removeprefix("pagedserve.workers.").replace(".", "/") + ".py")
        for name in PROTOCOL_HELPERS
    ]
    assert all(path.exists() for path in helpers)
    assert project_imports(helpers) == []


def test_the_protocol_check_sees_an_import_of_the_engine(tmp_path):
    module = tmp_path / "stream.py"
    module.write_text("from pagedserve.workers.engine.outputs import RequestDelta\n")
    assert len(outside_the_protocol([module])) == 1
