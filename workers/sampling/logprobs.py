"""Log-probabilities of sampled tokens and of prompt tokens, as vLLM reports them.

Both are "raw": the ``log_softmax`` of the model's own logits, taken before anything the
request's sampling does to them (EOS suppression, penalties, temperature, top-k/top-p), so
that they are what an evaluation harness scores with. Each token gets a ``TokenLogprob``: its
own log-probability and rank, and the ``k`` most likely tokens of that position, each with its
text (decoded alone, special tokens by name: what an API shows beside the number).

Prompt log-probabilities need the logits of every prompt position, not only the last one. The
batch asks the runner for those rows too (``prompt_logprob_positions``), only for requests that
want them, and such requests never reuse cached prefix blocks: a cached position is never
computed, so it would have no logits. Positions are collected in order, so a request preempted
and recomputed does not collect them twice. The first prompt token has nothing before it and
no log-probability (``None``), as in vLLM.

Layout of one step's logits rows::

    [ sampled rows (one per sequence that samples) | prompt rows of request a | of b | ... ]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedserve.workers.protocol.stream import TokenLogprob, TopLogprob

# torch is imported where a tensor is made: routers and the control actors read `TokenLogprob`
# (`workers/protocol/stream.py`) and must not pay torch's import (seconds of CPU per process).
if TYPE_CHECKING:
    from torch import Tensor


def token_logprobs(
    logprobs: Tensor, token_ids: Sequence[int], k: int, tokenizer: Any = None
) -> list[TokenLogprob]:
    """``TokenLogprob`` of each row's ``token_ids[row]`` with its ``k`` best alternatives.

    Args:
        logprobs: ``[R, V]`` log-probabilities (float32 or wider).
        token_ids: the token of each row.
        k: alternatives per row, 0..20.
        tokenizer: gives each token its text (``token_text``); none: empty texts.
    """
    import torch

    text = getattr(tokenizer, "token_text", None) or (lambda _: "")
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
    # Rank = 1 + how many tokens are strictly more likely: what vLLM reports.
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_values, top_ids = _top_k(logprobs, k)
    rows = zip(ids.tolist(), chosen.tolist(), ranks.tolist(), top_ids, top_values, strict=True)
    return [
        TokenLogprob(
            token,
            value,
            rank,
            text(token),
            tuple(TopLogprob(t, v, text(t)) for t, v in zip(tids, tvalues, strict=True)),
        )
        for token, value, rank, tids, tvalues in rows
    ]


def _top_k(logprobs: Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    if k == 0:
        return [[] for _ in range(logprobs.shape[0])], [[] for _ in range(logprobs.shape[0])]
    # A stable descending sort gives ties to the lower id, so the answer never depends on the
    # kernel that ran it; only the first k columns are kept.
    values, ids = logprobs.sort(dim=-1, descending=True, stable=True)
    return values[:, :k].tolist(), ids[:, :k].tolist()


def sample_logprobs(
    logits: Tensor, wanted: Sequence[int | None], tokens: Sequence[int], tokenizer: Any = None
) -> list[TokenLogprob | None]:
    """The log-probabilities of this step's sampled tokens, for the rows that want them.

    Args:
        logits: ``[S, V]`` raw logits of the sampled rows (before any sampling step).
        wanted: per row, ``SamplingParams.logprobs`` (``None``: the row wants none).
        tokens: the token each row sampled.
    """
    rows = [i for i, k in enumerate(wanted) if k is not None]
    result: list[TokenLogprob | None] = [None] * len(wanted)
    for k in sorted({wanted[i] for i in rows}):
        same_k = [i for i in rows if wanted[i] == k]
        logprobs = logits[same_k].float().log_softmax(dim=-1)
        found = token_logprobs(logprobs, [tokens[i] for i in same_k], k, tokenizer)
        for i, item in zip(same_k, found, strict=True):
            result[i] = item
    return result


def prompt_logprob_positions(
    num_computed: int, num_new: int, prompt_len: int, num_collected: int
) -> range:
    """Positions of this chunk whose logits score a later prompt token and are not collected.

    Position ``p`` predicts token ``p + 1``; positions ``0 .. prompt_len - 2`` score the prompt
    (the last prompt position predicts the first output token: that is the sampled row).
    ``num_collected`` counts the scores already collected (prompt token 1 onwards).

    Raises:
        RuntimeError: positions before this chunk were never scored (a prefix-cache hit or
            imported KV on a request that scores its prompt: never allowed).
    """
    stop = min(num_computed + num_new, prompt_len - 1)
    if num_computed >= stop:
        return range(stop, stop)  # this chunk scores no prompt token
    if num_computed > num_collected:
        raise RuntimeError(
            f"prompt positions {num_collected}..{num_computed - 1} were never computed here"
        )
    return range(max(num_computed, num_collected), stop)


def prompt_token_logprobs(
    logits: Tensor, prompt_ids: Sequence[int], positions: range, k: int, tokenizer: Any = None
) -> list[TokenLogprob]:
    """Scores of prompt tokens ``positions.start + 1 ..`` from the logits of ``positions``."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = [prompt_ids[p + 1] for p in positions]
    return token_logprobs(logprobs, targets, k, tokenizer)


# ----------------------------------------------------------------- engine step
# The engine's sequences (`Request`) are duck-typed here: `params`, `all_token_ids`,
# `prompt_len`, `num_output_tokens`, `output_logprobs`, `prompt_logprobs`.


def take_prompt_logprobs(batch: Any, logits: Tensor, tokenizer: Any = None) -> Tensor:
    """Score the prompt positions of ``batch.prompt_rows``; return the sampled rows' logits."""
    if not batch.prompt_rows:
        return logits
    offset = len(batch.sampled)
    for request, positions in batch.prompt_rows:
        rows = logits[offset : offset + len(positions)]
        k = request.params.prompt_logprobs
        request.prompt_logprobs.extend(
            prompt_token_logprobs(rows, request.all_token_ids, positions, k, tokenizer)
        )
        offset += len(positions)
    return logits[: len(batch.sampled)]


def raw_logits(logits: Tensor, params: Sequence[Any]) -> Tensor | None:
    """A copy of the logits before sampling changes them, when a row wants log-probabilities."""
    return logits.clone() if any(p.logprobs is not None for p in params) else None


def record_sample_logprobs(
    rows: Sequence[Any], raw: Tensor | None, tokens: Sequence[int], tokenizer: Any = None
) -> None:
    """Append each sampled token's ``TokenLogprob`` to the rows that want them."""
    if raw is None:
        return
    wanted = [row.params.logprobs for row in rows]
    found = sample_logprobs(raw, wanted, tokens, tokenizer)
    for row, item in zip(rows, found, strict=True):
        if item is not None:
            row.output_logprobs.append(item)


def branch_logprobs(branch: Any, start: int, stop: int) -> list[TokenLogprob | None] | None:
    """The log-probabilities of the branch's output tokens ``start .. stop - 1`` (``None`` for
    a token sampled on another worker before a move), or ``None`` when not asked for."""
    if branch.params.logprobs is None:
        return None
    # `output_logprobs` holds the last tokens sampled here, one each.
    offset = branch.num_output_tokens - len(branch.output_logprobs)
    return [branch.output_logprobs[i - offset] if i >= offset else None for i in range(start, stop)]


def prompt_logprobs_of(first: Any) -> list[TokenLogprob | None] | None:
    """One entry per prompt token, the first ``None``; ``None`` when not asked for."""
    if first.params.prompt_logprobs is None:
        return None
    return [None, *first.prompt_logprobs]
