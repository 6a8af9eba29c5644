"""`ClusterConfig` by concern: each section checks its own fields; plain data in the nested
shape (or the flat shape of older files) becomes one config, and goes back the same."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pagedserve.cluster.config import (
    SECTION_OF,
    SECTIONS,
    ClusterConfig,
    PlacementConfig,
    RoutingConfig,
    ScalingConfig,
    nest,
)


def test_every_field_is_in_exactly_one_section():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(SECTION_OF)
    assert set(SECTIONS) <= {f.name for f in dataclasses.fields(ClusterConfig)}


def test_nested_data_builds_each_section_and_round_trips():
    data = {
        "engine": {"block_size": 8},
        "scaling": {"num_workers": 3, "router_replicas": 2},
        "routing": {"routing_policy": "round_robin", "enable_pull": False},
        "limits": {"tenants": {"*": {"weight": 2.0}}},
        "name": "app",
    }
    config = ClusterConfig.from_dict(data)
    assert config.scaling == ScalingConfig(num_workers=3, router_replicas=2)
    assert config.routing == RoutingConfig(routing_policy="round_robin", enable_pull=False)
    assert config.actors.pool_name == "app-worker-pool"
    assert config.worker_engine.fair_share.default_weight == 2.0
    assert ClusterConfig.from_dict(config.to_dict()) == config


def test_a_flat_key_is_taken_into_its_section():
    assert nest({"num_workers": 2, "name": "x"}) == {"scaling": {"num_workers": 2}, "name": "x"}
    config = ClusterConfig.from_dict({"num_workers": 3, "placement": {"worker_num_cpus": 2.0}})
    assert config.scaling.num_workers == 3 and config.placement.worker_num_cpus == 2.0


def test_a_field_given_both_ways_is_refused_naming_where_it_lives():
    with pytest.raises(ValueError, match=r"num_workers is given twice.*scaling\.num_workers"):
        ClusterConfig.from_dict({"num_workers": 2, "scaling": {"num_workers": 3}})


def test_a_field_in_the_wrong_section_says_where_it_lives():
    with pytest.raises(ValueError, match=r"unknown scaling keys: enable_pull \(enable_pull is "):
        ClusterConfig.from_dict({"scaling": {"enable_pull": False}})
    with pytest.raises(ValueError, match="unknown cluster config keys: colour"):
        ClusterConfig.from_dict({"colour": "blue"})


@pytest.mark.parametrize(
    ("section", "fields", "named"),
    [
        (ScalingConfig, {"num_workers": 0}, "num_workers must be >= 1"),
        (ScalingConfig, {"prefill_workers": 3}, "prefill_workers (3) + decode_workers"),
        (RoutingConfig, {"routing_policy": "random"}, "routing_policy must be one of"),
        (RoutingConfig, {"tier_disk_block_cost": -1.0}, "tier_disk_block_cost must be"),
        (RoutingConfig, {"pull_min_blocks": 0}, "pull_min_blocks must be >= 1"),
        (PlacementConfig, {"worker_nice": 20}, "worker_nice must be in -20..19"),
        (PlacementConfig, {"control_cpus": "x"}, "control_cpus"),
    ],
)
def test_each_section_checks_its_own_fields(section, fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        section(**fields)


def test_a_check_that_spans_two_sections_is_the_cluster_config_s():
    placement = PlacementConfig(worker_cpus="0-1", worker_threads=2)
    ClusterConfig(scaling=ScalingConfig(num_workers=1), placement=placement)
    with pytest.raises(ValueError, match=r"worker_threads \(2\) is more than the 1 core"):
        ClusterConfig(scaling=ScalingConfig(num_workers=2), placement=placement)
