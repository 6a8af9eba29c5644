"""Ray Serve proxy options for our app: HTTP on 8000, gRPC on 9000 with our servicers."""

from __future__ import annotations

from typing import Any

GRPC_SERVICER_FUNCTIONS: list[str] = []  # filled by the API (pagedserve.v1 Generation, health)


def http_options(host: str = "0.0.0.0", port: int = 8000) -> dict[str, Any]:
    return {"host": host, "port": port}


def grpc_options(port: int = 9000) -> Any:
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS))
