"""How many Router replicas Serve runs, from the cluster config."""

from __future__ import annotations

import pytest

from pagedserve.cluster.app import build_app, router_scaling
from pagedserve.cluster.config import ClusterConfig


def test_a_fixed_count_by_default():
    assert router_scaling(ClusterConfig()) == {"num_replicas": 1}
    assert router_scaling(ClusterConfig(router_replicas=3)) == {"num_replicas": 3}
    assert router_scaling(ClusterConfig(router_replicas=2, router_max_replicas=2)) == {
        "num_replicas": 2
    }


def test_autoscaling_between_the_floor_and_the_ceiling_at_half_the_stream_limit():
    config = ClusterConfig(router_replicas=2, router_max_replicas=6, max_inflight=100)
    assert router_scaling(config) == {
        "autoscaling_config": {
            "min_replicas": 2,
            "max_replicas": 6,
            "target_ongoing_requests": 50,
        }
    }


def test_the_app_carries_the_scaling():
    app = build_app({"router_replicas": 2, "engine": {"model": "tiny-llama"}})
    assert app._bound_deployment._deployment_config.num_replicas == 2


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"router_replicas": 0}, "router_replicas must be >= 1"),
        ({"router_replicas": 3, "router_max_replicas": 2}, "router_max_replicas (2) must be >="),
    ],
)
def test_bad_counts_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ClusterConfig(**options)
