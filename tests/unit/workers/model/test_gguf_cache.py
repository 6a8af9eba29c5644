"""The GGUF conversion cache: converted once, atomically; a half-written model is never trusted.

The conversion itself (transformers dequantizing a GGUF file, ~30 s) is replaced here by a fake
writer; the real one runs once per machine in the real-model tests (`support.real_model`).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from pagedserve.workers.model import gguf_cache
from pagedserve.workers.model.gguf_cache import (
    MANIFEST_NAME,
    checkpoint_dir_for,
    converted_checkpoint,
    is_complete,
    verify_hashes,
)

WEIGHTS = b"\x01" * 4096


class Interrupted(Exception):
    """Stands for a process killed mid-conversion."""


class FakeWriter:
    """Writes a tiny 'checkpoint'; optionally dies after the first file, like a killed process."""

    def __init__(self, die: bool = False) -> None:
        self.calls = 0
        self.die = die
        self.lock = threading.Lock()

    def __call__(self, gguf_path: str, out_dir: str) -> None:
        with self.lock:
            self.calls += 1
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"model_type": "llama"}, f)
        if self.die:
            raise Interrupted("killed while writing the weights")
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(WEIGHTS)


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "src" / "Model.Q4.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return str(path)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def leftovers(cache: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(cache, "models")) if n.startswith(".tmp-"))


def test_converts_once_then_reuses(monkeypatch, gguf, cache):
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    first = converted_checkpoint(gguf, cache)
    second = converted_checkpoint(gguf, cache)
    assert first == second == checkpoint_dir_for(gguf, cache)
    assert writer.calls == 1
    assert os.path.basename(first).startswith("Model.Q4-")
    manifest = json.loads(Path(first, MANIFEST_NAME).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == len(WEIGHTS)
    assert manifest["source"] == os.path.realpath(gguf)
    assert verify_hashes(first) and is_complete(first)
    assert leftovers(cache) == []


def test_an_interrupted_conversion_leaves_nothing_a_later_start_trusts(monkeypatch, gguf, cache):
    monkeypatch.setattr(gguf_cache, "write_checkpoint", FakeWriter(die=True))
    with pytest.raises(Interrupted):
        converted_checkpoint(gguf, cache)
    target = checkpoint_dir_for(gguf, cache)
    assert not os.path.exists(target)  # the half-written files never reached the target
    assert leftovers(cache) == []
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    assert converted_checkpoint(gguf, cache) == target
    assert writer.calls == 1 and verify_hashes(target)


def test_a_killed_process_s_leftovers_are_never_used(monkeypatch, gguf, cache):
    """A kill -9 leaves a temp dir; a non-atomic writer could leave a target without manifest."""
    target = checkpoint_dir_for(gguf, cache)
    os.makedirs(target)
    with open(os.path.join(target, "config.json"), "w") as f:
        f.write("{}")  # half a model, no manifest
    stale_tmp = os.path.join(os.path.dirname(target), f".tmp-{os.path.basename(target)}-dead")
    os.makedirs(stale_tmp)
    assert not is_complete(target)
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    assert converted_checkpoint(gguf, cache) == target
    assert writer.calls == 1 and verify_hashes(target)
    assert not os.path.exists(stale_tmp)


@pytest.mark.parametrize("damage", ["truncate", "delete", "bad manifest", "old format"])
def test_a_damaged_conversion_is_converted_again(monkeypatch, gguf, cache, damage):
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    target = converted_checkpoint(gguf, cache)
    weights, manifest = (os.path.join(target, n) for n in ("model.safetensors", MANIFEST_NAME))
    if damage == "truncate":
        os.truncate(weights, 10)
    elif damage == "delete":
        os.remove(weights)
    elif damage == "bad manifest":
        with open(manifest, "w") as f:
            f.write('{"format": 1, "fil')
    else:
        data = json.loads(Path(manifest).read_text())
        with open(manifest, "w") as f:
            json.dump({**data, "format": 0}, f)
    assert not is_complete(target)
    assert converted_checkpoint(gguf, cache) == target
    assert writer.calls == 2 and verify_hashes(target)


def test_concurrent_callers_convert_once(monkeypatch, gguf, cache):
    """Workers and the router start together: one converts, the others wait and reuse it."""
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(converted_checkpoint(gguf, cache)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert writer.calls == 1


def test_a_changed_source_file_gets_its_own_conversion(monkeypatch, gguf, cache):
    monkeypatch.setattr(gguf_cache, "write_checkpoint", FakeWriter())
    first = converted_checkpoint(gguf, cache)
    with open(gguf, "ab") as f:
        f.write(b"more")
    assert converted_checkpoint(gguf, cache) != first


def test_an_unloadable_gguf_file_names_the_file(gguf, cache):
    with pytest.raises(ValueError, match="cannot load .*Model.Q4.gguf"):
        converted_checkpoint(gguf, cache)
    assert not os.path.exists(checkpoint_dir_for(gguf, cache))
    assert leftovers(cache) == []


def test_copies_of_one_recorded_file_share_one_conversion(tmp_path, gguf, cache):
    """A hash its installer recorded keys the entry by content: another copy of the file (its
    own path and modification time, as in another virtual environment) finds it; without one,
    each path has its own."""
    copy = tmp_path / "other-venv" / "Model.Q4.gguf"
    copy.parent.mkdir()
    copy.write_bytes(Path(gguf).read_bytes())
    os.utime(copy, ns=(1, 1))
    assert checkpoint_dir_for(gguf, cache, "abc") == checkpoint_dir_for(str(copy), cache, "abc")
    assert checkpoint_dir_for(gguf, cache) != checkpoint_dir_for(str(copy), cache)
    assert checkpoint_dir_for(gguf, cache, "abc") != checkpoint_dir_for(gguf, cache, "abd")
    assert checkpoint_dir_for(gguf, cache, "abc") != checkpoint_dir_for(gguf, cache)


def test_a_recorded_file_is_converted_once_for_every_copy(monkeypatch, tmp_path, gguf, cache):
    writer = FakeWriter()
    monkeypatch.setattr(gguf_cache, "write_checkpoint", writer)
    copy = tmp_path / "other-venv" / "Model.Q4.gguf"
    copy.parent.mkdir()
    copy.write_bytes(Path(gguf).read_bytes())
    first = converted_checkpoint(gguf, cache, "abc")
    assert converted_checkpoint(str(copy), cache, "abc") == first
    assert writer.calls == 1
