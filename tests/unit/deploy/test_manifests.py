"""deploy/k8s: every manifest parses, renders and validates; the objects fit together."""

from __future__ import annotations

import copy
import tomllib
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml
from unit.deploy.manifests import (
    K8S,
    KUBERNETES_VERSION,
    REPO,
    find,
    ray_containers,
    serve_config,
)

from pagedserve.cli import build_parser
from pagedserve.cluster.api.grpc.backlog import backlog_env_vars
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.pool.spec import WorkerSpec
from pagedserve.workers.model.registry import DEFAULT_MODEL
from pagedserve.workers.process import drain_node

OVERLAYS = ("cpu-demo", "gpu", "gpu-tp2")
ALL = ("base", *OVERLAYS)
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# RayService upgrade strategies KubeRay knows (the CRD types the field as a plain string).
UPGRADE_STRATEGIES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


def core_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [obj for obj in objects if not obj["apiVersion"].startswith("ray.io/")]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {var["name"]: var.get("value") for var in container.get("env", [])}


def ports_of(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


# ----------------------------------------------------------------------- parsing
def test_every_manifest_file_parses():
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        assert documents, f"{path} is empty"
        for doc in documents:
            assert isinstance(doc, dict | list), f"{path}: a document is neither map nor list"


@pytest.mark.parametrize("name", ALL)
def test_renders_the_expected_objects(rendered, name):
    ids = {(obj["kind"], obj["metadata"]["name"]) for obj in rendered[name]}
    expected = {
        ("RayService", "pagedserve"),
        ("ConfigMap", "otel-collector-config"),
        ("Deployment", "otel-collector"),
        ("Service", "otel-collector"),
        ("Deployment", "jaeger"),
        ("Service", "jaeger"),
        ("ServiceAccount", "prometheus"),
        ("Role", "prometheus-pod-discovery"),
        ("RoleBinding", "prometheus-pod-discovery"),
        ("ConfigMap", "prometheus-config"),
        ("Deployment", "prometheus"),
        ("Service", "prometheus"),
    }
    if name == "cpu-demo":
        expected |= {("Namespace", "pagedserve-demo")}
    if name in ("gpu", "gpu-tp2"):
        expected |= {("Namespace", "pagedserve"), ("PersistentVolumeClaim", "pagedserve-models")}
    assert ids == expected


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_puts_everything_in_its_namespace(rendered, name):
    namespace = find(rendered[name], "Namespace")["metadata"]["name"]
    for obj in rendered[name]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]


# -------------------------------------------------------------------- validation
@pytest.mark.parametrize("name", ALL)
def test_core_objects_validate_for_the_pinned_kubernetes(rendered, name):
    objects = core_objects(rendered[name])
    assert len(objects) >= 11
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", ALL)
def test_ray_pod_templates_validate_as_core_pod_templates(rendered, name):
    """The CRD embeds pod specs loosely; Kubernetes' own schema checks every field."""
    rayservice = find(rendered[name], "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster["workerGroupSpecs"]]
    for template in templates:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "check"},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_kubernetes_validation_is_strict():
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80, "targetPrt": 8080}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", ALL)
def test_rayservice_validates_against_the_kuberay_crd(rendered, crd_schemas, name):
    rayservice = find(rendered[name], "RayService")
    assert rayservice["apiVersion"] == crd_schemas["RayService"]["apiVersion"]
    crd_schemas["RayService"]["validator"].validate(rayservice)


