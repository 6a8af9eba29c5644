"""Per-tenant quotas end to end, through Serve's HTTP proxy with two tenants named by the
trusted tenant header (auth off, `auth.tenant_header`; with auth on the token names the tenant
the same way, `tests/unit/cluster/api/test_auth.py`): a tenant past its quota is refused at once
with 429 and a retry hint, the other tenant is served, and nothing in flight is disturbed; the
per-tenant counters reach `/metrics`.

One app serves the module: tenant A may stream 1 request at a time, tenant C may use 60
tokens per minute (1 a second: a refusal's retry hint is tens of seconds, so no test depends
on how fast the machine is; only one test sends as C, so its bucket starts full).
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from support.api_app import assert_app_clean, running_app, wait_until

HEADER = "x-tenant-id"
TENANT_A, TENANT_B, TENANT_C = "team-a", "team-b", "team-c"
MODEL = "tiny-llama"
LONG = 600  # tokens: seconds of decoding on a CPU


@pytest.fixture(scope="module")
def app(serve_cluster):
    tenants = {TENANT_A: {"max_inflight": 1}, TENANT_C: {"tokens_per_minute": 60}}
    with running_app(
        "api-tenants",
        auth={"tenant_header": HEADER},
        tenants=tenants,
        telemetry={"metrics": True},
    ) as running:
        yield running


def post(app, tenant: str, max_tokens: int, stream: bool = False, prompt_len: int = 10):
    body = {
        "model": MODEL,
        "prompt": list(range(1, prompt_len + 1)),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:  # the last chunk counts the tokens (a lagging reader gets them merged)
        body["stream_options"] = {"include_usage": True}
    return requests.post(
        f"{app.http_url}/v1/completions",
        json=body,
        headers={HEADER: tenant},
        stream=stream,
        timeout=120,
    )


def stream_tokens(response) -> int:
    """Read a streamed completion to its end: the number of chunks carrying text."""
    chunks = 0
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunks += bool(json.loads(line[6:])["choices"][0]["text"])
    return chunks


def test_a_tenant_at_its_inflight_quota_is_refused_and_the_other_served(app):
    holder = post(app, TENANT_A, LONG, stream=True)
    assert holder.status_code == 200
    lines = holder.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))  # admitted, decoding
    refused = post(app, TENANT_A, 4)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert "limit of 1 requests" in error["message"] and "Traceback" not in error["message"]
    served = post(app, TENANT_B, 4)  # the other tenant: not held back by A's quota
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
    # The held request ran on untouched, to its last token (counted by its usage chunk: a
    # reader that lags gets several tokens in one chunk, so chunks undercount them).
    chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == LONG
    assert post(app, TENANT_A, 4).status_code == 200  # its slot is free again
    assert_app_clean(app)


def test_a_tenant_past_its_tokens_per_minute_is_refused_with_the_wait(app):
    # 10 prompt + 40 output tokens take 50 of C's 60; the next needs 50 with ~10 left.
    first = post(app, TENANT_C, 40)
    assert first.status_code == 200, first.text
    refused = post(app, TENANT_C, 40)
    assert refused.status_code == 429, refused.text
    # About 40 more tokens at 1 a second: the hint says so (a little less, as time passed).
    assert 20 <= int(refused.headers["retry-after"]) <= 60
    assert "tokens per minute" in refused.json()["error"]["message"]
    assert post(app, TENANT_A, 40).status_code == 200  # A has no token quota
    # One request that needs more than a whole minute's tokens can never pass: invalid.
    never = post(app, TENANT_C, 100)
    assert never.status_code == 400 and "max_tokens" in never.json()["error"]["message"]
    assert_app_clean(app)


def scrape(app) -> dict[str, float]:
    response = requests.get(f"{app.http_url}/metrics", timeout=30)
    samples = {}
    for line in response.text.splitlines():
        match = re.match(r"^(pagedserve_\S+?)(\{.*\})?\s+(\S+)$", line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def test_per_tenant_counters_reach_metrics(app):
    assert post(app, TENANT_A, 3).status_code == 200

    def counted():
        samples = scrape(app)
        admitted = f'pagedserve_tenant_requests_total{{outcome="admitted",tenant="{TENANT_A}"}}'
        refused = (
            f'pagedserve_tenant_requests_total{{outcome="refused_tokens",tenant="{TENANT_C}"}}'
        )
        service = [k for k in samples if k.startswith("pagedserve_tenant_service_tokens_total")]
        ok = samples.get(admitted, 0) >= 1 and samples.get(refused, 0) >= 1
        return samples if ok and any(TENANT_A in k for k in service) else None

    samples = wait_until(counted, 120, "the tenants' counters in /metrics")
    output = f'pagedserve_tenant_tokens_total{{kind="output",tenant="{TENANT_A}"}}'
    assert samples[output] >= 3
    assert any(k.startswith("pagedserve_tenant_virtual_tokens{") for k in samples)
    assert_app_clean(app)
