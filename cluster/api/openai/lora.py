"""LoRA adapters over HTTP, in vLLM's shapes: `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`), behind the
same token check as every route; a request selects an adapter with `model: "<lora_name>"`, and
`GET /v1/models` lists each adapter with the base model as its `parent`.

A load that fails (a malformed directory, a rank over `max_lora_rank`, a target the model
lacks) answers 400 naming the problem and changes nothing; an unknown adapter answers 404
naming it. Unloading an adapter with requests in flight lets them finish on it; new requests
on it get 404 at once.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.openai.reading import parse_request, read_body
from pagedserve.cluster.router.router import RouterCore

MAX_LORA_BODY_BYTES = 64 * 1024


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str | None = None  # vLLM's body may carry it; unused


class LoraAdmin:
    """The two adapter routes over a `RouterCore` (errors: the caller's `error_response`)."""

    def __init__(self, core: RouterCore, auth: TokenAuth) -> None:
        self.core = core
        self.auth = auth

    async def load(self, request: Request) -> Response:
        body = await self._read(request, LoadLoraBody)
        key = await self.core.load_lora(body.lora_name, body.lora_path)
        return JSONResponse({"lora_name": body.lora_name, "status": "loaded", "key": key})

    async def unload(self, request: Request) -> Response:
        body = await self._read(request, UnloadLoraBody)
        await self.core.unload_lora(body.lora_name)
        return JSONResponse({"lora_name": body.lora_name, "status": "unloaded"})

    async def _read(self, request: Request, body_type: type[BaseModel]):
        self.auth.check_headers(request.headers)
        raw = await read_body(request, MAX_LORA_BODY_BYTES)
        return parse_request(raw, body_type)
