"""The API's error classes, shared by the gRPC and the HTTP front ends.

Every failure a client can cause or see becomes one `ApiError` with a canonical code (named as
gRPC names its status codes); each front end maps the code to its own wire form:

| code (= gRPC status) | HTTP | OpenAI `type`         | raised for                            |
|----------------------|------|-----------------------|---------------------------------------|
| INVALID_ARGUMENT     | 400  | invalid_request_error | a bad field (the message names it)    |
| RESOURCE_EXHAUSTED   | 400  | invalid_request_error | a request that can never fit the pool |
| RESOURCE_EXHAUSTED   | 429  | rate_limit_error      | overloaded now: retry after the hint  |
| UNAUTHENTICATED      | 401  | authentication_error  | bearer token missing or wrong         |
| NOT_FOUND            | 404  | not_found_error       | unknown model, adapter or health svc  |
| UNAVAILABLE          | 503  | server_error          | no worker alive                       |
| INTERNAL             | 500  | server_error          | a failed engine step, or a bug        |

Nothing a client sees carries internals: a Ray error names actor ids, addresses, process ids and
file paths, so `as_api_error` keeps only what the client can act on, and every failure nobody
foresaw (a bug) becomes `internal_error`: INTERNAL with a short incident id that the server log
holds beside the whole traceback.

RESOURCE_EXHAUSTED is 400 over HTTP when the request will never fit, so a client must not retry
it (OpenAI answers an over-long prompt the same way); it is 429 with a `Retry-After` header (gRPC:
`retry-after` trailing metadata) when a waiting queue is full now (`Overloaded`): the error's
`retry_after_s` tells the two apart.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from enum import StrEnum

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pagedserve.workers.protocol.errors import (
    NoWorkerAvailable,
    Overloaded,
    RequestRejected,
    RequestTooLarge,
    UnknownLora,
    WorkerLost,
)

logger = logging.getLogger(__name__)


class ErrorCode(StrEnum):
    """Canonical error codes; the values are gRPC's status code names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}

OPENAI_ERROR_TYPE: dict[ErrorCode, str] = {
    ErrorCode.INVALID_ARGUMENT: "invalid_request_error",
    ErrorCode.RESOURCE_EXHAUSTED: "invalid_request_error",
    ErrorCode.UNAUTHENTICATED: "authentication_error",
    ErrorCode.NOT_FOUND: "not_found_error",
    ErrorCode.UNAVAILABLE: "server_error",
    ErrorCode.INTERNAL: "server_error",
}

# "temperature must be >= 0, got -1" → "temperature"; "stop[1] must be ..." → "stop[1]".
_LEADING_FIELD = re.compile(
    r"^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*)"
    r"(?::| (?:must|is|holds|encodes|has|was|needs)\b)"
)


class ApiError(Exception):
    """A failure to report to the client as it is.

    Args:
        code: the canonical code.
        message: what went wrong, naming the field when a field is at fault.
        param: the field at fault, when there is one (derived from the message if not given).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param if param is not None else field_of(message)
        self.retry_after_s = retry_after_s  # set only when retrying later can succeed
        self._http_status = http_status  # a more precise HTTP status (413) than the code's

    @property
    def http_status(self) -> int:
        if self._http_status is not None:
            return self._http_status
        if self.code is ErrorCode.RESOURCE_EXHAUSTED and self.retry_after_s is not None:
            return 429
        return HTTP_STATUS[self.code]

    @property
    def openai_type(self) -> str:
        return "rate_limit_error" if self.http_status == 429 else OPENAI_ERROR_TYPE[self.code]

    def retry_after_header(self) -> str | None:
        """Whole seconds, at least 1, as HTTP's `Retry-After` takes them."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))

    def __repr__(self) -> str:
        return f"ApiError({self.code.value}, {self.message!r})"

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        return cls(ErrorCode.INVALID_ARGUMENT, message, param)


def field_of(message: str) -> str | None:
    """The field a validation message starts with, if it starts with one."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match else None


def as_api_error(error: BaseException) -> ApiError | None:
    """The `ApiError` for a failure of the router or a worker; None for anything else (a bug).

    Rejections raised inside a worker arrive as `RayTaskError` subclasses of the original class;
    their own message is in `.cause` (the wrapper's adds a traceback). A lost actor's message
    (actor id, address, pid) is logged, never returned.
    """
    if isinstance(error, ApiError):
        return error
    cause = getattr(error, "cause", None) or error
    message = str(cause)
    if isinstance(error, Overloaded):
        retry_after_s = getattr(cause, "retry_after_s", None) or 1.0
        return ApiError(ErrorCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s)
    if isinstance(error, RequestTooLarge):
        return ApiError(ErrorCode.RESOURCE_EXHAUSTED, message)
    if isinstance(error, UnknownLora):
        return ApiError(ErrorCode.NOT_FOUND, message, "model")
    if isinstance(error, RequestRejected):
        return ApiError(ErrorCode.INVALID_ARGUMENT, message)
    if isinstance(error, NoWorkerAvailable | WorkerLost):
        return ApiError(ErrorCode.UNAVAILABLE, message)
    if isinstance(error, RayActorError | ActorDiedError | ActorUnavailableError):
        logger.warning("a worker is unavailable: %s", message)
        return ApiError(ErrorCode.UNAVAILABLE, "a worker is unavailable; retry")
    return None


def internal_error(error: BaseException) -> ApiError:
    """INTERNAL for a failure nobody foresaw: the client gets a short incident id, the log gets
    the same id with the whole traceback."""
    incident = uuid.uuid4().hex[:12]
    logger.error("internal error %s", incident, exc_info=error)
    return ApiError(ErrorCode.INTERNAL, f"internal error (incident {incident})")


def engine_failure(detail: str) -> ApiError:
    """INTERNAL for a request whose engine step failed on its worker (`detail`, logged only)."""
    incident = uuid.uuid4().hex[:12]
    logger.error("engine failure %s: %s", incident, detail)
    return ApiError(
        ErrorCode.INTERNAL, f"the engine step serving this request failed (incident {incident})"
    )


def to_api_error(error: BaseException) -> ApiError:
    """Every failure as the client may see it: `as_api_error`, else `internal_error`."""
    return as_api_error(error) or internal_error(error)
