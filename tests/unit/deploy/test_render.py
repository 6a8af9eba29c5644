"""deploy/render.py: kustomize's semantics for the features our kustomizations use."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from unit.deploy.manifests import DEPLOY, KUSTOMIZATIONS, find

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  labels: {app: web}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - name: app
          image: registry.local:5000/team/web:1.0
          env:
            - {name: A, value: "1"}
            - {name: B, value: "2"}
        - name: sidecar
          image: busybox:1.36
      initContainers:
        - name: init
          image: registry.local:5000/team/web:1.0
"""

CUSTOM = """\
apiVersion: example.io/v1
kind: Widget
metadata:
  name: gadget
spec:
  groups:
    - groupName: a
      size: 1
      template:
        spec:
          containers:
            - name: main
              image: registry.local:5000/team/web:1.0
  text: |
    line one
    line two
"""


def write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text), encoding="utf-8")
    return folder


def kustomization(body: str) -> str:
    head = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
    return head + textwrap.dedent(body)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(
        tmp_path / "base",
        {
            "kustomization.yaml": kustomization("resources: [app.yaml, widget.yaml]\n"),
            "app.yaml": DEPLOYMENT,
            "widget.yaml": CUSTOM,
        },
    )


def overlay(tmp_path: Path, body: str, **files: str) -> Path:
    return write(tmp_path / "overlay", {"kustomization.yaml": kustomization(body), **files})


def test_resources_from_folders_and_files_in_legacy_order(render, base, tmp_path):
    extra = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {ports: [{port: 80}]}\n"
    folder = overlay(tmp_path, "resources: [../base, svc.yaml]\n", **{"svc.yaml": extra})

    kinds = [obj["kind"] for obj in render.render(folder)]

    # Service before Deployment (kustomize's legacy order), unknown kinds after known ones.
    assert kinds == ["Service", "Deployment", "Widget"]


def test_json6902_ops(render, base, tmp_path):
    ops = """\
    - {op: test, path: /spec/groups/0/groupName, value: a}
    - {op: replace, path: /spec/groups/0/size, value: 3}
    - {op: add, path: /spec/groups/-, value: {groupName: b, size: 1}}
    - {op: copy, from: /spec/groups/0/size, path: /spec/copied}
    - {op: move, from: /spec/copied, path: /spec/moved}
    - {op: remove, path: /spec/text}
    - {op: add, path: /metadata/annotations, value: {a~1b: x}}
    """
    body = """\
    resources: [../base]
    patches:
      - path: ops.yaml
        target: {group: example.io, version: v1, kind: Widget, name: gad.*}
    """
    widget = find(render.render(overlay(tmp_path, body, **{"ops.yaml": ops})), "Widget")

    assert widget["spec"]["groups"] == [
        {"groupName": "a", "size": 3, "template": widget["spec"]["groups"][0]["template"]},
        {"groupName": "b", "size": 1},
    ]
    assert widget["spec"]["moved"] == 3 and "copied" not in widget["spec"]
    assert "text" not in widget["spec"]
    assert widget["metadata"]["annotations"] == {"a~1b": "x"}


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ("- {op: test, path: /spec/groups/0/groupName, value: z}", "test failed"),
        ("- {op: replace, path: /spec/nothere, value: 1}", "no key 'nothere'"),
        ("- {op: remove, path: /spec/groups/5}", "out of range"),
    ],
)
def test_json6902_failures_name_the_path(render, base, tmp_path, ops, message):
    body = "resources: [../base]\npatches:\n  - {path: ops.yaml, target: {kind: Widget}}\n"
    with pytest.raises(render.RenderError, match=message):
        render.render(overlay(tmp_path, body, **{"ops.yaml": ops}))


def test_strategic_merge_merges_maps_and_named_lists(render, base, tmp_path):
    patch = """\
    apiVersion: apps/v1
    kind: Deployment
    metadata:
      name: web
      labels: {tier: front}
    spec:
      template:
        spec:
          containers:
            - name: app
              env:
                - {name: B, value: "20"}
                - {name: C, value: "3"}
              resources: {limits: {cpu: "1"}}
            - name: sidecar
              $patch: delete
    """
    body = "resources: [../base]\npatches:\n  - path: patch.yaml\n"
    deployment = find(render.render(overlay(tmp_path, body, **{"patch.yaml": patch})), "Deployment")

    assert deployment["metadata"]["labels"] == {"app": "web", "tier": "front"}
    (app,) = deployment["spec"]["template"]["spec"]["containers"]
    assert app["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "20"},
        {"name": "C", "value": "3"},
    ]
    assert app["resources"] == {"limits": {"cpu": "1"}}
    assert app["image"] == "registry.local:5000/team/web:1.0"


