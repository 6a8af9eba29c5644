"""How many Router replicas Serve runs, from the scaling section of the config."""

from __future__ import annotations

import pytest

from pagedserve.cluster.api.config import ApiConfig
from pagedserve.cluster.app import bind_router, router_scaling
from pagedserve.cluster.config import ClusterConfig, ScalingConfig


def test_a_fixed_count_by_default():
    assert router_scaling(ScalingConfig(), 1024) == {"num_replicas": 1}
    assert router_scaling(ScalingConfig(router_replicas=3), 1024) == {"num_replicas": 3}
    fixed = ScalingConfig(router_replicas=2, router_max_replicas=2)
    assert router_scaling(fixed, 1024) == {"num_replicas": 2}


def test_autoscaling_between_the_floor_and_the_ceiling_at_half_the_stream_limit():
    scaling = ScalingConfig(router_replicas=2, router_max_replicas=6)
    assert router_scaling(scaling, 100) == {
        "autoscaling_config": {
            "min_replicas": 2,
            "max_replicas": 6,
            "target_ongoing_requests": 50,
        }
    }


def test_the_app_carries_the_scaling_and_the_handles_it_was_given():
    config = ClusterConfig.from_dict(
        {"scaling": {"router_replicas": 2}, "engine": {"model": "tiny-llama"}}
    )
    index, pool = object(), object()  # what `build_app` gets from `create_pool`
    app = bind_router(config, ApiConfig(), index, pool)
    assert app._bound_deployment._deployment_config.num_replicas == 2
    args = app._bound_deployment.init_args
    assert args[2] is index and args[3] is pool


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"router_replicas": 0}, "router_replicas must be >= 1"),
        ({"router_replicas": 3, "router_max_replicas": 2}, "router_max_replicas (2) must be >="),
    ],
)
def test_bad_counts_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ScalingConfig(**options)
