import pytest
from support.engine import ReferenceModel, build_qwen2_checkpoint, load


@pytest.fixture(scope="session")
def tiny_llama():
    loaded = load("tiny-llama")
    return loaded, ReferenceModel(loaded)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-random")
    build_qwen2_checkpoint(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen2(qwen2_dir):
    loaded = load(qwen2_dir)
    return loaded, ReferenceModel(loaded)
