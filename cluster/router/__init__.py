"""The router (a Serve deployment): `RouterCore` (`router`: its parts wired and its lifecycle;
`config`: what it reads of the app config, `RouterConfig`), its request path (`requests`:
admit, route each leg, stream back, replay, abort, drain), where a prompt goes (`route`), what
it reports (`stats`; the report types in `types`), its view of each worker (`worker_state`,
`worker_liveness`) and their step channels (`worker_channel`), LoRA adapters, tenant quotas,
its spans, its Prometheus metrics and the cluster-wide counters (`reports`).
"""
