"""Log-probabilities and `echo` in OpenAI's shapes, for `/v1/completions` and chat.

Completions (the legacy shape, what evaluation harnesses read)::

    "logprobs": {"tokens": ["The", " cat"], "token_logprobs": [null, -2.3],
                 "top_logprobs": [null, {" cat": -2.3, " dog": -2.9}], "text_offset": [0, 3]}

With `echo`, a choice's text starts with its prompt and, with `logprobs`, its log-probabilities
start with the prompt's (the first token has none: `null`), so one request with
`max_tokens: 1, echo: true, logprobs: 0` scores a whole text. Chat::

    "logprobs": {"content": [{"token": "Paris", "logprob": -0.01, "bytes": [80, ...],
                              "top_logprobs": [{"token": "Paris", "logprob": -0.01, ...}]}]}

A streamed choice gets the echoed prompt (and its log-probabilities) in its first chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.responses import (
    ChatLogprob,
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
)
from pagedserve.workers.protocol.stream import TokenLogprob


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as an `echo` shows it: its text, and the text of its first token (which has no
    log-probability, so the worker sends no entry to name it)."""

    text: str
    first_token: str


@dataclass
class CompletionExtras:
    """Owns what a completion choice shows beyond its new text, across a stream's chunks.

    Args:
        echo: the echoed prompt of each prompt of the request; None without `echo`.
        logprobs: whether the request asked for log-probabilities.
    """

    echo: list[EchoedPrompt] | None = None
    logprobs: bool = False
    _offsets: dict[int, int] = field(default_factory=dict)  # choice → text emitted so far

    def piece(
        self,
        choice: int,
        prompt_index: int,
        text: str,
        logprobs: Sequence[TokenLogprob | None] | None,
        prompt_logprobs: Sequence[TokenLogprob | None] | None,
    ) -> tuple[str, CompletionLogprobs | None]:
        """The text and `logprobs` object of a choice's next chunk (or of the whole choice)."""
        first = choice not in self._offsets
        items: list[TokenLogprob | None] = []
        first_token = ""
        if first and self.echo is not None:
            echoed = self.echo[prompt_index]
            text = echoed.text + text
            first_token = echoed.first_token
            items += prompt_logprobs or []
        items += logprobs or []
        offset = self._offsets.get(choice, 0)
        self._offsets[choice] = offset + len(text)
        if not self.logprobs:
            return text, None
        return text, legacy_logprobs(items, offset, first_token)


def legacy_logprobs(
    items: Sequence[TokenLogprob | None], offset: int = 0, missing_token: str = ""
) -> CompletionLogprobs:
    """The completions `logprobs` object; an entry without a log-probability shows as null."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for item in items:
        offsets.append(offset)
        token = missing_token if item is None else item.token
        tokens.append(token)
        values.append(None if item is None else item.logprob)
        tops.append(None if item is None else {t.token: t.logprob for t in item.top})
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
    )


def chat_logprobs(items: Sequence[TokenLogprob | None] | None) -> ChatLogprobs | None:
    """The chat `logprobs` object of some tokens (None when none were asked for)."""
    if items is None:
        return None
    return ChatLogprobs(content=[_chat_entry(item) for item in items if item is not None])


def _chat_entry(item: TokenLogprob) -> ChatLogprobEntry:
    top = [ChatLogprob(token=t.token, logprob=t.logprob, bytes=_utf8(t.token)) for t in item.top]
    return ChatLogprobEntry(
        token=item.token, logprob=item.logprob, bytes=_utf8(item.token), top_logprobs=top
    )


def _utf8(token: str) -> list[int]:
    # `bytes` as vLLM fills it: the UTF-8 of the token's text.
    return list(token.encode("utf-8"))


def echoed_prompts(prompts: Sequence[str | list[int]], tokenizer: Any) -> list[EchoedPrompt]:
    """What `echo` shows of each prompt: its text (token-id prompts decoded) and first token."""
    echoed = []
    for prompt in prompts:
        if tokenizer is None:  # a text prompt echoes as itself; token ids have no text here
            if not isinstance(prompt, str):
                raise ApiError.invalid("echo: the model has no tokenizer to show ids as text")
            echoed.append(EchoedPrompt(prompt, ""))
            continue
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        first = tokenizer.token_text(ids[0]) if ids and hasattr(tokenizer, "token_text") else ""
        echoed.append(EchoedPrompt(text, first))
    return echoed
