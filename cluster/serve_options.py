"""Ray Serve proxy options for our app: HTTP on 8000, gRPC on 9000 with our servicers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where called: importing this module must not import Serve
    from ray.serve.config import HTTPOptions, gRPCOptions

from pagedserve.cluster.grpc_backlog import setup_hook_env_var

# Import paths of the functions Serve's gRPC proxy registers services with: our Generation
# service (with lenient request parsing, see `grpc_wire`) and the standard health service.
GRPC_SERVICER_FUNCTIONS: list[str] = [
    "pagedserve.cluster.grpc_wire.add_generation_servicer",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


# Environment of the Router replica. Serve (2.60) runs a replica's user code on a separate loop
# by default and drives a streaming method there into an unbounded queue, so a router stream
# would pull its worker's deltas as fast as they come whatever the client reads; on Serve's own
# loop the replica pulls the Router's generator only as its (backpressured) Ray stream drains.
# The proxies' setup hook (`grpc_backlog`), which the replica would inherit from the controller
# and pass on to the workers, is turned off: none of them builds a gRPC server, and the hook
# would import Serve into every worker.
# Apply with `@serve.deployment(ray_actor_options={"runtime_env": {"env_vars": ...}})`.
ROUTER_ENV_VARS: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    setup_hook_env_var(): "",
}


def http_options(host: str = "0.0.0.0", port: int = 8000) -> HTTPOptions:
    from ray.serve.config import HTTPOptions

    return HTTPOptions(host=host, port=port)


def grpc_options(port: int = 9000) -> gRPCOptions:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS))