@pytest.mark.parametrize("name", ALL)
def test_its_raycluster_validates_against_the_kuberay_crd(rendered, crd_schemas, name):
    """KubeRay creates a RayCluster from `rayClusterConfig`: that object must be valid too."""
    rayservice = find(rendered[name], "RayService")
    raycluster = {
        "apiVersion": crd_schemas["RayCluster"]["apiVersion"],
        "kind": "RayCluster",
        "metadata": {"name": "pagedserve-raycluster-abcde"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    crd_schemas["RayCluster"]["validator"].validate(raycluster)


def test_crd_validation_rejects_unknown_fields(rendered, crd_schemas):
    rayservice = copy.deepcopy(find(rendered["gpu"], "RayService"))
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        crd_schemas["RayService"]["validator"].validate(rayservice)


# ------------------------------------------------------------------ the Ray side
@pytest.mark.parametrize("name", ALL)
def test_ray_version_matches_the_installed_ray(rendered, name):
    cluster = find(rendered[name], "RayService")["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__


@pytest.mark.parametrize(
    ("name", "variant"),
    [("base", "gpu"), ("gpu", "gpu"), ("gpu-tp2", "gpu"), ("cpu-demo", "cpu")],
)
def test_ray_pods_run_the_project_image_of_their_variant(rendered, name, variant):
    for container in ray_containers(find(rendered[name], "RayService")):
        assert container["image"] == f"pagedserve:{PROJECT_VERSION}-{variant}"


@pytest.mark.parametrize("name", ("base", "gpu"))
def test_gpu_worker_group(rendered, name):
    cluster = find(rendered[name], "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert cluster["enableInTreeAutoscaling"] is True
    # Every worker actor takes a whole GPU: the group must be able to hold all of them.
    args = serve_config(rendered[name])["applications"][0]["args"]
    assert args["placement"]["worker_num_gpus"] == 1
    assert args["scaling"]["num_workers"] <= group["maxReplicas"]
    assert args["placement"]["worker_num_cpus"] <= float(resources["limits"]["cpu"])
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


def test_tp2_worker_pods_each_hold_one_whole_group(rendered):
    """A worker of `tensor_parallel_size` k reserves k times `worker_num_gpus` and
    `worker_num_cpus` as one actor (`cluster/pool/spec.py`): one pod must hold all of it."""
    cluster = find(rendered["gpu-tp2"], "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    config = ClusterConfig.from_dict(serve_config(rendered["gpu-tp2"])["applications"][0]["args"])
    spec = WorkerSpec.of(config)
    assert config.engine.tensor_parallel_size == 2
    assert (spec.num_gpus, spec.num_cpus) == (2, 8)
    assert int(limits["nvidia.com/gpu"]) == spec.num_gpus
    assert float(limits["cpu"]) >= spec.num_cpus
    assert (
        config.scaling.max_workers <= group["maxReplicas"]
        and group["minReplicas"] >= config.scaling.min_workers
    )


def test_cpu_demo_has_no_gpus_and_room_for_its_actors(rendered):
    cluster = find(rendered["cpu-demo"], "RayService")["spec"]["rayClusterConfig"]
    args = serve_config(rendered["cpu-demo"])["applications"][0]["args"]
    (group,) = cluster["workerGroupSpecs"]
    for container in ray_containers(find(rendered["cpu-demo"], "RayService")):
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "tolerations" not in group["template"]["spec"]
    worker_cpus = float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    # The worker actors plus the prefix index (1 CPU to schedule) fit the minimum group.
    assert (
        args["scaling"]["num_workers"] * args["placement"]["worker_num_cpus"] + 1
        <= worker_cpus * group["minReplicas"]
    )


@pytest.mark.parametrize("name", ["base", "cpu-demo"])
def test_base_and_cpu_demo_serve_the_default_model(rendered, name):
    """The built-in real model, named (never null: that would silently follow the default)."""
    engine = serve_config(rendered[name])["applications"][0]["args"]["engine"]
    assert engine["model"] == DEFAULT_MODEL == "smollm2-135m"
    assert ClusterConfig.from_dict({"engine": engine}).engine.model == DEFAULT_MODEL


@pytest.mark.parametrize("name", ALL)
def test_ports_agree_with_the_serve_config(rendered, name):
    rayservice = find(rendered[name], "RayService")
    config = serve_config(rendered[name])
    head, *workers = ray_containers(rayservice)
    head_ports = ports_of(head)
    # gRPC leaves through KubeRay's <name>-head-svc, which exposes the head container's ports.
    assert head_ports["grpc"] == config["grpc_options"]["port"] == 9000
    assert head_ports["serve"] == config["http_options"]["port"] == 8000
    (http_port,) = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert http_port == {"name": "serve", "port": config["http_options"]["port"]}
    for container in (head, *workers):
        assert ports_of(container)["metrics"] == 8080
        assert ports_of(container)["serve"] == 8000


@pytest.mark.parametrize("name", ALL)
def test_upgrade_strategy_lets_streams_finish(rendered, name):
    spec = find(rendered[name], "RayService")["spec"]
    assert spec["upgradeStrategy"]["type"] in UPGRADE_STRATEGIES
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    (router,) = serve_config(rendered[name])["applications"][0]["deployments"]
    # The old cluster outlives the switch by longer than the Router waits for its streams.
    assert spec["rayClusterDeletionDelaySeconds"] > router["graceful_shutdown_timeout_s"]


@pytest.mark.parametrize("name", ALL)
def test_ray_pods_drain_their_workers_before_ray_stops(rendered, name):
    """A pod being removed runs `pagedserve drain-node` first; it waits longer than a worker's
    drain takes, and Kubernetes waits longer than it before it kills the pod."""
    args = serve_config(rendered[name])["applications"][0]["args"]
    grace_s = ClusterConfig.from_dict(
        {"drain_grace_s": args["failure"]["drain_grace_s"]}
    ).failure.drain_grace_s
    cluster = find(rendered[name], "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    for pod in pods:
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "pagedserve"  # the project's console script, on the image's PATH
        parsed = build_parser().parse_args(command[1:])
        assert parsed.func is drain_node.run
        assert grace_s < parsed.timeout_s < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("name", ["gpu", "gpu-tp2"])
def test_gpu_model_volume_is_mounted_where_the_config_reads_it(rendered, name):
    objects = rendered[name]
    claim = find(objects, "PersistentVolumeClaim")["metadata"]["name"]
    model = serve_config(objects)["applications"][0]["args"]["engine"]["model"]
    cluster = find(objects, "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    # The workers load the weights; the Router (on any pod) loads the tokenizer.
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = pod["containers"][0]["volumeMounts"]
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
        assert mount["readOnly"] is True
        assert model.startswith(mount["mountPath"].rstrip("/") + "/")


# ------------------------------------------------------------------ observability
@pytest.mark.parametrize("name", ALL)
def test_ray_pods_send_traces_to_the_collector(rendered, name):
    objects = rendered[name]
    collector = find(objects, "Service", "otel-collector")
    collector_ports = {p["port"] for p in collector["spec"]["ports"]}
    for container in ray_containers(find(objects, "RayService")):
        env = env_of(container)
        # Serve's gRPC proxies (on every node) refuse messages past the app's request limit.
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(8 * 1024 * 1024)
        assert env["RAY_worker_niceness"] == str(
            ClusterConfig().placement.worker_nice
        )  # actors at 0
        # ... and hold a burst their loop has not taken up yet (`api.grpc.backlog`).
        assert (
            backlog_env_vars(ClusterConfig().limits.max_pending_grpc_calls).items() <= env.items()
        )
        endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.hostname == "otel-collector" and endpoint.port in collector_ports
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc" and endpoint.port == 4317
        assert env["OTEL_SERVICE_NAME"] == "pagedserve"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert 0.0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0


@pytest.mark.parametrize("name", ALL)
def test_collector_exports_traces_to_jaeger(rendered, name):
    objects = rendered[name]
    config = yaml.safe_load(
        find(objects, "ConfigMap", "otel-collector-config")["data"]["config.yaml"]
    )
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    for component in ("receivers", "processors", "exporters"):
        for used in pipeline[component]:
            assert used in config[component], f"{used} is not configured"
    host, port = config["exporters"]["otlp/jaeger"]["endpoint"].split(":")
    jaeger = find(objects, "Service", host)
    assert int(port) in {p["port"] for p in jaeger["spec"]["ports"]}
    receivers = config["receivers"]["otlp"]["protocols"]
    deployment = find(objects, "Deployment", "otel-collector")
    container_ports = set(
        ports_of(deployment["spec"]["template"]["spec"]["containers"][0]).values()
    )
    for protocol in receivers.values():
        assert int(protocol["endpoint"].rsplit(":", 1)[1]) in container_ports


@pytest.mark.parametrize("name", ALL)
def test_prometheus_scrapes_the_metrics_port_of_every_ray_pod(rendered, name):
    objects = rendered[name]
    config = yaml.safe_load(
        find(objects, "ConfigMap", "prometheus-config")["data"]["prometheus.yml"]
    )
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "ray"]
    keep = {
        rule["source_labels"][0]: rule["regex"]
        for rule in job["relabel_configs"]
        if rule.get("action") == "keep"
    }
    label_rule = "__meta_kubernetes_pod_label_app_kubernetes_io_name"
    rayservice = find(objects, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster["workerGroupSpecs"]]
    for template in templates:
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == keep[label_rule]
        assert keep["__meta_kubernetes_pod_container_port_name"] in ports_of(
            template["spec"]["containers"][0]
        )
    # Pod discovery may read pods in its own namespace: Role + RoleBinding to its account.
    role = find(objects, "Role")
    assert {"pods"} == set(role["rules"][0]["resources"])
    binding = find(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    deployment = find(objects, "Deployment", "prometheus")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", account)
    # kustomize's namespace transformer puts the account in the overlay's namespace.
    sa_namespace = find(objects, "ServiceAccount", account)["metadata"].get("namespace")
    assert subject.get("namespace") == sa_namespace


@pytest.mark.parametrize("name", ALL)
def test_services_select_pods_and_ports_that_exist(rendered, name):
    objects = rendered[name]
    deployments = [obj for obj in objects if obj["kind"] == "Deployment"]
    for service in (obj for obj in objects if obj["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (target,) = [
            d
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selector.items() <= target["spec"]["selector"]["matchLabels"].items()
        named = ports_of(target["spec"]["template"]["spec"]["containers"][0])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, f"{service['metadata']['name']}: {port}"


@pytest.mark.parametrize("name", ALL)
def test_configmap_volumes_name_configmaps_that_exist(rendered, name):
    objects = rendered[name]
    configmaps = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "ConfigMap"}
    for deployment in (obj for obj in objects if obj["kind"] == "Deployment"):
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
