"""The engine's LoRA side (a mixin of `Engine`): load and unload adapters, the cache keys of a
request on one, and each step's `LoraBatch`."""

from __future__ import annotations

from collections.abc import Mapping

from pagedserve.workers.engine.request import Request
from pagedserve.workers.kv.block_hash import cache_key, lora_key_of
from pagedserve.workers.lora.adapter import LoraAdapter, model_shapes
from pagedserve.workers.lora.batch import LoraBatch, build_lora_batch
from pagedserve.workers.lora.config import LoraConfig, parse_lora_modules
from pagedserve.workers.lora.registry import LoraRegistry
from pagedserve.workers.protocol.errors import LoraLoadError, RequestRejected, UnknownLora


class EngineLoras:
    """`Engine`'s adapters (`self.loras`: None for a model the fused decoder cannot run)."""

    def _init_loras(self) -> None:
        config = self.config
        self.loras: LoraRegistry | None = None
        if config.tensor_parallel_size > 1:  # no adapters (EngineConfig refuses lora_modules)
            return
        if self.runner.fused is None:
            if config.lora_modules:
                raise ValueError(f"LoRA adapters need a Llama-family model, not {self.loaded.name}")
            return
        self.loras = LoraRegistry(
            LoraConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras),
            self.loaded.name,
            model_shapes(self.loaded.model),
            self.loaded.num_layers,
            self.device,
            self.loaded.dtype,
        )
        for name, path in parse_lora_modules(config.lora_modules).items():
            self.loras.load(name, path)

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Load adapter ``name`` from ``path`` (PEFT's format). Nothing else changes when it
        fails. Raises `LoraLoadError` naming the problem."""
        if self.loras is None:
            raise LoraLoadError(self._why_no_loras())
        return self.loras.load(name, path)

    def _why_no_loras(self) -> str:
        if self.config.tensor_parallel_size > 1:
            return "LoRA adapters need tensor_parallel_size 1"
        return f"LoRA adapters need a Llama-family model, not {self.loaded.name}"

    def unload_lora(self, name: str) -> None:
        """Unload ``name``: new requests on it are refused (`UnknownLora`) at once; requests
        already running on it finish on it, then its weights are dropped."""
        if self.loras is None:
            raise UnknownLora(f"LoRA adapter {name!r} is not loaded")
        self.loras.unload(name)
        self.loras.drop_unused(self._lora_keys_in_use())

    def lora_adapters(self) -> Mapping[str, str]:
        """Loaded adapter name -> key."""
        return {} if self.loras is None else self.loras.names()

    def lora_paths(self) -> Mapping[str, str]:
        """Loaded adapter name -> the directory it was read from."""
        return {} if self.loras is None else self.loras.paths()

    def lora_requests(self) -> tuple[tuple[str, int], ...]:
        """(adapter name, requests on it in this engine), for stats and metrics."""
        counts: dict[str, int] = {}
        for group in list(self._groups.values()):  # read beside a step: copied in one call
            key = group.branches[0].lora_key
            if key is not None:
                name = key.rsplit("@", 1)[0]
                counts[name] = counts.get(name, 0) + 1
        return tuple(sorted(counts.items()))

    def _request_keys(
        self, cache_salt: str | None, lora: str | None, beam: bool
    ) -> tuple[str, ...]:
        """A new request's cache keys: its adapter's key among them. Raises `UnknownLora`."""
        if not lora:
            return cache_key(self.loaded.name, cache_salt)
        if self.loras is None:
            raise UnknownLora(f"LoRA adapter {lora!r} is not loaded")
        if beam:
            raise RequestRejected("use_beam_search is not supported with a LoRA adapter")
        return cache_key(self.loaded.name, cache_salt, self.loras.key_of(lora))

    def _check_adoptable(self, extra_keys: tuple[str, ...]) -> None:
        """An adopted request's adapter must be loaded here (under the same key)."""
        key = lora_key_of(extra_keys)
        if key is not None and (self.loras is None or not self.loras.has_key(key)):
            name = key.split("@")[0]
            raise RequestRejected(f"LoRA adapter {name!r} is not loaded here with those weights")

    def _lora_batch(self, scheduled: Mapping[Request, int]) -> LoraBatch | None:
        """This step's per-token adapters (None: every request is on the base model)."""
        if self.loras is None:
            return None
        keys = [request.lora_key for request in scheduled]
        if not any(keys):
            return None
        sizes = list(scheduled.values())
        return build_lora_batch(self.loras, keys, sizes, self.device, self.loaded.dtype)

    def _drop_unloaded_loras(self) -> None:
        """Free the weights of unloaded adapters whose last request has left."""
        if self.loras is not None and self.loras.has_unloaded:
            self.loras.drop_unused(self._lora_keys_in_use())

    def _lora_keys_in_use(self) -> set[str]:
        return {
            key
            for group in self._groups.values()
            for branch in group.branches
            if (key := branch.lora_key) is not None
        }
