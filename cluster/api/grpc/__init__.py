"""The gRPC API (`pagedserve.v1.Generation` and health) inside Serve's gRPC proxy: the
servicer (`api`), conversions between messages and the router's types (`convert`), how the proxy
reads requests off the wire (`wire`), the final status of every call (`status`), cancelled
streams cancelling their request (`streams`) and room for calls not yet taken up (`backlog`).
"""
