"""Render our kustomizations the way `kubectl kustomize` does, for machines without kubectl.

    python deploy/render.py deploy/k8s/overlays/gpu > gpu.yaml

It implements the part of kustomize that `deploy/k8s` uses, with kustomize's semantics, and
refuses everything else by name, so that it can never silently disagree with kubectl:

- `resources`: YAML files (several documents each) and folders holding a kustomization;
- `patches`: from `path` or inline `patch`, optionally with a `target` selector (group, version,
  kind, name and namespace as anchored regular expressions, `labelSelector` as `k=v,...`);
  a patch that is a list is JSON 6902 (RFC 6902 ops), a mapping is a strategic merge patch
  (maps merge recursively, `null` deletes a key, `$patch: delete|replace`; a list of mappings
  that all carry `name` merges by name, as kustomize does for our objects; other lists are
  replaced);
- `namespace` (metadata.namespace of namespaced kinds, the name of Namespace objects,
  RoleBinding subjects named `default`);
- `labels` (`pairs` into metadata.labels; selectors and templates are left alone);
- `commonAnnotations`;
- `images` (`name` → `newName` / `newTag` / `digest` in every `containers` / `initContainers`
  list, custom resources included).

Transformers run in kustomize's order: patches, namespace, labels, annotations, images; each
kustomization first renders its resources (sub-kustomizations fully) and then applies its own.
Output is sorted in kustomize's default ("legacy") kind order. It is the same set of objects
that `kubectl kustomize` prints; only key order and YAML styling may differ.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "namespace",
    "labels",
    "commonAnnotations",
    "images",
}

# Kinds kustomize treats as cluster-scoped among those a deployment could plausibly hold.
CLUSTER_SCOPED_KINDS = {
    "APIService",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "IngressClass",
    "MutatingWebhookConfiguration",
    "Namespace",
    "PersistentVolume",
    "PriorityClass",
    "RuntimeClass",
    "StorageClass",
    "ValidatingWebhookConfiguration",
}

# kustomize's legacy output order: these kinds first (in this order), then every other kind,
# then the webhook configurations last.
ORDER_FIRST = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


TARGET_FIELDS = {"group", "version", "kind", "name", "namespace", "labelSelector"}


class RenderError(ValueError):
    """A kustomization this renderer cannot render exactly as kustomize would."""


# --------------------------------------------------------------------------- loading
def find_kustomization(folder: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        candidate = folder / name
        if candidate.is_file():
            return candidate
    raise RenderError(f"{folder}: no kustomization file ({', '.join(KUSTOMIZATION_FILES)})")


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in `path`, each checked to be a Kubernetes object."""
    with path.open(encoding="utf-8") as f:
        documents = [doc for doc in yaml.safe_load_all(f) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= doc.keys():
            raise RenderError(f"{path}: every document needs apiVersion, kind and metadata")
    return documents


def object_id(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata", {})
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


# ------------------------------------------------------------------------- rendering
def render(folder: str | Path) -> list[dict[str, Any]]:
    """The objects the kustomization in `folder` builds, in kustomize's output order.

    Raises:
        RenderError: an unsupported field, a missing file, a patch that matches nothing, or
            two objects with the same id.
    """
    return sort_legacy(_build(Path(folder).resolve(), stack=()))


def _build(folder: Path, stack: tuple[Path, ...]) -> list[dict[str, Any]]:
    if folder in stack:
        raise RenderError(f"{folder}: kustomization cycle through {' -> '.join(map(str, stack))}")
    path = find_kustomization(folder)
    with path.open(encoding="utf-8") as f:
        kustomization = yaml.safe_load(f) or {}
    unsupported = sorted(set(kustomization) - SUPPORTED_FIELDS)
    if unsupported:
        raise RenderError(f"{path}: fields not supported by this renderer: {unsupported}")

    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = (folder / entry).resolve()
        if target.is_dir():
            objects.extend(_build(target, stack + (folder,)))
        elif target.is_file():
            objects.extend(load_documents(target))
        else:
            raise RenderError(f"{path}: resource {entry!r} does not exist")
    _check_unique(objects, path)

    for patch in kustomization.get("patches", []):
        apply_patch_entry(objects, patch, folder, path)
    if "namespace" in kustomization:
        set_namespace(objects, kustomization["namespace"])
    for label_set in kustomization.get("labels", []):
        add_labels(objects, label_set, path)
    if "commonAnnotations" in kustomization:
        for obj in objects:
            annotations = obj["metadata"].setdefault("annotations", {})
            annotations.update(_strings(kustomization["commonAnnotations"]))
    for image in kustomization.get("images", []):
        set_image(objects, image, path)
    _check_unique(objects, path)
    return objects


def _check_unique(objects: list[dict[str, Any]], path: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        key = object_id(obj)
        if key in seen:
            raise RenderError(f"{path}: two objects with the id {key}")
        seen.add(key)


def _strings(mapping: dict[str, Any]) -> dict[str, str]:
    for key, value in mapping.items():
        if not isinstance(value, str):
            raise RenderError(f"label/annotation {key!r} must be a string, got {value!r}")
    return dict(mapping)


def sort_legacy(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kustomize's legacy order: kind priority, then group/version/kind, namespace, name."""

    def key(obj: dict[str, Any]) -> tuple[int, str, str, str]:
        kind = obj["kind"]
        if kind in ORDER_FIRST:
            rank = ORDER_FIRST.index(kind)
        elif kind in ORDER_LAST:
            rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
        else:
            rank = len(ORDER_FIRST)
        api_version, kind, namespace, name = object_id(obj)
        return (rank, f"{api_version}/{kind}", namespace, name)

    return sorted(objects, key=key)


# --------------------------------------------------------------------------- patches
def apply_patch_entry(
    objects: list[dict[str, Any]], entry: dict[str, Any], folder: Path, path: Path
) -> None:
    """Apply one `patches:` entry to every object it targets; it must target at least one."""
    unknown = sorted(set(entry) - {"path", "patch", "target"})
    if unknown:
        raise RenderError(f"{path}: unsupported patch fields {unknown}")
    if ("path" in entry) == ("patch" in entry):
        raise RenderError(f"{path}: a patch needs exactly one of `path` and `patch`")
    if "path" in entry:
        patch_file = folder / entry["path"]
        if not patch_file.is_file():
            raise RenderError(f"{path}: patch file {entry['path']!r} does not exist")
        text = patch_file.read_text(encoding="utf-8")
    else:
        text = entry["patch"]
    patch = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(patch, list):
        if target is None:
            raise RenderError(f"{path}: a JSON 6902 patch needs a target")
        matched = [obj for obj in objects if matches(obj, target)]
        for obj in matched:
            apply_json6902(obj, patch)
    elif isinstance(patch, dict):
        if target is None:
            target = {
                "kind": re.escape(patch["kind"]),
                "name": re.escape(patch["metadata"]["name"]),
            }
        matched = [obj for obj in objects if matches(obj, target)]
        for obj in matched:
            merged = strategic_merge(obj, _without_identity(patch, obj))
            obj.clear()
            obj.update(merged)
    else:
        raise RenderError(f"{path}: a patch must be a list (JSON 6902) or a mapping")
    if not matched:
        raise RenderError(f"{path}: patch target {target} matches no object")


def _without_identity(patch: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    """A targeted strategic merge patch never renames or re-kinds what it patches."""
    patch = copy.deepcopy(patch)
    patch.pop("apiVersion", None)
    patch.pop("kind", None)
    meta = patch.get("metadata")
    if isinstance(meta, dict):
        meta.pop("name", None)
        meta.pop("namespace", None)
        if not meta:
            patch.pop("metadata")
    return patch


def matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    """Does `obj` satisfy a kustomize patch target selector?"""
    unknown = sorted(set(target) - TARGET_FIELDS)
    if unknown:
        raise RenderError(f"unsupported target selector fields {unknown}")
    group, _, version = obj["apiVersion"].rpartition("/")
    meta = obj["metadata"]
    values = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": meta["name"],
        "namespace": meta.get("namespace", ""),
    }
    for field, value in values.items():
        if field in target and not re.fullmatch(target[field], value):
            return False
    if "labelSelector" in target:
        labels = meta.get("labels", {})
        for requirement in target["labelSelector"].split(","):
            key, sep, value = requirement.strip().partition("=")
            if not sep or "!" in key:
                raise RenderError(f"only `key=value` label selectors are supported: {requirement}")
            if labels.get(key) != value.lstrip("="):
                return False
    return True


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer must start with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, list):
            index = int(part)
            if not 0 <= index < len(doc):
                raise RenderError(f"JSON patch path {path!r}: index {index} out of range")
            doc = doc[index]
        elif isinstance(doc, dict):
            if part not in doc:
                raise RenderError(f"JSON patch path {path!r}: no key {part!r}")
            doc = doc[part]
        else:
            raise RenderError(f"JSON patch path {path!r} goes through a scalar")
    return doc


def apply_json6902(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Apply RFC 6902 ops in place (add, remove, replace, move, copy, test)."""
    for op in ops:
        kind, path = op.get("op"), op.get("path")
        if kind not in {"add", "remove", "replace", "move", "copy", "test"} or path is None:
            raise RenderError(f"bad JSON 6902 op {op}")
        if kind in {"move", "copy"}:
            source = _resolve(obj, _pointer(op["from"]), op["from"])
            value = copy.deepcopy(source)
            if kind == "move":
                _remove(obj, op["from"])
            _add(obj, path, value)
        elif kind == "test":
            if _resolve(obj, _pointer(path), path) != op["value"]:
                raise RenderError(f"JSON patch test failed at {path!r}")
        elif kind == "remove":
            _remove(obj, path)
        elif kind == "replace":
            parts = _pointer(path)
            if not parts:
                raise RenderError("replacing the whole object is not supported")
            parent = _resolve(obj, parts[:-1], path)
            _resolve(parent, parts[-1:], path)  # must exist
            key = int(parts[-1]) if isinstance(parent, list) else parts[-1]
            parent[key] = copy.deepcopy(op["value"])
        else:
            _add(obj, path, copy.deepcopy(op["value"]))


def _add(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = _pointer(path)
    if not parts:
        raise RenderError("replacing the whole object is not supported")
    parent = _resolve(obj, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise RenderError(f"JSON patch path {path!r}: index {index} out of range")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise RenderError(f"JSON patch path {path!r}: parent is a scalar")


def _remove(obj: dict[str, Any], path: str) -> None:
    parts = _pointer(path)
    parent = _resolve(obj, parts[:-1], path)
    _resolve(parent, parts[-1:], path)  # must exist
    if isinstance(parent, list):
        del parent[int(parts[-1])]
    else:
        del parent[parts[-1]]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Merge `patch` into a copy of `base` the way kustomize merges our objects."""
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        if directive == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        if directive not in (None, "merge"):
            raise RenderError(f"unsupported $patch directive {directive!r} on a mapping")
        if not isinstance(base, dict):
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if key == "$patch":
                continue
            if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(merged.get(key), value)
        return merged
    if isinstance(patch, list) and isinstance(base, list) and _merge_by_name(base, patch):
        return _merge_named_lists(base, patch)
    return copy.deepcopy(patch)


def _merge_by_name(base: list[Any], patch: list[Any]) -> bool:
    items = base + patch
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def _merge_named_lists(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[Any]:
    merged = copy.deepcopy(base)
    for item in patch:
        names = [element["name"] for element in merged]
        if item.get("$patch") == "delete":
            if item["name"] in names:
                del merged[names.index(item["name"])]
        elif item["name"] in names:
            index = names.index(item["name"])
            merged[index] = strategic_merge(merged[index], item)
        else:
            merged.append(strategic_merge(None, item))
    return merged


# ---------------------------------------------------------------------- transformers
def set_namespace(objects: Iterable[dict[str, Any]], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace  # kustomize renames Namespace objects
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            continue
        obj["metadata"]["namespace"] = namespace
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            # kustomize sets the namespace only on subjects named "default".
            for subject in obj.get("subjects", []):
                if subject.get("name") == "default":
                    subject["namespace"] = namespace


def add_labels(objects: Iterable[dict[str, Any]], label_set: dict[str, Any], path: Path) -> None:
    unknown = sorted(set(label_set) - {"pairs", "includeSelectors", "includeTemplates"})
    if unknown:
        raise RenderError(f"{path}: unsupported labels fields {unknown}")
    if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
        raise RenderError(f"{path}: labels with includeSelectors/includeTemplates not supported")
    pairs = _strings(label_set.get("pairs", {}))
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)


def split_image(image: str) -> tuple[str, str, str]:
    """`registry:5000/name:tag@sha256:...` → (name with registry, ':tag' or '', '@digest' or '')."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, at + digest


def set_image(objects: Iterable[dict[str, Any]], image: dict[str, Any], path: Path) -> None:
    unknown = sorted(set(image) - {"name", "newName", "newTag", "digest"})
    if unknown or "name" not in image:
        raise RenderError(f"{path}: an images entry needs `name` (and newName/newTag/digest)")

    def update(container: dict[str, Any]) -> None:
        if not isinstance(container.get("image"), str):
            return
        name, tag, digest = split_image(container["image"])
        if name != image["name"]:
            return
        name = image.get("newName", name)
        if "digest" in image:
            tag, digest = "", "@" + image["digest"]
        elif "newTag" in image:
            tag, digest = ":" + str(image["newTag"]), ""
        container["image"] = name + tag + digest

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        if isinstance(container, dict):
                            update(container)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for obj in objects:
        if obj["kind"] != "CustomResourceDefinition":
            walk(obj)


# ------------------------------------------------------------------------------ CLI
class _Dumper(yaml.SafeDumper):
    """Block style, with multi-line strings (serveConfigV2) as `|` literals."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Render a kustomization in deploy/k8s like `kubectl kustomize` does."
    )
    parser.add_argument("folder", help="a folder with a kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        objects = render(args.folder)
    except (RenderError, OSError, yaml.YAMLError) as error:
        print(f"render: error: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(dump(objects))
    return 0


if __name__ == "__main__":
    sys.exit(main())
