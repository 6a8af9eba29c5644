"""Fixtures for the deploy/ tests: the overlays rendered by kubectl kustomize, the CRD schemas."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml
from unit.deploy.manifests import CRD_DIR, KUSTOMIZATIONS, kustomize, strict


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization, rendered once: name → objects (treat as read-only)."""
    return {name: kustomize(folder) for name, folder in KUSTOMIZATIONS.items()}


@pytest.fixture(scope="session")
def crd_schemas() -> dict[str, Any]:
    """kind → apiVersion and a validator of the strict schema of the storage version."""
    if not CRD_DIR.is_dir():
        pytest.fail(
            f"KubeRay CRD schemas not found: {CRD_DIR} is absent. The repository carries them "
            "(ray.io_rayservices.yaml and ray.io_rayclusters.yaml, from ray-project/kuberay): "
            "restore the folder from git.",
            pytrace=False,
        )
    schemas = {}
    for path in sorted(CRD_DIR.glob("ray.io_*.yaml")):
        # libyaml's loader where there is one: the CRDs are large (about 1 MB each).
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        crd = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
        for version in crd["spec"]["versions"]:
            if version.get("storage"):
                kind = crd["spec"]["names"]["kind"]
                api_version = f"{crd['spec']['group']}/{version['name']}"
                schema = strict(version["schema"]["openAPIV3Schema"])
                schemas[kind] = {
                    "apiVersion": api_version,
                    "validator": jsonschema.Draft7Validator(schema),
                }
    missing = {"RayService", "RayCluster"} - schemas.keys()
    assert not missing, f"{CRD_DIR} lacks the CRDs of {sorted(missing)}"
    return schemas
