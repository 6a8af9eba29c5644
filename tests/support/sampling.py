"""Reference implementations the sampling tests compare against."""

from __future__ import annotations

from pagedserve.workers.protocol.sampling import SamplingParams


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """vLLM's definition, token by token, in plain Python (float64)."""
    result = []
    for token, logit in enumerate(logits):
        count = output.count(token)
        if token in prompt or count:
            rep = params.repetition_penalty
            logit = logit / rep if logit > 0 else logit * rep
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        result.append(logit)
    return result
