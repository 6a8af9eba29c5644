"""The worker actor and what it serves: the Ray actor (`actor`) around `WorkerCore` (`core`:
one engine driven by an async step loop), its request and KV endpoints, the streams it holds
open and the batches they send (`streams`, `stream`; the messages themselves are in
`workers/protocol/`), owner leases and the fault injection that soaks and failure tests install.
"""
