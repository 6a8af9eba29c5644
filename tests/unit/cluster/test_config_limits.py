"""The backpressure limits of `ClusterConfig`: validated, handed to the workers, reported."""

import pytest

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router.types import BackpressureLimits
from pagedserve.workers.engine.config import EngineConfig


def test_workers_get_the_cluster_queue_bound():
    config = ClusterConfig(engine=EngineConfig(block_size=8), max_waiting_per_worker=7)
    assert config.worker_engine.max_waiting == 7 and config.worker_engine.block_size == 8
    assert config.engine.max_waiting is None  # offline engines stay unbounded
    assert config.limits == BackpressureLimits(
        max_waiting_per_worker=7, max_inflight=1024, retry_after_s=1.0
    )


def test_limits_can_be_off_and_load_from_yaml_data():
    config = ClusterConfig.from_dict({"max_inflight": None, "max_waiting_per_worker": None})
    assert config.worker_engine.max_waiting is None and config.max_inflight is None


@pytest.mark.parametrize(
    "field, value", [("max_inflight", 0), ("max_waiting_per_worker", -1), ("retry_after_s", 0)]
)
def test_bad_limits_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{field: value})
