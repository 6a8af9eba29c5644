"""The KV cache of one worker: physical blocks, their chained hashes and the pool with its prefix
cache (`block*`), the device tensors and swap area (`cache`, `swap`), the per-request block
tables the scheduler uses (`manager`, with its parts: prefix lookup and registration
`prefix_lookup`, slots taken back `slot_rollback`, swap slots `swap`; the events a pool
publishes for the cluster's prefix index and the usage it reports are in `workers/protocol/`),
the tiers below the device pool (host memory and disk: `tiers`, `tier_*`), the memory equations
(`memory`) and the invariant and leak checks (`checks`).
"""
