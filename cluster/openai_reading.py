"""How the newer OpenAI-style routes (`/tokenize`, `/v1/embeddings`, `/v1/responses`) read a
request, the same way `openai_api.OpenAIFrontend` reads completions: the bearer token first,
then a body of bounded size, JSON of bounded depth with valid text and only known fields, then
the served model (404 naming `model` when another is named)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from pagedserve.cluster.api_errors import ApiError, ErrorCode
from pagedserve.cluster.auth import Caller, TokenAuth
from pagedserve.cluster.openai_api import parse_request, read_body


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
