"""`POST /v1/embeddings`: the served model's embeddings, in the OpenAI API's shapes.

    {"model", "input": TEXT | [TEXT, ...] | [ids] | [[ids], ...], "encoding_format"?}
      → {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
         "model", "usage": {"prompt_tokens", "total_tokens"}}

Each input is one prefill-only request (`SamplingParams.pooling`, `workers/engine/pooling.py`)
through the router as any generation: admission, tokenizing off the event loop, prefix-aware
routing, the worker's scheduler and prefix cache, tracing and metrics. The vector is the final
hidden state (after the final norm) of the prompt's last token, or the mean over its positions
(the deployment's `embedding_pooling`), L2-normalised, as vLLM does for decoder models.

`encoding_format`: `float` (a list of numbers), or `base64` of the little-endian float32 bytes
(the official openai client's default: it asks for base64 and decodes it). `dimensions` is
refused (400): the vectors are the model's hidden size and are not truncated.

`Embedder` runs a batch of inputs through the router; gRPC's `Embed` (`api.grpc.api`) uses it too.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.common import merge_streams, new_request_id
from pagedserve.cluster.api.errors import ApiError, ErrorCode, engine_failure, to_api_error
from pagedserve.cluster.api.openai.api import error_response
from pagedserve.cluster.api.openai.reading import read_request
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.tracing import tag_ingress
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import Pooling, SamplingParams

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs


class EmbeddingBody(BaseModel):
    """`POST /v1/embeddings`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does with it
    # cluster extras
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The batch, each item a text or token ids; INVALID_ARGUMENT naming an empty one."""
        if self.dimensions is not None:
            raise ApiError.invalid(
                "dimensions is not supported: embeddings have the model's hidden size",
                "dimensions",
            )
        items = self.input
        if isinstance(items, str) or (items and isinstance(items[0], int)):
            return check_inputs([items], "input", one=True)
        return check_inputs(items, "input")


def check_inputs(items: list, field: str, one: bool = False) -> list[str | list[int]]:
    """`items` to embed, each non-empty, at most `MAX_INPUTS`; INVALID_ARGUMENT naming `field`
    (or `field[i]`; `one`: the request sent one item, not a list)."""
    if not items:
        raise ApiError.invalid(f"{field} is empty: give a text or token ids to embed", field)
    if len(items) > MAX_INPUTS:
        raise ApiError.invalid(
            f"{field} has {len(items):,} items; at most {MAX_INPUTS:,} are allowed", field
        )
    for i, item in enumerate(items):
        if not item:
            param = field if one else f"{field}[{i}]"
            raise ApiError.invalid(f"{param} is empty: there is nothing to embed", param)
    return list(items)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class Embedder:
    """Runs a batch of inputs through the router as embedding requests, one per input.

    Args:
        core: the router.
        pooling: how this deployment pools (`ApiConfig.embedding_pooling`).
    """

    def __init__(self, core: RouterCore, pooling: Pooling) -> None:
        self.core = core
        self.params = SamplingParams(max_tokens=1, pooling=pooling)

    async def embed(
        self, inputs: list[str | list[int]], base_id: str, template: GenerateRequest
    ) -> tuple[list[list[float]], int]:
        """Every input's vector, in input order, and the prompt tokens of them all.

        Args:
            inputs: texts or token ids (checked by `check_inputs`).
            base_id: input i runs as request `{base_id}-{i}`.
            template: the request's caller, scheduling and trace fields (its prompt unset).
        """
        requests = [
            dataclasses.replace(
                template,
                params=self.params,
                prompt=item if isinstance(item, str) else None,
                prompt_token_ids=None if isinstance(item, str) else list(item),
                request_id=f"{base_id}-{i}",
            )
            for i, item in enumerate(inputs)
        ]
        vectors: list[list[float] | None] = [None] * len(requests)
        prompt_tokens = 0
        async for i, delta in merge_streams([self.core.generate(r) for r in requests]):
            if delta.error:
                raise engine_failure(delta.error)
            if delta.finish_reason is None:
                continue
            if delta.embedding is None:  # aborted on the worker (a drain, a shutdown)
                raise ApiError(
                    ErrorCode.UNAVAILABLE,
                    f"input[{i}] ended ({delta.finish_reason}) before its embedding; retry",
                )
            vectors[i] = delta.embedding
            prompt_tokens += delta.usage.prompt_tokens if delta.usage else 0
        return vectors, prompt_tokens


class EmbeddingsFrontend:
    """Serves `/v1/embeddings` through an `Embedder`.

    Args:
        embedder: runs the inputs.
        auth: the token check (a no-op when auth is off).
        model_name: the served model's id.
    """

    def __init__(self, embedder: Embedder, auth: TokenAuth, model_name: str) -> None:
        self.embedder = embedder
        self.auth = auth
        self.model_name = model_name

    async def embeddings(self, request: Request) -> Response:
        try:
            max_bytes = self.embedder.core.config.limits.max_request_bytes
            body, caller = await read_request(
                request, self.auth, max_bytes, EmbeddingBody, self.model_name
            )
            inputs = body.inputs()
            base_id = body.request_id or new_request_id("embd-")
            template = GenerateRequest(
                params=self.embedder.params,
                priority=body.priority,
                cache_salt=body.cache_salt,
                tenant=caller.tenant,
                cache_scope=caller.cache_scope,
            )
            (template,) = tag_ingress([template], request.headers.items(), "http")
            vectors, prompt_tokens = await self.embedder.embed(inputs, base_id, template)
        except Exception as error:
            return error_response(input_error(to_api_error(error)))
        data = [
            EmbeddingData(index=i, embedding=encode(vector, body.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        answer = EmbeddingList(
            id=base_id,
            created=int(time.time()),
            model=self.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
        return JSONResponse(answer.model_dump())


def input_error(error: ApiError, field: str = "input") -> ApiError:
    """The router names a bad prompt `prompt` or `prompt_token_ids`; here it is `field`."""
    for name in ("prompt_token_ids", "prompt"):
        if error.param == name or error.message.startswith(name):
            message = field + error.message.removeprefix(name)
            return ApiError(error.code, message, field, error.retry_after_s)
    return error


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the client asked: numbers, or base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
