"""Ray Serve proxy options for our app: HTTP on 8000, gRPC on 9000 with our servicers."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where called: importing this module must not import Serve
    from ray.serve.config import HTTPOptions, gRPCOptions

from pagedserve.workers.ray_internals import setup_hook_env_var

# Import paths of the functions Serve's gRPC proxy registers services with: our Generation
# service (with lenient request parsing, see `api.grpc.wire`) and the standard health service.
GRPC_SERVICER_FUNCTIONS: list[str] = [
    "pagedserve.cluster.api.grpc.wire.add_generation_servicer",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


# Environment of the Router replica. Serve (2.60) runs a replica's user code on a separate loop
# by default and drives a streaming method there into an unbounded queue, so a router stream
# would take its request's deltas from its buffer as fast as the worker sends them whatever the
# client reads (and the buffer would never fill to pause the request); on Serve's own loop the
# replica pulls the Router's generator only as its (backpressured) Ray stream drains.
# The proxies' setup hook (`api.grpc.backlog`), which the replica would inherit from the controller
# and pass on to the workers, is turned off: none of them builds a gRPC server, and the hook
# would import Serve into every worker.
# Apply with `@serve.deployment(ray_actor_options={"runtime_env": {"env_vars": ...}})`.
ROUTER_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    setup_hook_env_var(): "",
}


# How often Serve's controller runs its control loop (Serve's default: every 0.1 s). Idle, the
# loop and what it asks of the GCS cost a local cluster's controller 28 and its GCS 19 CPU-ms a
# second on a 2-core machine (bench/README.md, "Serving defaults"): at 1 request/s, about 1.7
# ms of CPU per streamed token outside the engine. Every 0.5 s they cost 11 and 9. What the
# loop drives (deploys, health-check rounds, autoscaling decisions) runs a few tenths of a
# second later; the router's own admission and refusals do not wait on it.
CONTROL_LOOP_INTERVAL_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
CONTROL_LOOP_INTERVAL_S = 0.5


def controller_env_vars(
    host: str, max_request_bytes: int, max_pending_calls: int
) -> dict[str, str]:
    """Environment of Serve's controller (`serve.start(controller_options=...)`), which its
    proxies inherit: the proxies' (`api.grpc.status.proxy_env_vars`) and the control loop's
    interval. A value already in this process's environment wins."""
    from pagedserve.cluster.api.grpc.status import proxy_env_vars

    interval = os.environ.get(CONTROL_LOOP_INTERVAL_ENV, str(CONTROL_LOOP_INTERVAL_S))
    return {
        **proxy_env_vars(host, max_request_bytes, max_pending_calls),
        CONTROL_LOOP_INTERVAL_ENV: interval,
    }


def http_options(host: str = "0.0.0.0", port: int = 8000) -> HTTPOptions:
    from ray.serve.config import HTTPOptions

    return HTTPOptions(host=host, port=port)


def grpc_options(port: int = 9000) -> gRPCOptions:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS))
