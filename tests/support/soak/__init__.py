"""The soak harness: a long chaotic load with faults on a local cluster, then checks that
nothing leaked, no output changed and every counter is true (`__main__.py` runs it; the suite's
`tests/integration/test_soak.py` and `test_soak_grpc.py` run bounded forms).

    driver.py            the load (`SoakSpec`, `plan_requests`, `run_soak`) over a `RouterCore`
    checks.py            outputs against each request run alone, pools, index, counters
    grpc_soak.py         the same load over Serve's gRPC proxy and Router replicas
    grpc_app.py          that app, started and stopped; grpc_calls.py the raw calls
    grpc_checks.py       status codes, details and tokens of every gRPC outcome
    grpc_faults.py       burst, duplicate ids, index kill; grpc_router_kill.py a replica's kill
"""
