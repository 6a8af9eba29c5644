"""LoRA adapters over the base model: many fine-tuned variants served in one batch.

What each module owns:

- `adapter.py`: one adapter read from PEFT's format (`adapter_config.json` +
  `adapter_model.safetensors`), checked against the model (targets, shapes, rank) at load;
  its identity (`LoraAdapter.key`: name and a digest of its files) is what the block hash
  carries (`workers/kv/block_hash.py`, `cache_key`), so KV computed under one adapter is never
  a hit for another or for the base.
- `registry.py`: an engine's adapters: every registered name, the parsed ones kept in host
  memory (LRU, `max_cpu_loras`), and `max_loras` device slots whose weights are stacked per
  layer and projection (`LoraSlots`), assigned LRU among the adapters no running request uses.
- `batch.py`: one step's per-token adapter slots (`LoraBatch`), applied by the fused decoder
  after each projection through `pagedserve/kernels/lora_ops.py` (torch on the CPU) or
  `lora_triton.py` (GPU).

The scheduler admits a request of a new adapter only while the running set holds fewer than
`max_loras` adapters (`Scheduler._adapter_fits`), so a step never needs more slots than exist.
"""
