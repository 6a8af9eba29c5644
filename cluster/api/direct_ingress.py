"""HTTP served by the Router replica itself ("direct ingress"), not through Serve's proxy.

Through Serve's proxy every streamed chunk makes two Ray hops (worker → Router replica →
proxy → client). Served by the replica's own HTTP server (Serve's direct ingress) it makes
one. Measured on 2 cores (bench/README.md, "What Serve's proxy hop costs"): at 1 req/s the
TTFT p50 went from 235 to 187 ms and the CPU spent outside the engine from 5.7 to 4.2 ms per
token; under the saturating load the engine delivered 208 tok/s instead of 196.

`pagedserve serve` starts its local cluster this way unless `why_through_proxy` says why not.
Serve reads the settings in each process, so the controller gets `controller_env` and the
Router replica `REPLICA_ENV`, both from the same decision:

- the replica's HTTP server binds `--http-port`: Serve hands an ingress replica a port from
  `[MIN, MAX)`, here that one port;
- a replica that stops is not held 30 s for outside load balancers to let it go
  (`RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`): the server's own stop drains the
  workers first, within its own grace;
- a released port is not quarantined (`RAY_SERVE_PORT_QUARANTINE_S`, meant for HAProxy's
  workers): a Router replica that Serve restarts gets `--http-port` back at once.

Serve's proxy still runs, on a spare port of the same host (`proxy_http_port`). It serves
gRPC on `--grpc-port`: the replica starts no gRPC server of its own
(`ray_internals.replica_serves_http_only`), since the gRPC guards in `api.grpc` are built
for the proxy's process. In the replica's process the Router installs what the proxy's
process has for HTTP (`install_http_guards`).

HTTP goes through the proxy as before on a joined cluster (its Serve and proxies are the
cluster's own), with more than one Router replica (one port holds one replica), and with
`--http-through-proxy`.
"""

from __future__ import annotations

from pagedserve.cluster.config.scaling import ScalingConfig

ENABLE_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
QUARANTINE_ENV = "RAY_SERVE_PORT_QUARANTINE_S"

# Environment of the Router replica: it starts its HTTP server, and stops without the wait.
REPLICA_ENV: dict[str, str] = {ENABLE_ENV: "1", DRAINING_ENV: "0"}


def why_through_proxy(
    address: str | None, scaling: ScalingConfig, through_proxy: bool
) -> str | None:
    """Why HTTP must go through Serve's proxy, in words; None when the Router replica can
    serve it itself."""
    if through_proxy:
        return "--http-through-proxy"
    if address is not None:
        return "a joined cluster's Serve keeps its own proxies"
    if scaling.router_replicas > 1 or (scaling.router_max_replicas or 1) > 1:
        return "several Router replicas share one HTTP port through the proxy"
    return None


def controller_env(http_port: int) -> dict[str, str]:
    """Environment of Serve's controller (and so of its proxies): direct ingress on, the
    ingress replica's HTTP port exactly `http_port`, no draining wait, no port quarantine."""
    return {
        **REPLICA_ENV,
        MIN_PORT_ENV: str(http_port),
        MAX_PORT_ENV: str(http_port + 1),
        QUARANTINE_ENV: "0",
    }


def proxy_http_port(host: str) -> int:
    """A free port on `host` for the HTTP side of Serve's proxy (its gRPC side keeps
    `--grpc-port`)."""
    from pagedserve.cluster.ports import free_port

    return free_port(host)


def install_http_guards() -> None:
    """In a Router replica serving HTTP itself: what Serve's proxy process installs for HTTP
    (`api.grpc.wire`), and no gRPC server of the replica's own. Idempotent."""
    from pagedserve.cluster.api.http_connections import guard_connections
    from pagedserve.cluster.api.sse_response import limit_send_buffers
    from pagedserve.workers.ray_internals import replica_serves_http_only

    limit_send_buffers()  # an unread SSE stream pauses its request
    guard_connections()  # connections not serving a request are bounded
    replica_serves_http_only()
