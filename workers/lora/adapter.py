"""One LoRA adapter in PEFT's format, read from a local directory and checked against the model.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` with, per adapted linear,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and the adapted layer computes ``W x + (lora_alpha / r) * B (A x)`` (``lora_alpha / sqrt(r)``
with ``use_rslora``). Everything else PEFT can express (DoRA, trained biases, modules saved
whole, per-module rank or alpha patterns) is refused at load, by name, rather than served wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagedserve.workers.protocol.errors import LoraLoadError

# The Llama-family projections an adapter may target (the fused decoder's linears).
LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# PEFT options that change the arithmetic; an adapter using any of them is refused.
_UNSUPPORTED = {
    "use_dora": lambda v: bool(v),
    "bias": lambda v: v not in (None, "none"),
    "modules_to_save": lambda v: bool(v),
    "rank_pattern": lambda v: bool(v),
    "alpha_pattern": lambda v: bool(v),
    "fan_in_fan_out": lambda v: bool(v),
}


@dataclass(frozen=True)
class ModuleShape:
    """One adapted linear's ``in`` and ``out`` features in the base model."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights in host memory: per (layer, target) its A ``[r, in]`` and B
    ``[out, r]`` (float32), its rank and scale.

    Attributes:
        key: ``name@digest``: what the block hash carries (a reload with other weights under
            the same name gets another key, so it never hits the old adapter's KV).
    """

    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: str

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(
    name: str,
    path: str,
    shapes: dict[str, ModuleShape],
    num_layers: int,
    max_rank: int,
) -> LoraAdapter:
    """Read and check the adapter at ``path``.

    Args:
        name: the name requests select it by.
        shapes: the base model's linears by target name (``q_proj``, ...).
        num_layers: the base model's decoder layers.
        max_rank: the largest rank the engine serves (``max_lora_rank``).

    Raises:
        LoraLoadError: a missing or malformed file, an option PEFT has that is not served, a
            rank over ``max_rank``, a target the model lacks, a tensor of the wrong shape.
    """
    directory = Path(path)
    config = _read_config(name, directory)
    rank = _positive_int(name, config, "r")
    if rank > max_rank:
        raise LoraLoadError(f"adapter {name!r}: rank {rank} is over max_lora_rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_weights(name, directory)
    weights = _pair_weights(name, tensors, shapes, num_layers, rank)
    targets = tuple(t for t in LORA_TARGETS if any(key[1] == t for key in weights))
    _check_declared_targets(name, config.get("target_modules"), shapes)
    digest = hashlib.sha256()
    digest.update((directory / CONFIG_FILE).read_bytes())
    digest.update((directory / WEIGHTS_FILE).read_bytes())
    key = f"{name}@{digest.hexdigest()[:16]}"
    return LoraAdapter(name, str(directory), rank, scaling, targets, weights, key)


def _read_config(name: str, directory: Path) -> dict:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise LoraLoadError(f"adapter {name!r}: no {CONFIG_FILE} in {str(directory)!r}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraLoadError(f"adapter {name!r}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraLoadError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraLoadError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for option, unsupported in _UNSUPPORTED.items():
        if unsupported(config.get(option)):
            raise LoraLoadError(f"adapter {name!r}: {option}={config[option]!r} is not supported")
    return config


def _positive_int(name: str, config: dict, field: str) -> int:
    value = config.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoraLoadError(f"adapter {name!r}: {field} must be a positive integer, got {value!r}")
    return value


def _read_weights(name: str, directory: Path) -> dict[str, torch.Tensor]:
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraLoadError(f"adapter {name!r}: no {WEIGHTS_FILE} in {str(directory)!r}")
    try:
        return load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise LoraLoadError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read ({exc})") from None


def _pair_weights(
    name: str,
    tensors: dict[str, torch.Tensor],
    shapes: dict[str, ModuleShape],
    num_layers: int,
    rank: int,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _WEIGHT_NAME.match(tensor_name)
        if match is None:
            raise LoraLoadError(f"adapter {name!r}: unexpected tensor {tensor_name!r}")
        layer, target, half = int(match[1]), match[2], match[3]
        if target not in shapes:
            raise LoraLoadError(
                f"adapter {name!r}: target module {target!r} is not one the model has "
                f"({', '.join(shapes)})"
            )
        if layer >= num_layers:
            raise LoraLoadError(f"adapter {name!r}: layer {layer} past the model's {num_layers}")
        halves.setdefault((layer, target), {})[half] = tensor.float().contiguous()
    if not halves:
        raise LoraLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (layer, target), half in sorted(halves.items()):
        shape = shapes[target]
        a, b = half.get("A"), half.get("B")
        where = f"layer {layer} {target}"
        if a is None or b is None:
            raise LoraLoadError(f"adapter {name!r}: {where} lacks lora_A or lora_B")
        if tuple(a.shape) != (rank, shape.in_features) or tuple(b.shape) != (
            shape.out_features,
            rank,
        ):
            raise LoraLoadError(
                f"adapter {name!r}: {where} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"rank {rank} wants A ({rank}, {shape.in_features}), "
                f"B ({shape.out_features}, {rank})"
            )
        pairs[(layer, target)] = (a, b)
    return pairs


def _check_declared_targets(name: str, declared, shapes: dict[str, ModuleShape]) -> None:
    """A listed target the model does not have is an error even without weights for it."""
    if isinstance(declared, list):
        missing = [t for t in declared if t.split(".")[-1] not in shapes]
        if missing:
            raise LoraLoadError(
                f"adapter {name!r}: target modules {missing} are not ones the model has "
                f"({', '.join(shapes)})"
            )


def model_shapes(model: torch.nn.Module) -> dict[str, ModuleShape]:
    """The adaptable linears of a Llama-family HF model, by target name (its first layer's)."""
    layer = model.model.layers[0]
    shapes = {}
    for target in LORA_TARGETS:
        parent = (
            layer.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
        )
        linear = getattr(parent, target, None)
        if linear is not None:
            out_features, in_features = linear.weight.shape
            shapes[target] = ModuleShape(int(in_features), int(out_features))
    return shapes
