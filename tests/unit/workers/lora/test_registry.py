"""`LoraRegistry` on its own: host memory holds `max_cpu_loras` parsed adapters (least recently
used out, read again from disk when next needed, refused if its files changed), slots change
hands least recently used first, never to an adapter of the same step."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve.workers.lora.adapter import model_shapes
from pagedserve.workers.lora.config import LoraConfig
from pagedserve.workers.lora.registry import LoraRegistry
from pagedserve.workers.model.tiny_llama import build_tiny_llama
from pagedserve.workers.protocol.errors import LoraLoadError


@pytest.fixture(scope="module")
def shapes():
    return model_shapes(build_tiny_llama(seed=0))


def registry(shapes, **config) -> LoraRegistry:
    cpu = torch.device("cpu")
    return LoraRegistry(LoraConfig(**config), "tiny-llama", shapes, 4, cpu, torch.float32)


def test_host_memory_holds_max_cpu_loras_and_rereads_the_rest(shapes, adapters, tmp_path):
    paths = {name: tmp_path / name for name in adapters}
    for name, adapter in adapters.items():
        shutil.copytree(adapter.path, paths[name])
    loras = registry(shapes, max_loras=2, max_cpu_loras=1)
    keys = {name: loras.load(name, str(paths[name])).key for name in ("attn4", "mlp8")}
    assert list(loras._host) == [keys["mlp8"]]  # attn4 left host memory
    assert loras.assign({keys["attn4"]}) == {keys["attn4"]: 0}  # read again from disk
    assert loras.assign({keys["mlp8"], keys["attn4"]}) == {keys["attn4"]: 0, keys["mlp8"]: 1}
    assert loras.resident() == ["attn4", "mlp8"]
    # Another adapter takes the least recently used slot not in its step.
    all2 = loras.load("all2", str(paths["all2"])).key
    assert loras.assign({keys["mlp8"], all2}) == {keys["mlp8"]: 1, all2: 0}
    assert loras.num_slot_loads == 3
    # attn4's files replaced: the next read is refused, not served with other weights.
    shutil.rmtree(paths["attn4"])
    shutil.copytree(adapters["mlp8"].path, paths["attn4"])
    with pytest.raises(LoraLoadError, match="'attn4': its files at .* changed"):
        loras.assign({keys["attn4"]})
    with pytest.raises(RuntimeError, match="3 adapters in one step, max_loras 2"):
        loras.assign({keys["mlp8"], all2, keys["attn4"]})


def test_a_name_is_not_the_models_and_holds_one_set_of_weights(shapes, adapters):
    loras = registry(shapes)
    with pytest.raises(LoraLoadError, match="not the model's"):
        loras.load("tiny-llama", adapters["mlp8"].path)
    key = loras.load("a", adapters["mlp8"].path).key
    assert loras.load("a", adapters["mlp8"].path).key == key  # the same files: a no-op
    with pytest.raises(LoraLoadError, match="already loaded with other weights"):
        loras.load("a", adapters["attn4"].path)
    assert loras.names() == {"a": key}
    assert loras.paths() == {"a": adapters["mlp8"].path}  # where a joining worker reads it
    loras.unload("a")
    assert loras.paths() == {}
