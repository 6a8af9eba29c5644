"""The front ends on the router: what the gRPC (`grpc/`) and the OpenAI-compatible HTTP
(`openai/`) APIs share (building sampling params, checking text, collecting completions,
structured-output fields, errors, bearer-token auth), the API's own settings (`config`), the
Serve proxy options and the bounds on its HTTP connections, and server-sent events.
"""
