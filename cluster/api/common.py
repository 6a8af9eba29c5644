"""What both front ends do the same way: build sampling params, check text, collect completions.

A request's stream is added up by the one accumulator, `CompletionCollector`
(`workers/engine/outputs.py`, shared with the offline `LLM`): whole completions when a response
needs them, and the request's usage; `Usage.total` adds up several prompts'.

Validation is the router's and the worker's (`SamplingParams`, `RouterCore`, `Engine` raise with
messages that name the field); this module only turns their errors into `ApiError`s and checks
what they cannot see on the wire (malformed UTF-8).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pagedserve.cluster.api.errors import ApiError, field_of
from pagedserve.cluster.api.openai.tools import ToolCalling, tool_chat_turns
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.engine.outputs import CompletionCollector
from pagedserve.workers.model.tokenizer import render_chat
from pagedserve.workers.protocol.errors import RequestRejected
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingKwargs, SamplingParams
from pagedserve.workers.protocol.stream import StreamDelta

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.12


def sampling_params(
    sent_as: Mapping[str, str] | None = None, **kwargs: Unpack[SamplingKwargs]
) -> SamplingParams:
    """`SamplingParams(**kwargs)`, with its ValueError (which names the field) as an ApiError.

    Args:
        sent_as: `SamplingParams` field → the request field it came from, where they differ
            (chat `top_logprobs` is `logprobs`): the error names the field the client sent.
    """
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        field = field_of(message)
        if field is not None and sent_as and field in sent_as:
            message = sent_as[field] + message[len(field) :]
        raise ApiError.invalid(message) from None


def chat_prompt(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    add_generation_prompt: bool = True,
    tools: ToolCalling | None = None,
) -> str:
    """The prompt text of a chat by the model's chat template; INVALID_ARGUMENT (param
    `messages`) when the model has none or a message is malformed.

    A template that takes tools renders `tools` and the turns' calls and results itself; for
    any other they are written into the turns (`api.openai.tools.tool_chat_turns`).
    """
    try:
        if getattr(tokenizer, "template_takes_tools", False):
            listed = tools.tools() if tools is not None else None
            return render_chat(tokenizer, messages, add_generation_prompt, tools=listed)
        return render_chat(tokenizer, tool_chat_turns(messages, tools), add_generation_prompt)
    except RequestRejected as error:
        raise ApiError.invalid(str(error), "messages") from None


def new_request_id(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def find_malformed_text(value: Any, path: str) -> str | None:
    """The path of the first string (value or object key) under `value` that is not valid
    Unicode, else None.

    JSON can carry lone surrogates (`"\\ud800"`), and a body decoded with `surrogateescape`
    turns invalid UTF-8 bytes into them too; neither can be encoded again, so neither can be
    tokenized.
    """
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if isinstance(value, Mapping):
        for key in value:
            if isinstance(key, str) and not _is_unicode(key):
                # The path must be printable in the error: show the bad bytes escaped.
                shown = key.encode("utf-8", "backslashreplace").decode("ascii")
                return f"{path}.{shown}" if path else shown
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for item_path, item in items:
        found = find_malformed_text(item, item_path)
        if found is not None:
            return found
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def collect(core: RouterCore, request: GenerateRequest) -> CompletionCollector:
    """Run a request to the end and collect its completions."""
    collector = CompletionCollector(request_id=request.request_id or "")
    async with aclosing(core.generate(request)) as deltas:
        async for delta in deltas:
            collector.add(delta)
    return collector


async def merge_streams(
    streams: Sequence[AsyncGenerator[StreamDelta, None]],
) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Interleave several streams as their deltas arrive, as (stream index, delta).

    The first failure ends the merge with that error; leaving early (or failing) cancels every
    stream, which aborts its request on the worker.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[StreamDelta, None]) -> None:
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    await queue.put((i, delta))
        except Exception as error:  # handed to the consumer, which re-raises it
            await queue.put((i, error))
        else:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
