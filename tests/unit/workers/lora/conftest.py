import pytest


@pytest.fixture(scope="session")
def adapters(lora_adapters):
    return lora_adapters
