"""The OpenAI answers of one request's stream: `CompletionChunks` builds `text_completion`
bodies and chunks, `ChatChunks` `chat.completion` ones (its text read for tool calls when the
request declared tools); both number choices as prompt index * n + branch, and spell a finish
reason as OpenAI's JSON does. The routes that send them are in `api.openai.api`.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedserve.cluster.api.openai.logprobs import CompletionExtras, chat_logprobs
from pagedserve.cluster.api.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionChunk,
    UsageInfo,
)
from pagedserve.cluster.api.openai.tool_call_parser import ToolAnswers
from pagedserve.workers.engine.outputs import CompletionCollector, CompletionOutput
from pagedserve.workers.protocol.stream import FinishReason, StreamDelta, Usage


class _ChoiceBuilder:
    """What both response builders share: the response's id, time and model, and choice
    numbering (choice = prompt index * n + branch)."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.n = n

    def choice_index(self, prompt_index: int, branch: int) -> int:
        return prompt_index * self.n + branch

    def results(
        self, collectors: list[CompletionCollector]
    ) -> Iterator[tuple[int, CompletionOutput]]:
        """Every finished branch of every prompt, with its choice index, in choice order."""
        for i, collector in enumerate(collectors):
            for result in collector.completions:
                yield self.choice_index(i, result.index), result


class CompletionChunks(_ChoiceBuilder):
    """Builds `text_completion` bodies and stream chunks."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        super().__init__(request_id, created, model, n)
        self.extras = CompletionExtras()  # echo and log-probabilities, when asked for
        self.keep_best: int | None = None  # `best_of`: the branches returned per prompt

    def start(self) -> list[CompletionChunk]:
        return []

    def chunk(self, index: int, delta: StreamDelta) -> CompletionChunk | None:
        """The chunk of one delta; None when it has nothing to send yet."""
        if is_empty(delta):
            return None
        return self._chunk([self._choice(index, delta, spelled(delta.finish_reason))])

    def whole(self, collectors: list[CompletionCollector]) -> Completion:
        if self.keep_best is not None:
            for collector in collectors:
                collector.keep_best(self.keep_best)
        return Completion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                self._choice(i, c, spelled(c.finish_reason)) for i, c in self.results(collectors)
            ],
            usage=UsageInfo.of(Usage.total(c.usage() for c in collectors)),
        )

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return self._chunk([], UsageInfo.of(usage))

    def _choice(
        self, index: int, part: StreamDelta | CompletionOutput, finish_reason: str | None
    ) -> CompletionChoice:
        """A delta's (or a whole completion's) choice, with `echo` and `logprobs` applied."""
        text, logprobs = self.extras.piece(
            index, index // self.n, part.text, part.logprobs, part.prompt_logprobs
        )
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
        )

    def _chunk(
        self, choices: list[CompletionChoice], usage: UsageInfo | None = None
    ) -> CompletionChunk:
        return CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )


class ChatChunks(_ChoiceBuilder):
    """Builds `chat.completion` bodies and `chat.completion.chunk` stream chunks; with `tools`
    set, each choice's text is read for tool calls."""

    def __init__(self, request_id: str, created: int, model: str, n: int) -> None:
        super().__init__(request_id, created, model, n)
        self.tools: ToolAnswers | None = None

    def start(self) -> list[ChatCompletionChunk]:
        """One chunk per branch naming the assistant's role, before any text (as OpenAI)."""
        role = ChatDelta(role="assistant", content="")
        return [
            self._chunk([ChatChunkChoice(index=j, delta=role, logprobs=None, finish_reason=None)])
            for j in range(self.n)
        ]

    def chunk(self, index: int, delta: StreamDelta) -> ChatCompletionChunk | None:
        """The chunk of one delta; None when it has nothing to send yet."""
        content, calls, finish_reason = delta.text or None, None, spelled(delta.finish_reason)
        if self.tools is not None:
            content, calls, finish_reason = self.tools.delta(index, delta.text, finish_reason)
        if not content and not calls and finish_reason is None and not delta.logprobs:
            return None
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=content, tool_calls=calls),
            logprobs=chat_logprobs(delta.logprobs),
            finish_reason=finish_reason,
        )
        return self._chunk([choice])

    def whole(self, collectors: list[CompletionCollector]) -> ChatCompletion:
        choices = [self._choice(index, c) for index, c in self.results(collectors)]
        return ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(Usage.total(c.usage() for c in collectors)),
        )

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], UsageInfo.of(usage))

    def _choice(self, index: int, result: CompletionOutput) -> ChatChoice:
        message = AssistantMessage(content=result.text)
        finish_reason = spelled(result.finish_reason)
        if self.tools is not None:
            message, finish_reason = self.tools.message(result.text, finish_reason)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(result.logprobs),
            finish_reason=finish_reason,
        )

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )


ResponseBuilder = CompletionChunks | ChatChunks


def spelled(reason: FinishReason | None) -> str | None:
    """A finish reason as OpenAI's JSON spells it (its value)."""
    return None if reason is None else str(reason)


def is_empty(delta: StreamDelta) -> bool:
    """A delta with nothing to send: tokens whose text is not complete yet (a split UTF-8
    character)."""
    return not delta.text and delta.finish_reason is None and not delta.logprobs
