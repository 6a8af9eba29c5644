import pytest
import ray
from ray.cluster_utils import Cluster
from support.cluster import TEST_MODEL, WORKER_RESOURCE
from support.engine import ReferenceModel, load


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


@pytest.fixture(scope="session")
def hf_reference() -> ReferenceModel:
    """HF's own attention and cache on the test model: an independent greedy reference, so a
    bug shared by the paged engine run alone and the path under test cannot pass unseen."""
    return ReferenceModel(load(TEST_MODEL))
