"""`ClusterConfig`'s lease and stream-buffer fields: defaults, validation naming the fields."""

import pytest

from pagedserve.cluster.config import ClusterConfig


def test_defaults_and_yaml_data():
    config = ClusterConfig()
    assert config.lease_timeout_s == 10.0 and config.max_buffered_deltas == 64
    config = ClusterConfig.from_dict({"lease_timeout_s": 4.0, "max_buffered_deltas": 8})
    assert (config.lease_timeout_s, config.max_buffered_deltas) == (4.0, 8)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_lease_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="lease_timeout_s"):
        ClusterConfig(lease_timeout_s=value)


def test_a_lease_must_outlast_four_stats_polls():
    ClusterConfig(stats_interval_s=0.5, lease_timeout_s=2.0)
    with pytest.raises(ValueError, match=r"lease_timeout_s \(1.9\).*stats_interval_s \(0.5\)"):
        ClusterConfig(stats_interval_s=0.5, lease_timeout_s=1.9)


def test_the_buffer_bound_is_named():
    with pytest.raises(ValueError, match="max_buffered_deltas"):
        ClusterConfig(max_buffered_deltas=0)