def test_strategic_merge_null_deletes_and_replace_directive(render, base, tmp_path):
    patch = """\
    apiVersion: example.io/v1
    kind: Widget
    metadata: {name: gadget}
    spec:
      text: null
      groups:
        - {groupName: only, size: 9}
    """
    body = "resources: [../base]\npatches:\n  - path: patch.yaml\n"
    widget = find(render.render(overlay(tmp_path, body, **{"patch.yaml": patch})), "Widget")

    # Mappings without `name` are no associative list: the patch's list replaces the old one.
    assert widget["spec"] == {"groups": [{"groupName": "only", "size": 9}]}


def test_namespace_labels_annotations(render, tmp_path):
    objects = """\
    apiVersion: v1
    kind: Namespace
    metadata: {name: placeholder}
    ---
    apiVersion: rbac.authorization.k8s.io/v1
    kind: ClusterRole
    metadata: {name: reader}
    rules: []
    ---
    apiVersion: rbac.authorization.k8s.io/v1
    kind: RoleBinding
    metadata: {name: bind, namespace: old}
    roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: r}
    subjects:
      - {kind: ServiceAccount, name: default}
      - {kind: ServiceAccount, name: other}
    """
    body = """\
    namespace: team
    resources: [objects.yaml]
    labels:
      - pairs: {app.kubernetes.io/part-of: demo}
    commonAnnotations: {owner: me}
    """
    rendered = render.render(overlay(tmp_path, body, **{"objects.yaml": objects}))

    namespace = find(rendered, "Namespace")
    assert namespace["metadata"]["name"] == "team" and "namespace" not in namespace["metadata"]
    assert "namespace" not in find(rendered, "ClusterRole")["metadata"]
    binding = find(rendered, "RoleBinding")
    assert binding["metadata"]["namespace"] == "team"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "default", "namespace": "team"},
        {"kind": "ServiceAccount", "name": "other"},
    ]
    for obj in rendered:
        assert obj["metadata"]["labels"] == {"app.kubernetes.io/part-of": "demo"}
        assert obj["metadata"]["annotations"] == {"owner": "me"}


def test_images_reach_custom_resources_and_keep_registry_ports(render, base, tmp_path):
    body = """\
    resources: [../base]
    images:
      - {name: registry.local:5000/team/web, newName: mirror.io/web, newTag: "2.0"}
      - {name: busybox, digest: "sha256:abc"}
    """
    rendered = render.render(overlay(tmp_path, body))

    pod = find(rendered, "Deployment")["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == ["mirror.io/web:2.0", "busybox@sha256:abc"]
    assert pod["initContainers"][0]["image"] == "mirror.io/web:2.0"
    widget = find(rendered, "Widget")
    assert widget["spec"]["groups"][0]["template"]["spec"]["containers"][0]["image"] == (
        "mirror.io/web:2.0"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("resources: [../base]\nnamePrefix: x-\n", "not supported by this renderer"),
        ("resources: [../base, missing.yaml]\n", "does not exist"),
        ("resources: [../base, ../base]\n", "two objects with the id"),
        (
            "resources: [../base]\npatches:\n  - {patch: '[]', target: {kind: Nothing}}\n",
            "matches no object",
        ),
        (
            "resources: [../base]\nlabels:\n  - {pairs: {a: b}, includeSelectors: true}\n",
            "includeSelectors",
        ),
    ],
)
def test_unsupported_or_wrong_kustomizations_fail_loudly(render, base, tmp_path, body, message):
    with pytest.raises(render.RenderError, match=message):
        render.render(overlay(tmp_path, body))


def test_cli_prints_what_render_returns(render):
    folder = KUSTOMIZATIONS["gpu"]
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "render.py"), str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )

    printed = list(yaml.safe_load_all(result.stdout))
    assert printed == render.render(folder)
    # serveConfigV2 stays a readable block, not one escaped line.
    assert "serveConfigV2: |" in result.stdout


def test_cli_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "render.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )

    assert result.returncode == 1
    assert result.stderr.startswith("render: error:") and "no kustomization" in result.stderr
