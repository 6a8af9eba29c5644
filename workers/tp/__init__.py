"""Tensor parallelism: one worker's model and KV pool split over k ranks (`tensor_parallel_size`).

Where each part lives:

    shards.py           which heads, MLP rows and vocabulary rows each rank owns (`TPShard`)
    sharded_decoder.py  a rank's slice of the Llama-style forward: column-parallel q/k/v and
                        gate/up, row-parallel o and down with one all-reduce each per layer,
                        vocabulary-parallel LM head gathered on rank 0
    protocol.py         the frozen commands rank 0 sends ranks 1..k-1 (a step's forward, the
                        block copies, swaps, exports and imports of the paged pool)
    rank_process.py     ranks 1..k-1: a process each that joins the group and runs commands
    group.py            rank 0's handle on the group: starts, feeds and stops the rank processes;
                        a rank that dies fails the whole group (`TPGroupFailed`)
    executor.py         what the engine holds instead of `ModelRunner` and `KVCache`: the same
                        calls, run by every rank (`build_tp_executor`)

The engine (scheduler, block manager, sampler) runs once, in rank 0's process; block tables
are identical on every rank and each rank's pool holds only its KV heads. Seen from outside
(stats, KV events, transfers) the group is one worker: a block leaves it in the full-head
layout (the ranks' shards concatenated along the KV-head axis, in rank order), which is also
what a k = 1 worker holds, so blocks move between groups of any k. See docs/tensor-parallel.md.
"""
