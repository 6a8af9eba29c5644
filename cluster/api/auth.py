"""Bearer-token auth for both front ends: `authorization: Bearer <token>` (gRPC metadata or the
HTTP header), checked against static tokens from the config or a tokens file.

Each token is a tenant. A tenant's request ids are its own (no other tenant can see, abort or
collide with them), and so is its prefix cache: a request is hashed with its caller's
`cache_scope`, so no tenant can hit, and time, another's cached prompt (the side channel
vLLM's `cache_salt` closes). Tokens that should share a cache on purpose name a cache group
(`<token> <group>`, on one line); `AuthConfig.isolate_caches = False` shares one cache among all.

The health check never needs a token (load balancers and Kubernetes probes call it bare).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pagedserve.cluster.api.config import AuthConfig
from pagedserve.cluster.api.errors import ApiError, ErrorCode

BEARER = "bearer "
TENANT_ID_CHARS = 16  # hex digits of the token's SHA-256 that name its tenant
_GROUP_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_TENANT_NAME = _GROUP_NAME  # a tenant a trusted header names


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as auth found it.

    Attributes:
        tenant: a prefix of the token's digest (never the token); with auth off, what the
            trusted tenant header names, else "".
        cache_scope: whose cached prefixes the request may hit: `tenant:<tenant>`, or
            `group:<name>` for a token in a cache group; "" with auth off or isolation off.
    """

    tenant: str = ""
    cache_scope: str = ""


ANONYMOUS = Caller()


def parse_token_entry(entry: str, where: str) -> tuple[str, str | None]:
    """`<token>` or `<token> <cache group>` → (token, group or None).

    Raises:
        ValueError: naming `where`, for more than two fields or a group name other than
            1–64 of letters, digits, `_.:-`.
    """
    fields = entry.split()
    if not fields or len(fields) > 2:
        raise ValueError(
            f"{where}: expected '<token>' or '<token> <cache group>', got {len(fields)} fields"
        )
    if len(fields) == 1:
        return fields[0], None
    token, group = fields
    if not _GROUP_NAME.fullmatch(group):
        raise ValueError(f"{where}: cache group {group!r} must be 1-64 letters, digits or '_.:-'")
    return token, group


def read_tokens_file(path: str) -> list[str]:
    """The tokens in `path`: one per line; blank lines and lines starting with `#` skipped.

    Raises:
        ValueError: the file cannot be read or holds no token.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as error:
        raise ValueError(f"auth.tokens_file: cannot read {path}: {error}") from error
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"auth.tokens_file: {path} holds no token")
    return tokens


class TokenAuth:
    """Owns the accepted tokens (as SHA-256 digests, with their cache groups) and checks a
    request's credentials.

    Args:
        tokens: the accepted tokens, each `<token>` or `<token> <cache group>`; none means
            auth is off and every request passes.
        isolate_caches: give each tenant (or cache group) a prefix cache of its own.
    """

    def __init__(
        self,
        tokens: Iterable[str] = (),
        isolate_caches: bool = True,
        tenant_header: str | None = None,
    ) -> None:
        entries = [parse_token_entry(t, f"auth token {i}") for i, t in enumerate(tokens)]
        self._digests = [_digest(token) for token, _ in entries]
        self._groups = [group for _, group in entries]
        self.isolate_caches = isolate_caches
        self.tenant_header = tenant_header.lower() if tenant_header else None

    @classmethod
    def from_config(cls, config: AuthConfig) -> TokenAuth:
        tokens = list(config.tokens)
        if config.tokens_file is not None:
            tokens += read_tokens_file(config.tokens_file)
        return cls(tokens, config.isolate_caches, config.tenant_header)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> Caller:
        """Pass, returning the caller (tenant and cache scope), or raise
        `ApiError(UNAUTHENTICATED)`. With auth off every caller is `ANONYMOUS`.

        Args:
            authorization: the `authorization` header or metadata value, if any.
        """
        if not self.enabled:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith(BEARER):
            raise ApiError(
                ErrorCode.UNAUTHENTICATED,
                "authorization: missing bearer token (send 'authorization: Bearer <token>')",
                param="authorization",
            )
        digest = _digest(authorization[len(BEARER) :].strip())
        # Compare against every token, in constant time each, so timing reveals nothing.
        matches = [hmac.compare_digest(digest, known) for known in self._digests]
        if not any(matches):
            raise ApiError(
                ErrorCode.UNAUTHENTICATED, "authorization: invalid bearer token", "authorization"
            )
        tenant = tenant_of_digest(digest)
        return Caller(tenant, self._cache_scope(tenant, self._groups[matches.index(True)]))

    def _cache_scope(self, tenant: str, group: str | None) -> str:
        if not self.isolate_caches:
            return ""
        return f"group:{group}" if group is not None else f"tenant:{tenant}"

    def check_headers(self, headers: Mapping[str, str]) -> Caller:
        """`check` on an HTTP request's headers (case-insensitive, as Starlette's are)."""
        caller = self.check(headers.get("authorization"))
        if self.enabled or self.tenant_header is None:
            return caller
        return self._trusted_tenant(headers.get(self.tenant_header))

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> Caller:
        """`check` on gRPC invocation metadata (`authorization`, and the tenant header's key)."""
        entries = {k.lower(): v for k, v in metadata}
        caller = self.check(_text(entries.get("authorization")))
        if self.enabled or self.tenant_header is None:
            return caller
        return self._trusted_tenant(_text(entries.get(self.tenant_header)))

    def _trusted_tenant(self, value: str | None) -> Caller:
        """Auth off: the tenant a trusted gateway named in the tenant header (none: anonymous)."""
        if value is None or value == "":
            return ANONYMOUS
        if not _TENANT_NAME.fullmatch(value):
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"{self.tenant_header}: a tenant is 1-64 letters, digits or '_.:-', got {value!r}",
                self.tenant_header,
            )
        return Caller(value, "")


def _text(value: str | bytes | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def tenant_of_digest(digest: bytes) -> str:
    return digest.hex()[:TENANT_ID_CHARS]


def tenant_of(token: str) -> str:
    """The tenant id of `token` (how the config's `tenants` names it): the first 16 hex
    digits of its SHA-256, as `sha256sum` prints them."""
    return tenant_of_digest(_digest(token))
