"""When a sequence is finished, and why."""

from __future__ import annotations

from collections.abc import Collection

from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import FinishReason


def check_stop(
    params: SamplingParams,
    num_output_tokens: int,
    last_token: int | None,
    eos_token_ids: Collection[int],
    stop_string_hit: bool,
    max_model_len_hit: bool = False,
) -> FinishReason | None:
    """Whether a sequence is finished after its latest token.

    A stop wins over a length limit reached by the same token, as in vLLM and OpenAI: the
    sequence ended because it chose to.

    Args:
        params: the sequence's (branch's) parameters.
        num_output_tokens: how many tokens the sequence generated so far.
        last_token: the newest of them (None before the first). Only these two are read, so
            a step never copies the whole output to check it.
        eos_token_ids: the model's end-of-sequence ids.
        stop_string_hit: the detokenizer matched a stop string (never held back by
            ``min_tokens``: its text is already cut).
        max_model_len_hit: prompt plus output fill the model's context.

    Returns:
        ``FinishReason.STOP`` or ``FinishReason.LENGTH``, or ``None`` to go on.
    """
    num_tokens = num_output_tokens
    if stop_string_hit:
        return FinishReason.STOP
    if last_token is not None and num_tokens > 0 and num_tokens >= params.min_tokens:
        if not params.ignore_eos and last_token in eos_token_ids:
            return FinishReason.STOP
        if last_token in params.stop_token_ids:
            return FinishReason.STOP
    if num_tokens >= params.max_tokens or max_model_len_hit:
        return FinishReason.LENGTH
    return None
