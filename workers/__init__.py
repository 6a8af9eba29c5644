"""Everything inside one worker, a subpackage per concept (each `__init__.py` says what it owns):

    protocol/   what crosses a process boundary: requests, stream messages, handoffs, worker
                info and stats, KV events, errors (imported by every layer above)
    engine/     the synchronous engine: add requests, step, get deltas; its config and checks
    scheduler/  continuous batching, scheduling policies, fair share across tenants
    kv/         blocks, the paged pool and prefix cache, the KV cache manager, host/disk tiers
    transfer/   KV leaving for a peer: request hand-offs, prefix block export/import
    model/      model names, loading, tokenizer, one forward step over the paged pool
    sampling/   sampling parameters, the sampler, log-probabilities
    spec/       speculative decoding
    beam/       beam search
    lora/       LoRA adapters
    structured/ structured outputs (grammars → token masks)
    tp/         tensor parallelism
    worker/     the worker actor, its step loop, endpoints and streams
    process/    a worker process on its machine: CPU placement, SIGTERM drain, drain-node
    telemetry/  tracing for every process
    offline/    the offline `LLM` API and `pagedserve generate --offline`

Beside them, what every layer above uses too and keeps light (no torch): `deadline` (`within`),
`config_flags` (flags from a config dataclass) and `ray_internals` (every Ray private API
touched, for one Ray version).
"""
