import pytest
import ray
from ray.cluster_utils import Cluster
from support.cluster import WORKER_RESOURCE


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node plus three worker nodes, one worker slot each."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(3):
        cluster.add_node(num_cpus=1, resources={WORKER_RESOURCE: 1.0})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
