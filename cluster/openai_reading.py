"""How the newer OpenAI-style routes (`/tokenize`, `/v1/embeddings`, `/v1/responses`) read a
request, the same way `openai_api.OpenAIFrontend` reads completions: the bearer token first,
then a body of bounded size, JSON of bounded depth with valid text and only known fields, then
the served model (404 naming `model` when another is named); and the default output budget."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from pagedserve.cluster.api_errors import ApiError, ErrorCode
from pagedserve.cluster.auth import Caller, TokenAuth
from pagedserve.cluster.openai_api import parse_request, read_body
from pagedserve.cluster.router import RouterCore


async def read_request(
    request: Request, auth: TokenAuth, max_bytes: int, body_type: type, model_name: str
) -> tuple[Any, Caller]:
    """The checked body (a `body_type`) and its caller; `ApiError` naming what is wrong.

    A body whose `model` is None (a route where it is optional) is taken as the served model.
    """
    caller = auth.check(request.headers.get("authorization"))
    raw = await read_body(request, max_bytes)
    body = parse_request(raw, body_type)
    if body.model is not None and body.model != model_name:
        raise ApiError(
            ErrorCode.NOT_FOUND,
            f"model: {body.model!r} is not served here (GET /v1/models: {model_name!r})",
            "model",
        )
    return body, caller


async def room_for(core: RouterCore, prompt: str | list[int]) -> int:
    """Default output budget: what fits after the prompt in the smallest worker's context and
    KV pool (at least 1, so an over-long prompt gets the worker's own error); the rule of
    `OpenAIFrontend._room_for`."""
    await core.start()
    if isinstance(prompt, str) and core.tokenizer is None:
        return 1  # the router refuses text without a tokenizer, naming the problem
    prompt_len = await core.prompt_length(prompt)
    capacities = [w.capacity_tokens() for w in core.workers.values() if w.alive]
    return max(1, min(capacities, default=1) - prompt_len)
