"""Reading PEFT adapters: what is refused at load, by name, and that a refusal disturbs
nothing; the adapter's key in the block hash."""

from __future__ import annotations

import json
import shutil

import pytest
from support.engine import finish_clean

from pagedserve.workers.kv.block_hash import cache_key, hash_full_blocks, lora_key_of
from pagedserve.workers.lora.adapter import load_adapter, model_shapes
from pagedserve.workers.lora.config import parse_lora_modules
from pagedserve.workers.model.tiny_llama import build_tiny_llama
from pagedserve.workers.protocol.errors import LoraLoadError


@pytest.fixture(scope="module")
def shapes():
    return model_shapes(build_tiny_llama(seed=0))


def test_a_peft_adapter_reads_with_its_rank_scale_and_targets(adapters, shapes):
    adapter = load_adapter("mlp8", adapters["mlp8"].path, shapes, 4, max_rank=16)
    assert (adapter.rank, adapter.scaling) == (8, 2.0)  # lora_alpha 16 / r 8
    assert adapter.targets == ("gate_proj", "up_proj", "down_proj")
    assert len(adapter.weights) == 4 * 3
    assert adapter.key.startswith("mlp8@")
    again = load_adapter("mlp8", adapters["mlp8"].path, shapes, 4, max_rank=16)
    assert again.key == adapter.key


def _copy(adapters, tmp_path, name="attn4"):
    path = tmp_path / name
    shutil.copytree(adapters[name].path, path)
    return path


def test_malformed_directories_are_refused_naming_the_problem(adapters, shapes, tmp_path):
    with pytest.raises(LoraLoadError, match="'x': no adapter_config.json"):
        load_adapter("x", str(tmp_path / "missing"), shapes, 4, 16)
    path = _copy(adapters, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraLoadError, match="adapter_model.safetensors cannot be read"):
        load_adapter("x", str(path), shapes, 4, 16)
    path = _copy(adapters, tmp_path, "mlp8")
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(LoraLoadError, match="adapter_config.json is not JSON"):
        load_adapter("x", str(path), shapes, 4, 16)


def test_a_rank_over_max_lora_rank_is_refused(adapters, shapes):
    with pytest.raises(LoraLoadError, match="rank 8 is over max_lora_rank 4"):
        load_adapter("mlp8", adapters["mlp8"].path, shapes, 4, max_rank=4)


def test_a_target_the_model_lacks_is_refused(adapters, shapes, tmp_path):
    path = _copy(adapters, tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraLoadError, match=r"target modules \['c_attn'\] are not ones"):
        load_adapter("x", str(path), shapes, 4, 16)


def test_options_that_change_the_arithmetic_are_refused(adapters, shapes, tmp_path):
    path = _copy(adapters, tmp_path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["use_dora"] = True
    (path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraLoadError, match="use_dora=True is not supported"):
        load_adapter("x", str(path), shapes, 4, 16)


def test_a_bad_adapter_at_run_time_leaves_the_engine_serving(tiny_llama, adapters, tmp_path):
    from pagedserve import LLM, SamplingParams

    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=4, num_kv_blocks=32, attention_backend="torch")
    llm.engine.load_lora("attn4", adapters["attn4"].path)
    with pytest.raises(LoraLoadError, match="over max_lora_rank"):
        llm.engine.load_lora("big", str(_rank_over(adapters, tmp_path)))
    with pytest.raises(LoraLoadError, match="already loaded with other weights"):
        llm.engine.load_lora("attn4", adapters["mlp8"].path)
    assert list(llm.engine.lora_adapters()) == ["attn4"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("r", [1, 2, 3, 4, 5], params, lora="attn4")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    finish_clean(llm)


def _rank_over(adapters, tmp_path):
    path = _copy(adapters, tmp_path, "mlp8")
    config = json.loads((path / "adapter_config.json").read_text())
    config["r"] = 32
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_the_adapter_key_is_a_hash_key():
    """Base, salt-only and adapter keys never collide; the adapter key comes back out."""
    tokens = list(range(8))
    base = hash_full_blocks(tokens, 4, cache_key("m", None))
    salted = hash_full_blocks(tokens, 4, cache_key("m", "lora:a@1"))
    on_a = hash_full_blocks(tokens, 4, cache_key("m", None, "a@1"))
    on_b = hash_full_blocks(tokens, 4, cache_key("m", None, "b@1"))
    a_salted = hash_full_blocks(tokens, 4, cache_key("m", "s", "a@1"))
    assert len({h[0] for h in (base, salted, on_a, on_b, a_salted)}) == 5
    assert lora_key_of(cache_key("m", "s", "a@1")) == "a@1"
    assert lora_key_of(cache_key("m", "lora:a@1")) is None


def test_lora_modules_are_name_equals_path():
    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
