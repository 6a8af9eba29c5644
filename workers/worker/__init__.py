"""The worker actor and what it serves: the Ray actor (`actor`) around `WorkerCore` (`core`:
one engine driven by an async step loop), its request and KV endpoints, the streams it holds
open and the messages they carry (`streams`, `stream`), the types that cross to its callers
(`types`), owner leases and the fault injection that soaks and failure tests install.
"""
