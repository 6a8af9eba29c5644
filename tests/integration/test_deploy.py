"""The cpu-demo overlay's serveConfigV2, deployed the way KubeRay deploys it, streams tokens.

KubeRay PUTs `serveConfigV2` (parsed) to the Ray dashboard's Serve API; Serve starts its
proxies from the config's options, imports `import_path` and calls it with `args`. This test
renders deploy/k8s/overlays/cpu-demo, takes that config, moves the proxies to free local ports
(nothing else changes), sends it through the same API to a local Ray, and streams one
GenerateStream over gRPC — so the manifest's import paths, arguments and servicer functions
are the real ones.
"""

from __future__ import annotations

import copy
import time
import urllib.request

import pytest
import ray
from ray import serve
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
from unit.deploy.manifests import KUSTOMIZATIONS, kustomize, serve_config

from pagedserve.cluster.api.config import split_app_args
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.cluster.ports import free_port
from pagedserve.workers.model.cli import prepare_in_subprocess

MAX_TOKENS = 8
# A failsafe, not a measure: the real model's workers load in seconds on a quiet machine, and
# the suite runs two test processes at once (scripts/test.sh), so leave room for a busy one.
DEPLOY_TIMEOUT_S = 300


def wait_running(app_name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            pytest.fail(f"Serve could not deploy {app_name!r}: {app.message}")
        if time.monotonic() > deadline:
            status = app.status if app else "absent"
            pytest.fail(f"{app_name!r} not RUNNING after {timeout_s} s (status: {status})")
        time.sleep(0.2)


@pytest.fixture
def cpu_demo_config() -> dict:
    objects = kustomize(KUSTOMIZATIONS["cpu-demo"])
    return serve_config(objects)


def test_cpu_demo_serve_config_streams_tokens_over_grpc(cpu_demo_config):
    config = copy.deepcopy(cpu_demo_config)
    (app,) = config["applications"]
    http_port, grpc_port, dashboard_port = free_port(), free_port(), free_port()
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    cluster_args, _ = split_app_args(app["args"])
    # The CPU image converts its model at build time (deploy/Dockerfile.cpu): here too, before
    # the deploy, so that a fresh cache's 30 s conversion does not count against the wait.
    prepare_in_subprocess(cluster_args["engine"]["model"])

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
    )
    try:
        # What KubeRay does with serveConfigV2: PUT it to the dashboard's Serve API.
        ServeSubmissionClient(f"http://127.0.0.1:{dashboard_port}").deploy_applications(config)
        wait_running(app["name"], timeout_s=DEPLOY_TIMEOUT_S)

        with Client(f"127.0.0.1:{grpc_port}", timeout=60) as client:
            assert client.health() == "SERVING"
            deltas = list(
                client.generate_stream(
                    "Paged attention on Kubernetes",
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                )
            )
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as reply:
            assert reply.status == 200
    finally:
        serve.shutdown()
        stop_worker_group(ClusterConfig.from_dict(cluster_args))
        ray.shutdown()

    token_ids = [token for delta in deltas for token in delta.token_ids]
    assert len(token_ids) == MAX_TOKENS
    # Streamed: the tokens came in several messages, not in one at the end.
    assert sum(1 for delta in deltas if delta.token_ids) >= 2
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].worker_id.startswith(f"{cluster_args['name']}-worker-")
