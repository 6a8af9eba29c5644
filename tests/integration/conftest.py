import pytest
from support.cluster import TEST_MODEL
from support.engine import ReferenceModel, load
from support.shared_cluster import SHARED


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node plus three worker nodes, one worker slot each, clean, with this module's
    driver connected: the test process's shared cluster (support/shared_cluster.py), without
    Serve."""
    yield SHARED.connect()
    SHARED.disconnect()


@pytest.fixture(scope="module")
def serve_cluster():
    """The shared cluster, clean, with a Serve instance kept from an API module before if there
    was one: what `support.api_app.running_app` deploys its app on."""
    yield SHARED.connect(serve=True)
    SHARED.disconnect()


@pytest.fixture(scope="session")
def hf_reference() -> ReferenceModel:
    """HF's own attention and cache on the test model: an independent greedy reference, so a
    bug shared by the paged engine run alone and the path under test cannot pass unseen."""
    return ReferenceModel(load(TEST_MODEL))
