"""Everything between workers, a subpackage per concept (each `__init__.py` says what it owns):

    api/        the front ends: what both share, `api/grpc/` (pagedserve.v1) and `api/openai/`
                (the OpenAI-compatible HTTP API)
    router/     the router deployment: admission, the request path, its view of the workers
    routing/    routing policies: which worker serves a request
    index/      the cluster's prefix index and each router's copy of it
    pool/       the worker pool: membership, scaling, worker specs, KV migration and handover
    serve/      the `pagedserve serve` process: CLI, preflight, node layout, its life

Beside them, what users and deployments name directly: `config` (`ClusterConfig`), `app`
(`build_app`, the Serve application), `client` (`Client`, `AsyncClient`) and `client_cli`
(`pagedserve generate` / `status`), `trace_view` (`pagedserve trace show`) and `ports`.
"""
