"""The single-worker engine, synchronous and Ray-free: `Engine` (add requests, step, get deltas),
its one typed config (`EngineConfig`) and the checks and sizing done before it loads, the
`Request` it generates for each branch and how one is taken in, what it hands back (`outputs`),
when a sequence stops, incremental detokenization, embeddings (`pooling`), the executor it
drives (one process or a tensor-parallel group) and its side of hand-offs. Scheduling, the KV
pool, the model, sampling, speculation and beam search are the neighbouring subpackages it
calls.
"""
