"""The adapter endpoints' own checks, before any worker is asked: the token (with auth on) and
the body's shape (vLLM's field names; anything else is a 400 naming it)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.errors import ApiError, ErrorCode
from pagedserve.cluster.api.openai.lora import LoraAdmin


class _Core:
    """Records what reaches the router."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def load_lora(self, name: str, path: str) -> str:
        self.calls.append(("load", name, path))
        return f"{name}@0"

    async def unload_lora(self, name: str) -> None:
        self.calls.append(("unload", name))


def _request(body: dict | str, token: str | None = None) -> Request:
    raw = (body if isinstance(body, str) else json.dumps(body)).encode()
    headers = [(b"content-type", b"application/json")]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    sent = [False]

    async def receive() -> dict:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    return Request(scope, receive)


def test_load_and_unload_reach_the_router_with_vllms_bodies():
    core = _Core()
    admin = LoraAdmin(core, TokenAuth())
    body = {"lora_name": "sql", "lora_path": "/a/sql"}
    loaded = asyncio.run(admin.load(_request(body)))
    assert json.loads(loaded.body) == {"lora_name": "sql", "status": "loaded", "key": "sql@0"}
    asyncio.run(admin.unload(_request({"lora_name": "sql", "lora_path": "/a/sql"})))
    assert core.calls == [("load", "sql", "/a/sql"), ("unload", "sql")]


def test_with_auth_on_a_load_needs_a_token():
    core = _Core()
    admin = LoraAdmin(core, TokenAuth(["tok"]))
    body = {"lora_name": "sql", "lora_path": "/a/sql"}
    for token in (None, "wrong"):
        with pytest.raises(ApiError) as raised:
            asyncio.run(admin.load(_request(body, token)))
        assert raised.value.code is ErrorCode.UNAUTHENTICATED
    asyncio.run(admin.load(_request(body, "tok")))
    assert core.calls == [("load", "sql", "/a/sql")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "sql"}, "lora_path"),
        ({"lora_name": "", "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "sql", "lora_path": "/a", "extra": 1}, "extra"),
        ({"lora_name": 3, "lora_path": "/a"}, "lora_name"),
    ],
)
def test_a_malformed_body_is_a_400_naming_the_field(body, param):
    core = _Core()
    with pytest.raises(ApiError) as raised:
        asyncio.run(LoraAdmin(core, TokenAuth()).load(_request(body)))
    assert raised.value.code is ErrorCode.INVALID_ARGUMENT and param in str(raised.value)
    assert core.calls == []
