"""What crosses a process boundary between the front ends, the routers and the workers (and between
workers), and nothing else; the control messages among the cluster's own actors (the prefix
index's feed, the pool's membership, the routers' reports and cluster stats) stay with their
owners in `cluster/`. A request on its way in (`requests`: the router's `GenerateRequest`, a
worker's `WorkerRequest`, with `SamplingParams` from `sampling` and a grammar's `GuidedSpec`
from `guided`), on its way out (`stream`: `StreamDelta` and the control messages `RequestMoved`
and `RequestFailed` in a `StepBatch`, with `Usage`, `RequestMetrics`, `TokenLogprob` and
`FinishReason`), between workers (`handoff`: `RequestHandoff`), what a worker reports about
itself (`stats`: `WorkerInfo`, `WorkerStats` and its parts, the answers of admin calls; `role`:
its P/D role), its prefix cache's changes (`events`: KV events and snapshots; `blocks`: a
block's hash and key, also what an exported prefix carries) and why a request is refused or
fails (`errors`). The rule: each message is a dataclass, frozen, validated once where it is
built (its `__post_init__`, or its constructor's checks), never a dict read back by string key;
the exceptions (types still mutable) are listed with their reason in
`tests/unit/workers/protocol/test_protocol_types.py`. These modules import nothing of the
project but each other and a few torch-free helpers (listed in
`tests/unit/test_import_direction.py`), so every layer and every process may import them; the
logic that makes or reads the messages (the engine, the worker's streams, the router) lives with
its owner, not here.
"""
