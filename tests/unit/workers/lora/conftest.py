import pytest
from support.lora import make_adapter

# Different ranks and targets in one batch: a slot's rows must use its own adapter's A and B.
ADAPTERS = {
    "attn4": (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp8": (8, ("gate_proj", "up_proj", "down_proj")),
    "all2": (2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="session")
def adapters(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loras")
    return {
        name: make_adapter(directory, name, rank, targets, seed=i + 1)
        for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }
