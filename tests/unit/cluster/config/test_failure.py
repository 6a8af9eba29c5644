"""`FailureConfig`'s lease and `LimitsConfig`'s stream-buffer fields: defaults, validation
naming the fields."""

import pytest

from pagedserve.cluster.config import ClusterConfig, FailureConfig, FailureMode, LimitsConfig


def test_defaults_and_yaml_data():
    config = ClusterConfig()
    assert config.failure.lease_timeout_s == 10.0 and config.limits.max_buffered_deltas == 64
    config = ClusterConfig.from_dict(
        {"failure": {"lease_timeout_s": 4.0}, "limits": {"max_buffered_deltas": 8}}
    )
    assert (config.failure.lease_timeout_s, config.limits.max_buffered_deltas) == (4.0, 8)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_lease_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="lease_timeout_s"):
        FailureConfig(lease_timeout_s=value)


def test_a_lease_must_outlast_four_stats_polls():
    FailureConfig(stats_interval_s=0.5, lease_timeout_s=2.0)
    with pytest.raises(ValueError, match=r"lease_timeout_s \(1.9\).*stats_interval_s \(0.5\)"):
        FailureConfig(stats_interval_s=0.5, lease_timeout_s=1.9)


def test_the_failure_mode_is_an_enum_spelled_as_before():
    assert FailureConfig(on_worker_failure="fail").on_worker_failure is FailureMode.FAIL
    with pytest.raises(ValueError, match="on_worker_failure must be one of"):
        FailureConfig(on_worker_failure="retry")


def test_the_buffer_bound_is_named():
    with pytest.raises(ValueError, match="max_buffered_deltas"):
        LimitsConfig(max_buffered_deltas=0)
