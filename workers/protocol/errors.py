"""Why a request is refused or ends in error, as every process sees it: a worker's refusals
(`RequestRejected` and its kinds, which the front ends map to gRPC and HTTP statuses) and the
router's (`NoWorkerAvailable`, `WorkerLost`)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served as given (bad input or too large to ever fit)."""


class NoChatTemplate(RequestRejected):
    """A chat request for a model whose tokenizer has no chat template (INVALID_ARGUMENT)."""


class UnknownLora(RequestRejected):
    """A request for a LoRA adapter that is not loaded (NOT_FOUND, HTTP 404); the message
    names it."""


class LoraLoadError(RequestRejected):
    """A LoRA adapter that cannot be loaded (INVALID_ARGUMENT, HTTP 400); the message names
    the adapter and the problem."""


class RequestTooLarge(RequestRejected):
    """Valid, but prompt + max_tokens can never fit in this worker's KV pool."""


class Overloaded(RequestRejected):
    """Valid, but a waiting queue is full now: retry after `retry_after_s` seconds.

    Raised at once instead of queueing without bound (RESOURCE_EXHAUSTED, HTTP 429).
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep `retry_after_s` across Ray's pickling
        return type(self), (str(self), self.retry_after_s)


class Draining(Overloaded):
    """The worker is draining for shutdown: it admits nothing new and ends the streams still
    open at the end of its grace period with this error. The router replays such a request on
    a peer; a client that sees it may retry at once elsewhere."""


class HandedOff(Draining):
    """A stream the draining worker had admitted but could not finish within its grace period
    (as opposed to a new request it refused): the router counts these as drain handoffs."""


class NoWorkerAvailable(RuntimeError):
    """No alive worker can take the request (maps to UNAVAILABLE)."""


class WorkerLost(RuntimeError):
    """The worker serving a stream died mid-request."""
