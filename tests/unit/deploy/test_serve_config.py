"""The RayService's serveConfigV2: a valid Serve config whose import paths and args are real."""

from __future__ import annotations

import importlib

import pytest
from ray.serve.schema import ServeDeploySchema
from unit.deploy.manifests import find, serve_config

from pagedserve.cluster.api import serve_options
from pagedserve.cluster.api.config import split_app_args
from pagedserve.cluster.app import Router, build_app
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.routing.policies import make_policy

ALL = ("base", "cpu-demo", "gpu")
APP_BUILDER = "pagedserve.cluster.app:build_app"


def import_path(path: str):
    """Resolve `module:attr` or `module.attr`, as Serve does."""
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def the_app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


@pytest.mark.parametrize("name", ALL)
def test_is_a_valid_serve_deploy_config(rendered, name):
    config = serve_config(rendered[name])
    schema = ServeDeploySchema.model_validate(config)
    assert [app.name for app in schema.applications] == ["pagedserve"]
    assert schema.applications[0].route_prefix == "/"


@pytest.mark.parametrize("name", ALL)
def test_grpc_servicers_are_the_apps_own(rendered, name):
    grpc = serve_config(rendered[name])["grpc_options"]
    # One list, in cluster/api/serve_options.py: the manifests may not drift from it.
    assert grpc["grpc_servicer_functions"] == serve_options.GRPC_SERVICER_FUNCTIONS
    assert grpc["port"] == 9000
    for path in grpc["grpc_servicer_functions"]:
        assert callable(import_path(path)), path


@pytest.mark.parametrize("name", ALL)
def test_import_path_is_the_app_builder(rendered, name):
    app = the_app(serve_config(rendered[name]))
    assert app["import_path"] == APP_BUILDER
    assert import_path(APP_BUILDER) is build_app


@pytest.mark.parametrize("name", ALL)
def test_args_build_the_app(rendered, name):
    """What Serve does with import_path + args; binding starts no actors."""
    app = the_app(serve_config(rendered[name]))
    application = build_app(app["args"])

    assert application is not None
    # Serve applies `deployments:` overrides by name: each must name a deployment of the app.
    assert {d["name"] for d in app["deployments"]} == {Router.name}


@pytest.mark.parametrize("name", ALL)
def test_args_are_a_cluster_config_with_a_real_routing_policy(rendered, name):
    args = the_app(serve_config(rendered[name]))["args"]
    cluster, api = split_app_args(args)
    config = ClusterConfig.from_dict(cluster)

    policy = make_policy(config.routing.routing_policy, **config.routing.routing_options)
    assert policy.name == config.routing.routing_policy
    # kv_aware counts blocks; its block size must be the engine's.
    assert getattr(policy, "block_size", config.engine.block_size) == config.engine.block_size
    assert config.namespace == "pagedserve" and config.name == "pagedserve"
    assert not api.auth.enabled


@pytest.mark.parametrize("name", ("base", "gpu"))
def test_gpu_configs_put_one_worker_on_each_gpu(rendered, name):
    config = ClusterConfig.from_dict(
        split_app_args(the_app(serve_config(rendered[name]))["args"])[0]
    )
    assert config.placement.worker_num_gpus == 1
    assert config.engine.device == "cuda"
    assert config.engine.attention_backend in ("triton", "auto")


def test_gpu_overlay_serves_a_checkpoint_from_the_volume(rendered):
    config = ClusterConfig.from_dict(
        split_app_args(the_app(serve_config(rendered["gpu"]))["args"])[0]
    )
    assert config.engine.model.startswith("/models/")
    assert config.engine.dtype == "bfloat16"


def test_cpu_demo_is_small(rendered):
    config = ClusterConfig.from_dict(
        split_app_args(the_app(serve_config(rendered["cpu-demo"]))["args"])[0]
    )
    assert config.engine.model == "smollm2-135m"  # built in: baked into the image, no download
    assert config.engine.device == "cpu" and config.placement.worker_num_gpus == 0
    assert config.scaling.num_workers == 2
    assert config.engine.num_kv_blocks is not None and config.engine.num_kv_blocks <= 256


@pytest.mark.parametrize("name", ALL)
def test_router_is_autoscaled_from_two_replicas(rendered, name):
    """Two Routers at least (a replica's death cuts only its own streams), autoscaled below
    the point where a replica refuses: its target is at most its `max_inflight`."""
    app = the_app(serve_config(rendered[name]))
    config = ClusterConfig.from_dict(split_app_args(app["args"])[0])
    (router,) = app["deployments"]
    scaling = router["autoscaling_config"]
    assert "num_replicas" not in router
    assert 2 <= scaling["min_replicas"] <= scaling["max_replicas"]
    assert 0 < scaling["target_ongoing_requests"] <= (config.limits.max_inflight or 1024)


@pytest.mark.parametrize("name", ALL)
def test_the_worker_pool_is_elastic_within_its_worker_group(rendered, name):
    """`min_workers`/`max_workers` in the app's args; the KubeRay worker group, autoscaled
    in-tree, can hold the pool at its largest plus the one extra worker a rolling
    replacement runs, and keeps no more pods than the smallest pool needs."""
    args = the_app(serve_config(rendered[name]))["args"]
    config = ClusterConfig.from_dict(split_app_args(args)[0])
    low, high = config.scaling.worker_bounds
    assert (args["scaling"]["min_workers"], args["scaling"]["max_workers"]) == (low, high)
    assert low <= config.scaling.num_workers <= high and low < high
    cluster = find(rendered[name], "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    pod_cpus = float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    if config.placement.worker_num_gpus:  # one GPU, one pod per worker
        assert group["minReplicas"] == low
        assert group["maxReplicas"] >= high + 1
    else:  # CPU workers share pods, with the prefix index (1 CPU)
        assert (high + 1) * config.placement.worker_num_cpus + 1 <= pod_cpus * group["maxReplicas"]
        assert low * config.placement.worker_num_cpus + 1 <= pod_cpus * group["minReplicas"]


def test_gpu_overlay_shows_a_prefill_decode_layout(rendered):
    """The gpu overlay disaggregates: one prefill worker, two decode workers, one GPU pod
    each from the start (the worker group starts with every worker of the layout)."""
    config = ClusterConfig.from_dict(
        split_app_args(the_app(serve_config(rendered["gpu"]))["args"])[0]
    )
    assert config.scaling.disaggregated
    assert (config.scaling.prefill_workers, config.scaling.decode_workers) == (1, 2)
    assert (
        config.scaling.prefill_workers + config.scaling.decode_workers
        <= config.scaling.worker_bounds[0]
    )
    (group,) = find(rendered["gpu"], "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] >= config.scaling.prefill_workers + config.scaling.decode_workers
    # The other layouts stay without P/D: every worker mixed.
    for name in ("base", "cpu-demo"):
        args = the_app(serve_config(rendered[name]))["args"]
        assert not ClusterConfig.from_dict(split_app_args(args)[0]).scaling.disaggregated
