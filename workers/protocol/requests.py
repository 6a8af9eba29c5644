"""A request on its way in: as the router takes it from any front end (`GenerateRequest`), and as
a worker takes it from the router (`WorkerRequest`: a fresh prompt, or a moved request's
handoff), with the one rule for `timeout_s` (`check_timeout_s`).

    front end ── GenerateRequest ──► router ── WorkerRequest ──► Worker.submit ──► Engine

Each field is checked once, where a caller's input first becomes a request (the table:
`docs/architecture.md`, "Where each request field is checked"): `GenerateRequest` checks what the
router relies on before routing; a `WorkerRequest` is built by the router from a checked
`GenerateRequest` (or from a peer's handoff) and checks only its own shape; the engine's
`add_request` is the way in of the offline `LLM` and the worker, and checks there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.handoff import RequestHandoff
from pagedserve.workers.protocol.sampling import SamplingParams


def check_timeout_s(timeout_s: float | None) -> None:
    """A request's `timeout_s`, the one rule: None, or a finite number > 0. Run where a request
    is built from a caller's input: `GenerateRequest` (every front end) and the engine's
    `add_request` (the offline `LLM`, the worker)."""
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise RequestRejected(f"timeout_s must be a finite number > 0, got {timeout_s}")


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the router takes it from any front end."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    timeout_s: float | None = None
    trace_context: dict[str, str] | None = None  # the client's W3C traceparent, if any
    ingress: str = "python"  # grpc, http or python: names the front end on the trace
    tenant: str = ""  # who sent it (with auth on): request ids are unique per tenant
    # Whose prefix cache it may share (with auth on: its tenant's, or its tokens' cache group).
    cache_scope: str = ""
    lora: str | None = None  # the LoRA adapter it runs on (by name; None: the base model)

    def __post_init__(self) -> None:
        if self.prompt is not None and self.prompt_token_ids is not None:
            raise RequestRejected("prompt: set prompt or prompt_token_ids, not both")
        check_timeout_s(self.timeout_s)

    @property
    def prefix_salt(self) -> str | None:
        """What its prefix blocks are hashed with: the cache scope, then the client's own
        `cache_salt`. A client can narrow sharing within its scope, never reach past it."""
        parts = [part for part in (self.cache_scope, self.cache_salt) if part]
        return "/".join(parts) or None


@dataclass(frozen=True)
class WorkerRequest:
    """One request as a worker takes it: a fresh prompt, or (`handoff`) a moved request.

    Attributes:
        request_id: the id the worker knows it by (the router's tenant-scoped id).
        params: sampling parameters (validated by `SamplingParams` itself).
        prompt: token ids, or text the worker tokenizes; empty when `handoff` is set.
        handoff: a request a peer moved here, to continue where it stopped.
        priority: lower runs first under the `priority` scheduling policy.
        tenant: who sent it: the worker's scheduler shares the engine fairly among tenants.
        cache_salt: isolates this request's prefix cache entries (e.g. per tenant).
        timeout_s: the request ends with finish reason `timeout` after this long.
        trace_context: the W3C carrier of the caller's span, if traced.
        owner_id: the router whose lease keeps this request alive (None: no lease).
        lora: the LoRA adapter it runs on (its name; None: the base model).
    """

    request_id: str
    params: SamplingParams
    prompt: str | tuple[int, ...] = ()
    handoff: RequestHandoff | None = None
    priority: int = 0
    tenant: str = ""
    cache_salt: str | None = None
    timeout_s: float | None = None
    trace_context: Mapping[str, str] | None = field(default=None, hash=False)
    owner_id: str | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise RequestRejected("request_id is empty")
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if (self.handoff is None) == (not self.prompt):
            raise RequestRejected("give a prompt or a handoff, not both or neither")
        # `timeout_s` is not checked again: the router copies it from a checked
        # `GenerateRequest`, and the engine's `add_request` checks what reaches it.

    @classmethod
    def fresh(
        cls, request_id: str, prompt: str | Sequence[int], params: SamplingParams, **kwargs
    ) -> WorkerRequest:
        return cls(
            request_id, params, prompt if isinstance(prompt, str) else tuple(prompt), **kwargs
        )

    @classmethod
    def moved(cls, handoff: RequestHandoff, **kwargs) -> WorkerRequest:
        return cls(handoff.request_id, handoff.params, handoff=handoff, **kwargs)

    @property
    def num_branches(self) -> int:
        return 1 if self.handoff is not None else self.params.n
