"""The trusted tenant header (`AuthConfig.tenant_header`): with auth off it names the tenant,
over HTTP headers and gRPC metadata alike; a malformed value is refused naming the header;
with auth on the token alone is the tenant."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from pagedserve.cluster.api.auth import ANONYMOUS, TokenAuth, tenant_of
from pagedserve.cluster.api.config import AuthConfig
from pagedserve.cluster.api.errors import ApiError, ErrorCode

HEADER = "X-Tenant-Id"


def trusting() -> TokenAuth:
    return TokenAuth.from_config(AuthConfig(tenant_header=HEADER))


def test_auth_off_takes_the_tenant_from_the_header():
    auth = trusting()
    assert auth.check_headers(Headers({"x-tenant-id": "team-a"})).tenant == "team-a"
    assert auth.check_metadata([("x-tenant-id", b"team-b")]).tenant == "team-b"
    # No header, an empty one, or no header configured: the anonymous tenant.
    assert auth.check_headers(Headers({})) == ANONYMOUS
    assert auth.check_metadata([("x-tenant-id", "")]) == ANONYMOUS
    assert TokenAuth().check_headers(Headers({"x-tenant-id": "team-a"})) == ANONYMOUS


@pytest.mark.parametrize("value", ["a b", "x" * 65, "team/a", "tënant"])
def test_a_malformed_tenant_is_refused_naming_the_header(value):
    with pytest.raises(ApiError) as refused:
        trusting().check_headers({"x-tenant-id": value})
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT
    assert refused.value.param == "x-tenant-id" and "x-tenant-id" in str(refused.value)


def test_with_auth_on_the_token_is_the_tenant_and_the_header_is_ignored():
    auth = TokenAuth.from_config(AuthConfig(tokens=("tok",), tenant_header=HEADER))
    caller = auth.check_headers(Headers({"authorization": "Bearer tok", "x-tenant-id": "x"}))
    assert caller.tenant == tenant_of("tok")
    metadata = [("authorization", "Bearer tok"), ("x-tenant-id", "x")]
    assert auth.check_metadata(metadata).tenant == tenant_of("tok")


@pytest.mark.parametrize("header", ["x tenant", "", "x_tenant", 7])
def test_a_bad_header_name_is_refused_at_config(header):
    with pytest.raises(ValueError, match="auth.tenant_header"):
        AuthConfig(tenant_header=header)
