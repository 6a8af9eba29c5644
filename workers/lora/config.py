"""An engine's LoRA settings and the `NAME=PATH` list of adapters to load (no torch: the
config and the command line import it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraConfig:
    """How many adapters an engine holds and how large.

    Attributes:
        max_loras: adapters resident on the device at once (one step serves at most this many).
        max_lora_rank: the largest rank accepted; the device stacks are this wide.
        max_cpu_loras: parsed adapters kept in host memory (LRU); others are re-read from disk.
    """

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 64

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_lora_modules(specs) -> dict[str, str]:
    """``NAME=PATH`` entries (vLLM's ``--lora-modules`` shape) as ``{name: path}``.

    Raises:
        ValueError: an entry without ``=``, an empty side, or a name given twice.
    """
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entries are NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"lora_modules names {name!r} twice")
        modules[name.strip()] = path.strip()
    return modules
