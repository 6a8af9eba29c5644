"""Generated gRPC stubs and the API definition (pagedserve/v1/serving.proto)."""
