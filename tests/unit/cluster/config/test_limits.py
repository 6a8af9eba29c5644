"""The backpressure limits of `LimitsConfig`: validated, handed to the workers, reported."""

import pytest

from pagedserve.cluster.config import ClusterConfig, LimitsConfig
from pagedserve.cluster.router.types import BackpressureLimits
from pagedserve.workers.engine.config import EngineConfig


def test_workers_get_the_cluster_queue_bound():
    config = ClusterConfig(
        engine=EngineConfig(block_size=8),
        limits=LimitsConfig(max_waiting_per_worker=7),
    )
    assert config.worker_engine.max_waiting == 7 and config.worker_engine.block_size == 8
    assert config.engine.max_waiting is None  # offline engines stay unbounded
    assert config.limits.backpressure == BackpressureLimits(
        max_waiting_per_worker=7, max_inflight=1024, retry_after_s=1.0
    )


def test_limits_can_be_off_and_load_from_yaml_data():
    limits = {"max_inflight": None, "max_waiting_per_worker": None}
    config = ClusterConfig.from_dict({"limits": limits})
    assert config.worker_engine.max_waiting is None and config.limits.max_inflight is None


@pytest.mark.parametrize(
    "field, value", [("max_inflight", 0), ("max_waiting_per_worker", -1), ("retry_after_s", 0)]
)
def test_bad_limits_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        LimitsConfig(**{field: value})
