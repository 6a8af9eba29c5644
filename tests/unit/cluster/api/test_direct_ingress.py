"""When the Router replica serves HTTP itself (direct ingress), and what Serve is told so."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest
from ray.serve import config as serve_config
from ray.serve._private import constants as serve_constants

from pagedserve.cluster.api import direct_ingress
from pagedserve.cluster.api.config import ApiConfig, split_app_args
from pagedserve.cluster.api.direct_ingress import (
    REPLICA_ENV,
    controller_env,
    why_through_proxy,
)
from pagedserve.cluster.api.serve_options import ROUTER_ENV_VARS
from pagedserve.cluster.app import bind_router
from pagedserve.cluster.config import ClusterConfig, ScalingConfig
from pagedserve.cluster.ports import free_port
from pagedserve.cluster.serve import cli
from pagedserve.workers import ray_internals


def test_a_local_cluster_with_one_router_replica_serves_http_from_the_replica():
    assert why_through_proxy(None, ScalingConfig(), through_proxy=False) is None
    one = ScalingConfig(router_replicas=1, router_max_replicas=1)
    assert why_through_proxy(None, one, through_proxy=False) is None


@pytest.mark.parametrize(
    ("address", "scaling", "through_proxy", "why"),
    [
        (None, ScalingConfig(), True, "--http-through-proxy"),
        ("10.0.0.1:6379", ScalingConfig(), False, "joined cluster"),
        (None, ScalingConfig(router_replicas=2), False, "several Router replicas"),
        (None, ScalingConfig(router_max_replicas=4), False, "several Router replicas"),
    ],
)
def test_http_goes_through_the_proxy_where_one_replica_cannot_hold_the_port(
    address, scaling, through_proxy, why
):
    assert why in why_through_proxy(address, scaling, through_proxy)


def test_serve_hands_the_replica_exactly_the_http_port_and_stops_it_without_waiting():
    env = controller_env(8000)
    # Serve draws an ingress replica's port from range(MIN, MAX): here only 8000.
    assert range(int(env[direct_ingress.MIN_PORT_ENV]), int(env[direct_ingress.MAX_PORT_ENV])) == (
        range(8000, 8001)
    )
    assert env[direct_ingress.ENABLE_ENV] == REPLICA_ENV[direct_ingress.ENABLE_ENV] == "1"
    assert env[direct_ingress.DRAINING_ENV] == REPLICA_ENV[direct_ingress.DRAINING_ENV] == "0"
    assert env[direct_ingress.QUARANTINE_ENV] == "0"
    source = Path(serve_constants.__file__).read_text()
    for name in env:
        assert f'"{name}"' in source, f"Serve no longer reads {name}"


def test_the_router_deployment_gets_the_replica_environment_only_when_chosen():
    config = ClusterConfig.from_dict({"engine": {"model": "tiny-llama"}})
    for chosen in (True, False):
        app = bind_router(config, ApiConfig(direct_ingress=chosen), object(), object())
        options = app._bound_deployment.ray_actor_options
        env = options["runtime_env"]["env_vars"]
        assert options["num_cpus"] == 0
        assert env == {**ROUTER_ENV_VARS, **(REPLICA_ENV if chosen else {})}


def test_the_api_config_takes_the_choice_and_refuses_a_non_boolean():
    _, api = split_app_args({"direct_ingress": True, "num_workers": 1})
    assert api.direct_ingress is True
    assert ApiConfig().direct_ingress is False
    with pytest.raises(ValueError, match="direct_ingress must be true or false, got 'yes'"):
        ApiConfig(direct_ingress="yes")


def test_the_serve_command_chooses_direct_ingress_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(cli, "with_machine_defaults", lambda data, address, gpus: (data, ""))
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port())]
    base = ["--model", "tiny-llama", "--num-workers", "1", *ports]

    def plan(*more: str) -> cli.ServePlan:
        return cli.checked_plan(parser.parse_args(["serve", *base, *more]), num_gpus=0)

    default = plan()
    assert default.direct_ingress and default.data["direct_ingress"] is True
    proxied = plan("--http-through-proxy")
    assert not proxied.direct_ingress and proxied.data["direct_ingress"] is False
    assert proxied.http_through_proxy == "--http-through-proxy"
    assert not plan("--router-replicas", "2").direct_ingress


def test_the_replica_starts_no_grpc_server_of_its_own(monkeypatch):
    from ray.serve._private import replica

    monkeypatch.setattr(replica, "is_grpc_enabled", replica.is_grpc_enabled)  # restored after
    grpc_on = serve_config.gRPCOptions(port=9000, grpc_servicer_functions=["m.add"])
    assert replica.is_grpc_enabled(grpc_on)
    ray_internals.replica_serves_http_only()
    assert replica.is_grpc_enabled(grpc_on) is False
    # What the replica's server start asks, on this Serve (`_maybe_start_direct_ingress_servers`).
    assert "grpc_enabled = self._ingress and is_grpc_enabled(self._grpc_options)" in (
        inspect.getsource(replica.Replica._maybe_start_direct_ingress_servers)
    )
