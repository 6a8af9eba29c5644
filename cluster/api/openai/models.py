"""Request bodies of the OpenAI-compatible HTTP API (the subset pagedserve serves).

Fields are typed strictly and unknown fields are refused, so a client learns at once that a
parameter it relies on does nothing here. The extra sampling fields vLLM users know (`top_k`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, ...) and the cluster's own
(`priority`, `cache_salt`, `request_id`) are accepted as top-level fields (the openai client's
`extra_body`).
Ranges are checked by `SamplingParams`, the one place that knows them; where a body's field
reaches it under another name (chat `top_logprobs` is its `logprobs`), `sent_as` maps it back,
so the error names the field the client sent. A chat's messages and the tools it declares are
in `chat_messages`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.guided import guided_spec
from pagedserve.cluster.api.openai.chat_messages import (
    ChatMessage,
    NamedToolChoice,
    ToolDefinition,
)
from pagedserve.cluster.api.openai.chat_messages import StrictBody as _Body
from pagedserve.cluster.api.openai.tools import ToolCalling, checked_tool_calling
from pagedserve.workers.protocol.guided import GuidedKind
from pagedserve.workers.protocol.sampling import SamplingKwargs


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: `text` (unconstrained), `json_object`, or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one of these (the `guided_*` fields' newer spelling)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does with it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM-style extras
    repetition_penalty: float = 1.0
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured outputs and token constraints (docs/api.md, "Structured outputs")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's beam search: `n` is the width (workers/beam/groups.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # true, false or "never" (checked by SamplingParams)
    # cluster extras
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None

    def sampling_kwargs(self) -> SamplingKwargs:
        """Keyword arguments for `SamplingParams` (a field left None takes its default)."""
        kwargs = SamplingKwargs(
            n=self.n,
            stop=self.stop,
            seed=self.seed,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            guided=guided_spec(self.guided_fields()),
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )
        if self.use_beam_search:  # deterministic: an unset temperature means 0, not 1
            kwargs["temperature"] = 0.0
            kwargs["use_beam_search"] = True
        if self.length_penalty != 1.0 or self.early_stopping is not False:
            kwargs["length_penalty"] = self.length_penalty
            kwargs["early_stopping"] = self.early_stopping
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        return kwargs

    def sent_as(self) -> dict[str, str]:
        """`SamplingParams` field → the body field it came from, where the names differ."""
        return {}

    def guided_fields(self) -> dict[str, tuple[GuidedKind, Any, bool]]:
        """Every structured-output field set, by the name the client sent it under."""
        sent: dict[str, tuple[GuidedKind, Any, bool]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            sent["response_format"] = (GuidedKind.JSON_OBJECT, None, True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ApiError.invalid(
                    "response_format.json_schema: field required for type json_schema",
                    "response_format.json_schema",
                )
            schema = fmt.json_schema
            strict = bool(schema.strict)
            sent["response_format.json_schema"] = (GuidedKind.JSON_SCHEMA, schema.schema_, strict)
        extras = {
            "guided_json": (GuidedKind.JSON_SCHEMA, self.guided_json),
            "guided_regex": (GuidedKind.REGEX, self.guided_regex),
            "guided_choice": (GuidedKind.CHOICE, self.guided_choice),
            "guided_grammar": (GuidedKind.GRAMMAR, self.guided_grammar),
        }
        outputs = self.structured_outputs
        if outputs is not None:
            extras |= {
                "structured_outputs.json": (GuidedKind.JSON_SCHEMA, outputs.json_),
                "structured_outputs.regex": (GuidedKind.REGEX, outputs.regex),
                "structured_outputs.choice": (GuidedKind.CHOICE, outputs.choice),
                "structured_outputs.grammar": (GuidedKind.GRAMMAR, outputs.grammar),
                "structured_outputs.json_object": (
                    GuidedKind.JSON_OBJECT,
                    True if outputs.json_object else None,
                ),
            }
        # vLLM's extras keep a schema's own `additionalProperties` (strict off).
        sent |= {
            name: (kind, value, False)
            for name, (kind, value) in extras.items()
            if value is not None
        }
        return sent

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_SamplingFields):
    """`POST /v1/completions`: one prompt (text or token ids) or a batch of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM extra; `echo` + `logprobs` implies it
    best_of: int | None = None

    def sampling_kwargs(self) -> SamplingKwargs:
        """With `echo` and `logprobs`, the prompt's log-probabilities too (loglikelihood);
        with `best_of`, that many branches, each with its tokens' log-probabilities (to rank
        them; shown only if asked for)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        kwargs = super().sampling_kwargs()
        kwargs["logprobs"] = self.logprobs
        kwargs["prompt_logprobs"] = prompt_logprobs
        if self.picks_best:
            kwargs["n"] = self.best_of
            kwargs["logprobs"] = self.logprobs or 0
        return kwargs

    @cached_property
    def picks_best(self) -> bool:
        """Whether `best_of` asks for more branches than it returns (checked: n <= best_of, not
        streamed)."""
        if self.best_of is None or self.best_of == self.n:
            return False
        if self.best_of < self.n:
            message = f"best_of: must be >= n ({self.best_of} < {self.n})"
            raise ApiError.invalid(message, "best_of")
        if self.stream:
            message = "best_of: cannot be streamed (the best are known once all are done)"
            raise ApiError.invalid(message, "best_of")
        return True

    def sent_as(self) -> dict[str, str]:
        """`best_of` is the engine's `n` when it picks."""
        return {"n": "best_of"} if self.picks_best else {}

    def prompts(self) -> list[str | list[int]]:
        """The batch: each item a text or a token-id list."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ApiError.invalid("prompt is empty", "prompt")
        return list(prompt)


class ChatCompletionBody(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def turns(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them; INVALID_ARGUMENT naming the first
        message without content."""
        return [message.turn(i) for i, message in enumerate(self.messages)]

    @cached_property
    def tool_calling(self) -> ToolCalling | None:
        """The request's tools and `tool_choice`, checked (docs/api.md, "Tool calling")."""
        functions = [
            (f"tools[{i}].function", tool.function.model_dump())
            for i, tool in enumerate(self.tools or ())
        ]
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if isinstance(choice, NamedToolChoice):
            choice = "named"
        return checked_tool_calling(
            functions, choice, named, self.parallel_tool_calls, "tool_choice.function.name"
        )

    def guided_fields(self) -> dict[str, tuple[GuidedKind, Any, bool]]:
        """With tools to call, their grammar too (under `tools`)."""
        sent = super().guided_fields()
        spec = self.tool_calling.grammar() if self.tool_calling else None
        if spec is not None:
            sent["tools"] = (spec.kind, spec.value, True)
        return sent

    def sent_as(self) -> dict[str, str]:
        """`top_logprobs` is `SamplingParams.logprobs`; `max_completion_tokens`, when given,
        its `max_tokens`."""
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def sampling_kwargs(self) -> SamplingKwargs:
        """`logprobs: true` with `top_logprobs` alternatives (0 when unset)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError.invalid("top_logprobs: needs logprobs: true", "top_logprobs")
        kwargs = super().sampling_kwargs()
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return kwargs

    def max_output_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], data: Any) -> Body:
    """Validate `data` as `model`; the first problem becomes an INVALID_ARGUMENT naming it."""
    if not isinstance(data, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = _loc_path(first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"{param}: unknown or unsupported field"
        elif first["type"] == "missing":
            message = f"{param}: field required"
        else:
            message = f"{param}: {first['msg']}"
        raise ApiError.invalid(message, param) from None


def _loc_path(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") → "messages[0].content"; union branch names dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        elif "[" in str(part) or str(part) in ("str", "int", "list", "function-after"):
            continue  # pydantic names union members ("list[int]") in the location
        else:
            path += f".{part}"
    return path
