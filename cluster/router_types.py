"""What the router takes and the failures it raises, apart from `RouterCore` so that light
modules (API errors, clients, benches) can name them. Import them from here, never from
`cluster/router.py` (which only uses them)."""

from __future__ import annotations

import dataclasses
import math

from pagedserve.workers.errors import RequestRejected
from pagedserve.workers.sampling_params import SamplingParams


class NoWorkerAvailable(RuntimeError):
    """No alive worker can take the request (maps to UNAVAILABLE)."""


class WorkerLost(RuntimeError):
    """The worker serving a stream died mid-request."""


@dataclasses.dataclass
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

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise RequestRejected(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
