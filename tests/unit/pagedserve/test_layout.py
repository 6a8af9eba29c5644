"""No folder at the repository root may share its name with an installed module.

`python -m ...` run from the checkout (as `scripts/test.sh` runs pytest) puts the repository
root first on `sys.path`, so a root folder named like an installed module hides that module
from every library that imports it. transformers 5.25 imports the `kernels` distribution on
every model import, and the attention kernels' folder once sat at the root as `kernels/`:
every test run failed at its first model import. The kernels and the proto stubs now live
under `pagedserve/`.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def root_package_folders() -> list[str]:
    return sorted(
        path.name
        for path in REPO.iterdir()
        if path.is_dir() and not path.name.startswith(".") and (path / "__init__.py").exists()
    )


def test_the_repository_root_is_where_the_layout_says() -> None:
    assert (REPO / "pyproject.toml").exists()
    assert {"pagedserve", "cluster", "workers", "bench"} <= set(root_package_folders())


def test_no_root_folder_hides_an_installed_module() -> None:
    installed = importlib.metadata.packages_distributions()
    hidden = {
        name: installed[name]
        for name in root_package_folders()
        if name in installed and set(installed[name]) != {"pagedserve"}
    }
    assert not hidden, f"root folders named like installed modules: {hidden}"


def test_the_installed_kernels_distribution_is_the_one_transformers_gets() -> None:
    """Checks the guard above against the case that broke: `kernels` is installed here
    (transformers requires it) and imports as itself, not as our attention kernels."""
    owners = importlib.metadata.packages_distributions().get("kernels")
    if not owners:
        pytest.skip("no `kernels` distribution installed (transformers before 5.25)")
    import kernels

    installed_file = importlib.metadata.distribution(owners[0]).locate_file("kernels/__init__.py")
    assert Path(kernels.__file__).resolve() == Path(installed_file).resolve()


def test_no_tracked_file_relies_on_a_folder_beside_the_clone() -> None:
    """A user's clone has nothing beside it: no file may read or point to the `shared` folder
    that CI lays beside the clone, so the data the tests need lives in the repository."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to search")
    outside = "../" + "shared"  # spelled apart so that this file does not find itself
    result = subprocess.run(
        ["git", "grep", "-l", "-F", "-e", outside],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: nothing found
    found = set(result.stdout.split())
    assert not found, f"tracked files that refer to {outside}: {sorted(found)}"
