"""How the newer OpenAI-style routes (`/tokenize`, `/v1/embeddings`, `/v1/responses`) read a
request, the same way `api.openai.api.OpenAIFrontend` reads completions: the bearer token first,
then a body of bounded size, JSON of bounded depth with valid text and only known fields, then
the served model (404 naming `model` when another is named); and the default output budget."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from pagedserve.cluster.api.auth import Caller, TokenAuth
from pagedserve.cluster.api.common import find_malformed_text
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.openai.models import Body, parse_body
from pagedserve.cluster.router.router import RouterCore

MAX_JSON_DEPTH = 32  # a request body nests 4 deep; anything far deeper is an attack
MAX_NUMBER_CHARS = 100  # longer than any number a field can take (an int64 has 19 digits)


async def read_request(
    request: Request,
    auth: TokenAuth,
    max_bytes: int,
    body_type: type,
    model_name: str,
    adapters: Callable[[], Awaitable[Collection[str]]] | None = None,
) -> tuple[Any, Caller]:
    """The checked body (a `body_type`) and its caller; `ApiError` naming what is wrong.

    A body whose `model` is None (a route where it is optional) is taken as the served model;
    a LoRA adapter's name (`adapters()`, asked only for a name that is not the model's) is
    served too.
    """
    caller = auth.check_headers(request.headers)
    raw = await read_body(request, max_bytes)
    body = parse_request(raw, body_type)
    if (
        body.model is not None
        and body.model != model_name
        and not await _is_adapter(body.model, adapters)
    ):
        raise ApiError(
            ErrorCode.NOT_FOUND,
            f"model: {body.model!r} is not served here (GET /v1/models: {model_name!r})",
            "model",
        )
    return body, caller


async def _is_adapter(name: str, adapters: Callable[[], Awaitable[Collection[str]]] | None) -> bool:
    return adapters is not None and name in await adapters()


async def room_for(core: RouterCore, prompt: str | list[int]) -> int:
    """Default output budget: what fits after the prompt in the smallest worker's context and
    KV pool (at least 1, so an over-long prompt gets the worker's own error)."""
    await core.start()
    if isinstance(prompt, str) and core.tokenizer is None:
        return 1  # the router refuses text without a tokenizer, naming the problem
    prompt_len = await core.prompt_length(prompt)
    capacities = [w.capacity_tokens() for w in core.workers.values() if w.alive]
    return max(1, min(capacities, default=1) - prompt_len)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to pass `limit` bytes: from its
    `content-length` before reading, else while reading it, so a huge body costs no more
    than `limit` bytes of memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(raw: bytes, model: type[Body]) -> Body:
    """A request body as `model`: JSON of bounded depth with finite numbers, valid text, known
    fields of the right types; else an `ApiError` (400) naming the field at fault."""
    data = parse_json(raw)
    if isinstance(data, dict) and (bad := find_malformed_text(data, "")) is not None:
        raise ApiError.invalid(f"{bad} is not valid UTF-8", bad)
    return parse_body(model, data)  # refuses a body that is not an object


def parse_json(raw: bytes) -> Any:
    """JSON nested at most `MAX_JSON_DEPTH` deep, whose numbers are finite and at most
    `MAX_NUMBER_CHARS` long (400 otherwise, naming the field that holds a bad number)."""
    try:
        # surrogateescape keeps invalid UTF-8 bytes as lone surrogates (find_malformed_text).
        data = json.loads(
            raw.decode("utf-8", "surrogateescape"),
            parse_constant=BadNumber,
            parse_int=_parse_int,
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as error:
        raise ApiError.invalid(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise _too_deep() from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    found = _find_bad_number(data, "")
    if found is not None:
        path, number = found
        field = path if isinstance(data, dict) else None  # a field only in a JSON object
        raise ApiError.invalid(
            f"{field or 'the request body'} holds {number.text}: numbers must be finite and "
            f"at most {MAX_NUMBER_CHARS} characters long",
            field,
        )
    return data


@dataclass(frozen=True)
class BadNumber:
    """A number JSON can spell but no field can hold (NaN, Infinity, 1e400, a 5,000-digit
    integer), kept in the parsed body so that the field holding it can be named."""

    text: str


def _parse_int(text: str) -> int | BadNumber:
    # Python refuses to convert integers of more than 4,300 digits with a bare ValueError.
    return int(text) if len(text) <= MAX_NUMBER_CHARS else BadNumber(_shorten(text))


def _parse_float(text: str) -> float | BadNumber:
    value = float(text)
    ok = math.isfinite(value) and len(text) <= MAX_NUMBER_CHARS
    return value if ok else BadNumber(_shorten(text))


def _shorten(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text):,} characters)"


def _find_bad_number(value: Any, path: str) -> tuple[str, BadNumber] | None:
    """The path of the first `BadNumber` under `value` (nested at most MAX_JSON_DEPTH deep)."""
    if isinstance(value, BadNumber):
        return path, value
    if isinstance(value, dict):
        # A key may hold invalid UTF-8 (as a lone surrogate): escaped, the path stays printable.
        items = (
            (_join_key(path, key.encode("utf-8", "backslashreplace").decode()), item)
            for key, item in value.items()
        )
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for item_path, item in items:
        found = _find_bad_number(item, item_path)
        if found is not None:
            return found
    return None


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0), without recursion."""
    depth, level = 0, [value]
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]
    return depth


def _join_key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        ErrorCode.INVALID_ARGUMENT,
        f"the request body is {size:,} bytes or more; the limit is {limit:,} (max_request_bytes)",
        http_status=413,
    )


def _too_deep() -> ApiError:
    return ApiError.invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
