"""The API's own settings, given to `build_app` beside the cluster config.

    build_app({"num_workers": 2, "engine": {...},              # ClusterConfig
               "auth": {"tokens": ["s3cret"], "tokens_file": "/etc/pagedserve/tokens"},
               "served_model_name": "tiny",
               "embedding_pooling": "mean",                        # default "last"
               "telemetry": {"exporter": "otlp", "metrics": True}})  # see workers/telemetry

`split_app_args` takes the API's keys out, so the rest goes to `ClusterConfig.from_dict` as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.workers.protocol.sampling import Pooling
from pagedserve.workers.telemetry.telemetry import TelemetryConfig

_HEADER = re.compile(r"[A-Za-z0-9-]{1,64}")

API_KEYS = ("auth", "served_model_name", "telemetry", "embedding_pooling", "direct_ingress")


@dataclass(frozen=True)
class AuthConfig:
    """Static bearer tokens; auth is on when there is at least one.

    Attributes:
        tokens: accepted tokens, each `<token>` or `<token> <cache group>`.
        tokens_file: a file with one accepted token per line, in the same form (blank lines
            and `#` comments skipped), read by each router replica when it starts, so secrets
            stay out of the Serve config.
        isolate_caches: each token (tenant) gets a prefix cache of its own, so no tenant can
            hit or time another's cached prompts; tokens naming the same cache group share
            one. False: all tenants share one cache.
        tenant_header: with auth off, the request header (gRPC metadata key) that names the
            request's tenant, set by a gateway in front that the operator trusts (1-64 of
            letters, digits, `_.:-`; absent: the anonymous tenant). Fair share and the
            tenants' quotas then tell tenants apart without tokens. Ignored with auth on: the
            token is the tenant.
    """

    tokens: tuple[str, ...] = ()
    tokens_file: str | None = None
    isolate_caches: bool = True
    tenant_header: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tokens, str):
            raise ValueError("auth.tokens must be a list of strings, got one string")
        object.__setattr__(self, "tokens", tuple(self.tokens))
        for i, token in enumerate(self.tokens):
            if not isinstance(token, str) or not token.strip():
                raise ValueError(f"auth.tokens[{i}] must be a non-empty string")
        header = self.tenant_header
        if header is not None and not (isinstance(header, str) and _HEADER.fullmatch(header)):
            raise ValueError(
                f"auth.tenant_header must be a header name (letters, digits, '-'), got {header!r}"
            )
        if header is not None:
            object.__setattr__(self, "tenant_header", header.lower())

    @property
    def enabled(self) -> bool:
        return bool(self.tokens) or self.tokens_file is not None


@dataclass(frozen=True)
class ApiConfig:
    """Settings of the gRPC and HTTP front ends.

    Attributes:
        auth: bearer-token auth (off by default).
        served_model_name: the model id of the OpenAI API (default: the engine's model).
        telemetry: tracing and metrics of the router and its workers (tracing off by default).
        embedding_pooling: how `/v1/embeddings` pools the final hidden states: `last` (the
            prompt's last token, vLLM's default for decoder models) or `mean`.
        direct_ingress: the Router replica serves HTTP itself (`api.direct_ingress`); set by
            `pagedserve serve` together with the matching settings of Serve's controller.
    """

    auth: AuthConfig = field(default_factory=AuthConfig)
    served_model_name: str | None = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    embedding_pooling: Pooling = Pooling.LAST
    direct_ingress: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.direct_ingress, bool):
            raise ValueError(f"direct_ingress must be true or false, got {self.direct_ingress!r}")
        try:
            object.__setattr__(self, "embedding_pooling", Pooling(self.embedding_pooling))
        except ValueError:
            kinds = ", ".join(kind.value for kind in Pooling)
            raise ValueError(
                f"embedding_pooling must be one of {kinds}, got {self.embedding_pooling!r}"
            ) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ApiConfig:
        data = dict(data)
        auth = data.pop("auth", None) or {}
        if isinstance(auth, dict):
            known = {f.name for f in fields(AuthConfig)}
            unknown = sorted(set(auth) - known)
            if unknown:
                raise ValueError(
                    f"unknown auth keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            auth = AuthConfig(**auth)
        telemetry = data.pop("telemetry", None)
        if not isinstance(telemetry, TelemetryConfig):
            telemetry = TelemetryConfig.from_dict(telemetry)
        return cls(auth=auth, telemetry=telemetry, **data)


def split_app_args(args: dict[str, Any] | None) -> tuple[dict[str, Any], ApiConfig]:
    """Split `build_app`'s arguments into cluster config data and the `ApiConfig`."""
    cluster = dict(args or {})
    api = {key: cluster.pop(key) for key in API_KEYS if key in cluster}
    return cluster, ApiConfig.from_dict(api)
