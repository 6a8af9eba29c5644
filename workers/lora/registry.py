"""An engine's LoRA adapters: registered names, parsed copies in host memory, device slots.

    name ──register──► key (name@digest) ──host LRU (max_cpu_loras)──► LoraAdapter (float32)
                                          ──device slots (max_loras)─► rows of LoraSlots' stacks

A step asks for the slots of the adapters it runs (`assign`); an adapter without one takes a
free slot or the least recently used slot of an adapter not in that step, and its weights are
copied into the stacks there (zero-padded to `max_lora_rank`, so mixed ranks share one shape).
An adapter evicted from host memory is read again from its directory when next needed.

Unloading removes the name at once (new requests get "unknown adapter"); requests already
running on it finish on it: its key and weights are kept until none of them is left
(`drop_unused`), so an unload never changes an output in flight.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedserve.workers.lora.adapter import LoraAdapter, ModuleShape, load_adapter
from pagedserve.workers.lora.config import LoraConfig
from pagedserve.workers.protocol.errors import LoraLoadError, UnknownLora


def _not_loaded(name: str) -> UnknownLora:
    return UnknownLora(f"LoRA adapter {name!r} is not loaded")


class LoraSlots:
    """The device stacks: per (layer, target) A ``[S, R, K]`` and B ``[S, N, R]``; scales.

    B is stored ``[N, S, R]`` and handed out as its ``[S, N, R]`` view: the CPU path then reads
    the first S' slots' B side by side as one ``[N, S'·R]`` matrix without a copy
    (`lora_ops.add_lora_torch`)."""

    def __init__(
        self,
        shapes: dict[str, ModuleShape],
        num_layers: int,
        config: LoraConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        slots, rank = config.max_loras, config.max_lora_rank
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for target, shape in shapes.items():
                a = torch.zeros(slots, rank, shape.in_features, device=device, dtype=dtype)
                b = torch.zeros(shape.out_features, slots, rank, device=device, dtype=dtype)
                self.stacks[(layer, target)] = (a, b.permute(1, 0, 2))
        self.scales = torch.zeros(slots, device=device, dtype=torch.float32)
        self.targets: list[frozenset[str]] = [frozenset()] * slots  # what each slot adapts

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (what it does not target is zero there)."""
        for (layer, target), (a_stack, b_stack) in self.stacks.items():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            pair = adapter.weights.get((layer, target))
            if pair is not None:
                a, b = pair
                a_stack[slot, : adapter.rank].copy_(a)
                b_stack[slot, :, : adapter.rank].copy_(b)
        self.scales[slot] = adapter.scaling
        self.targets[slot] = frozenset(adapter.targets)


class LoraRegistry:
    """Owns one engine's adapters (see the module docstring)."""

    def __init__(
        self,
        config: LoraConfig,
        model_name: str,
        shapes: dict[str, ModuleShape],
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.shapes = shapes
        self.num_layers = num_layers
        self._device, self._dtype = device, dtype
        self._slots: LoraSlots | None = None  # allocated with the first adapter
        self._names: dict[str, str] = {}  # registered name -> key
        self._paths: dict[str, tuple[str, str]] = {}  # key -> (name, path), in use or named
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # key -> adapter, LRU
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # key -> slot, LRU
        self.num_slot_loads = 0

    @property
    def slots(self) -> LoraSlots:
        if self._slots is None:
            self._slots = LoraSlots(
                self.shapes, self.num_layers, self.config, self._device, self._dtype
            )
        return self._slots

    # ------------------------------------------------------------- names
    def load(self, name: str, path: str) -> LoraAdapter:
        """Register ``name`` from ``path`` (read and checked now). Loading a name again with
        the same files is a no-op; with other files it is refused until it is unloaded.

        Raises:
            LoraLoadError: the adapter cannot be served, or the name holds other weights.
        """
        if not isinstance(name, str) or not name or "@" in name or name == self.model_name:
            raise LoraLoadError(
                f"lora_name must be a non-empty string without '@', not the model's: {name!r}"
            )
        adapter = load_adapter(name, path, self.shapes, self.num_layers, self.config.max_lora_rank)
        current = self._names.get(name)
        if current is not None and current != adapter.key:
            raise LoraLoadError(
                f"adapter {name!r} is already loaded with other weights; unload it first"
            )
        self._names[name] = adapter.key
        self._paths[adapter.key] = (name, adapter.path)
        self._remember(adapter)
        return adapter

    def unload(self, name: str) -> str:
        """Unregister ``name``; its key (returned) stays usable by requests already on it.

        Raises:
            UnknownLora: no adapter of that name.
        """
        key = self._names.pop(name, None)
        if key is None:
            raise _not_loaded(name)
        return key

    def key_of(self, name: str) -> str:
        """The key requests on ``name`` hash their blocks with. Raises `UnknownLora`."""
        key = self._names.get(name)
        if key is None:
            raise _not_loaded(name)
        return key

    def has_key(self, key: str) -> bool:
        """Whether ``key`` can run here (an adopted request's adapter must)."""
        return key in self._paths

    def names(self) -> dict[str, str]:
        """Registered name -> key."""
        return dict(self._names)

    def paths(self) -> dict[str, str]:
        """Registered name -> the directory it was read from (what a peer loads it from).
        Copied first, as in `resident`: read by the worker's stats beside a step."""
        names, paths = dict(self._names), dict(self._paths)
        return {name: paths[key][1] for name, key in names.items() if key in paths}

    def resident(self) -> list[str]:
        """Names of the adapters in device slots now, least recently used first. Read by the
        worker's stats beside a step: the keys are copied first (one call, atomic under the
        GIL), so a step changing the slots cannot break the iteration."""
        keys, paths = list(self._slot_of), dict(self._paths)
        return [paths[key][0] for key in keys if key in paths]

    @property
    def has_unloaded(self) -> bool:
        """Whether an unloaded adapter's weights are still kept for requests on it."""
        return len(self._paths) > len(self._names)

    def drop_unused(self, keys_in_use: set[str]) -> None:
        """Forget unloaded adapters no request uses any more (their slots become free)."""
        named = set(self._names.values())
        for key in [k for k in self._paths if k not in named and k not in keys_in_use]:
            del self._paths[key]
            self._host.pop(key, None)
            self._slot_of.pop(key, None)

    # ------------------------------------------------------------- slots
    def assign(self, keys: set[str]) -> dict[str, int]:
        """A device slot for each adapter of one step, loading those not resident.

        Raises:
            RuntimeError: more adapters than slots (the scheduler never plans such a step).
        """
        if len(keys) > self.config.max_loras:
            raise RuntimeError(
                f"{len(keys)} adapters in one step, max_loras {self.config.max_loras}"
            )
        for key in keys:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        for key in keys:
            if key not in self._slot_of:
                slot = self._free_slot(keys)
                self.slots.write(slot, self._adapter(key))
                self._slot_of[key] = slot
                self.num_slot_loads += 1
        return {key: self._slot_of[key] for key in keys}

    def _free_slot(self, keep: set[str]) -> int:
        taken = set(self._slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next(k for k in self._slot_of if k not in keep)  # LRU first
        return self._slot_of.pop(victim)

    def _adapter(self, key: str) -> LoraAdapter:
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        name, path = self._paths[key]
        adapter = load_adapter(name, path, self.shapes, self.num_layers, self.config.max_lora_rank)
        if adapter.key != key:
            raise LoraLoadError(
                f"adapter {name!r}: its files at {path!r} changed since it was loaded"
            )
        self._remember(adapter)
        return adapter

    def _remember(self, adapter: LoraAdapter) -> None:
        self._host[adapter.key] = adapter
        self._host.move_to_end(adapter.key)
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
