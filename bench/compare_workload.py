"""The prompts of `pagedserve bench compare`: windows of real English text, as token ids.

A model with a tokenizer gets real text (a trained model's greedy path through random ids is
an unusual one, full of near ties); the text is the documentation of Python's standard library,
present on every machine, so no download is needed. A model without one (``tiny-llama``, random
weights, a byte tokenizer) gets random ids, as `bench offline` gives it.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable, Sequence

# Modules whose docstrings make the text: long, plain English prose.
TEXT_MODULES: tuple[str, ...] = (
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "decimal",
    "email.message", "functools", "http.client", "inspect", "json", "logging", "pathlib",
    "random", "re", "shutil", "socket", "statistics", "subprocess", "tarfile", "threading",
    "typing", "unittest", "urllib.request", "zipfile",
)  # fmt: skip


def standard_library_text() -> str:
    """The docstrings of `TEXT_MODULES` and of their public classes and functions, in order."""
    parts: list[str] = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            doc = inspect.getdoc(value)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def text_prompts(
    encode: Callable[[str], list[int]],
    num_prompts: int,
    min_len: int,
    max_len: int,
    seed: int,
) -> list[list[int]]:
    """`num_prompts` windows of the text's token ids, lengths uniform in [min_len, max_len]."""
    ids = encode(standard_library_text())
    if len(ids) < 2 * max_len:
        raise RuntimeError(f"the text has {len(ids)} tokens, too few for {max_len}-token prompts")
    rng = random.Random(f"compare/{seed}")
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, allowed_ids: Sequence[int], seed: int
) -> list[list[int]]:
    """Random ids (a model without a tokenizer), lengths uniform in [min_len, max_len]."""
    rng = random.Random(f"compare/{seed}")
    return [
        [rng.choice(allowed_ids) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_prompts)
    ]
