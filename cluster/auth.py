"""Bearer-token auth for both front ends: `authorization: Bearer <token>` (gRPC metadata or the
HTTP header), checked against static tokens from the config or a tokens file.

The health check never needs a token (load balancers and Kubernetes probes call it bare).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from pagedserve.cluster.api_config import AuthConfig
from pagedserve.cluster.api_errors import ApiError, ErrorCode

BEARER = "bearer "
TENANT_ID_CHARS = 16  # hex digits of the token's SHA-256 that name its tenant


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
    """Owns the accepted tokens (as SHA-256 digests) and checks a request's credentials.

    Args:
        tokens: the accepted tokens; none means auth is off and every request passes.
    """

    def __init__(self, tokens: Iterable[str] = ()) -> None:
        self._digests = [_digest(token) for token in tokens]

    @classmethod
    def from_config(cls, config: AuthConfig) -> TokenAuth:
        tokens = list(config.tokens)
        if config.tokens_file is not None:
            tokens += read_tokens_file(config.tokens_file)
        return cls(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str:
        """Pass, returning the caller's tenant, or raise `ApiError(UNAUTHENTICATED)`.

        The tenant names the token (a prefix of its digest, never the token): request ids are
        unique within a tenant and one tenant cannot reach another's requests. With auth off
        every caller is the one tenant "".

        Args:
            authorization: the `authorization` header or metadata value, if any.
        """
        if not self.enabled:
            return ""
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
        return digest.hex()[:TENANT_ID_CHARS]

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """`check` on the `authorization` entry of gRPC invocation metadata."""
        value = next((v for k, v in metadata if k.lower() == "authorization"), None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return self.check(value)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()
