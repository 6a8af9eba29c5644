"""The router (a Serve deployment): `RouterCore` (`router`) and its request path
(`requests`: admit, route each leg, stream back, replay, abort, drain), what it reports
(`types`), its view of each worker (`worker_state`, `worker_liveness`) and their step
channels (`worker_channel`), LoRA adapters, tenant quotas, its spans, its Prometheus metrics
and the cluster-wide counters (`reports`).
"""
