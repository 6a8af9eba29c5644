"""Helpers for the deploy/ tests: paths, `kubectl kustomize`, lookups in rendered objects."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "cpu-demo": K8S / "overlays" / "cpu-demo",
    "gpu": K8S / "overlays" / "gpu",
    "gpu-tp2": K8S / "overlays" / "gpu-tp2",
}
# KubeRay's CRDs, carried as data (deploy/kuberay-crds/README.md: their source and licence).
CRD_DIR = DEPLOY / "kuberay-crds"
# The Kubernetes version whose schemas the core objects must satisfy (kubernetes-validate).
KUBERNETES_VERSION = "1.33.0"


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize folder` renders (kubectl's own kustomize, v5).

    Skips the calling test, saying why, only where kubectl is absent (this project's machine
    image and CI have it); a kustomization kubectl refuses fails the test with kubectl's words.
    """
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are rendered by kubectl kustomize")
    result = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {folder} failed:\n{result.stderr}"
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def serve_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The RayService's `serveConfigV2`, parsed."""
    return yaml.safe_load(find(objects, "RayService")["spec"]["serveConfigV2"])


def ray_containers(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """The Ray container (the first) of the head and of every worker group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]
    ]
    return [template["spec"]["containers"][0] for template in templates]


def strict(schema: Any) -> Any:
    """A copy of a CRD schema that rejects unknown fields, as `kubectl apply` does.

    The API server prunes fields a structural schema does not declare, and kubectl's strict
    field validation turns that into an error; plain JSON schema would let them through.
    """
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                visit(child)
        for key in ("items", "additionalProperties", "not"):
            visit(node.get(key))
        for key in ("anyOf", "allOf", "oneOf"):
            visit(node.get(key, []))

    visit(schema)
    return schema
