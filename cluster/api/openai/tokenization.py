"""`POST /tokenize` and `POST /detokenize`: the served model's tokenizer, in vLLM's shapes.

    /tokenize   {"prompt": text} or {"messages": [...]}  → {"count", "max_model_len", "tokens"}
    /detokenize {"tokens": [ids]}                        → {"prompt": text}

A chat goes through the model's chat template (`add_generation_prompt`, default true) exactly
as `/v1/chat/completions` renders it, so `count` is what that call's `usage.prompt_tokens`
will be. `add_special_tokens` (default true for a prompt, false for a chat, as vLLM) true
tokenizes as the server does for generation (BOS first where the model's tokenizer adds one);
false adds nothing the text does not spell. `return_token_strs` adds each token's text.

Like every route it takes the bearer token when auth is on. `model` may be left out (vLLM's
rule); when given it must be the served model. Text is measured against `max_prompt_chars`
first, then rendered and tokenized in a thread, off the router's event loop, as generation's
prompts are (`RouterCore._tokenize`). `max_model_len` is the smallest context of the alive
workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.common import chat_prompt
from pagedserve.cluster.api.errors import ApiError, to_api_error
from pagedserve.cluster.api.openai.api import error_response
from pagedserve.cluster.api.openai.chat_messages import ChatMessage
from pagedserve.cluster.api.openai.reading import read_request
from pagedserve.cluster.router.route import check_prompt_size
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.protocol.errors import RequestRejected


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeBody(_Body):
    """`POST /tokenize`: `prompt` or `messages`, not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: true for a prompt, false for a chat
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeFrontend:
    """Serves `/tokenize` and `/detokenize` from the router's tokenizer.

    Args:
        core: the router (its tokenizer, size limits and workers' contexts).
        auth: the token check (a no-op when auth is off).
        model_name: the served model's id.
    """

    def __init__(self, core: RouterCore, auth: TokenAuth, model_name: str) -> None:
        self.core = core
        self.auth = auth
        self.model_name = model_name

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._read(request, TokenizeBody)
            tokens = await asyncio.to_thread(self._tokens_of, body)
            token_strs = None
            if body.return_token_strs:
                token_strs = [self.core.tokenizer.token_text(t) for t in tokens]
            await self.core.start()  # the workers' contexts
            answer = TokenizeResponse(
                count=len(tokens),
                max_model_len=self._max_model_len(),
                tokens=tokens,
                token_strs=token_strs,
            )
        except Exception as error:
            return error_response(to_api_error(error))
        return JSONResponse(answer.model_dump(exclude_none=True))

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._read(request, DetokenizeBody)
            check_prompt_size(len(body.tokens), self.core.config.limits.max_prompt_chars)
            text = await asyncio.to_thread(self._text_of, body.tokens)
        except Exception as error:
            return error_response(to_api_error(error))
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    # -------------------------------------------------------------- plumbing
    async def _read(self, request: Request, body_type: type[_Body]) -> Any:
        max_bytes = self.core.config.limits.max_request_bytes
        body, _ = await read_request(request, self.auth, max_bytes, body_type, self.model_name)
        if self.core.tokenizer is None:
            raise ApiError.invalid("the served model has no tokenizer")
        return body

    def _tokens_of(self, body: TokenizeBody) -> list[int]:
        """The body's token ids (in a thread: a chat template and a long text take time)."""
        if (body.prompt is None) == (body.messages is None):
            raise ApiError.invalid("give prompt or messages, not both nor neither", "prompt")
        limit = self.core.config.limits.max_prompt_chars
        if body.messages is not None:
            check_prompt_size(sum(len(m.text()) for m in body.messages), limit)
            turns = chat_turns(body.messages)
            text = chat_prompt(turns, self.core.tokenizer, body.add_generation_prompt)
            add_special = bool(body.add_special_tokens)
        else:
            check_prompt_size(len(body.prompt), limit)
            text = body.prompt
            add_special = body.add_special_tokens is not False
        return encode(self.core.tokenizer, text, add_special)

    def _text_of(self, tokens: list[int]) -> str:
        vocab_size = self.core.tokenizer.vocab_size
        for i, token in enumerate(tokens):
            if not 0 <= token < vocab_size:
                raise ApiError.invalid(
                    f"tokens[{i}]: {token} is not a token id of this model (0..{vocab_size - 1})",
                    f"tokens[{i}]",
                )
        return self.core.tokenizer.decode(tokens)

    def _max_model_len(self) -> int:
        contexts = [w.info.max_model_len for w in self.core.workers.values() if w.info]
        return min(contexts, default=0)


def chat_turns(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them; INVALID_ARGUMENT naming one without content."""
    for i, message in enumerate(messages):
        if message.content is None:
            raise ApiError.invalid(f"messages[{i}].content: field required", f"messages[{i}]")
    return [{"role": m.role, "content": m.text()} for m in messages]


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids: as generation tokenizes it (`add_special_tokens`), or with only
    the tokens the text spells (no BOS added)."""
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", None)
    if add_special_tokens or hf_tokenizer is None:  # the byte tokenizer adds none anyway
        return tokenizer.encode(text)
    try:
        return list(hf_tokenizer.encode(text, add_special_tokens=False))
    except Exception as error:  # a tokenizer's own failure on odd text: the text's fault
        raise RequestRejected(f"prompt: cannot be tokenized ({error})") from None
