"""One step's token constraints, applied to the logits before temperature, top-k and top-p.

In this order, per row: `logit_bias` added; everything outside `allowed_token_ids` and every
banned word's next token set to -inf; then the grammar's bitmask, filled for every constrained
row of the batch in one call and applied in one call. A forbidden token's logit is -inf, so no
sampling parameter can bring it back; the sampler's stop-token suppression (`min_tokens`) and
penalties come after.

The speculative path (`constrain_drafts`) masks a sequence's verify rows the same way, walking
its matcher through the drafts and rolling it back after: row i is masked as the matcher stands
after drafts 1..i, and drafts from the first one the grammar forbids on are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pagedserve.workers.structured.backend import GrammarBackend

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request
    from pagedserve.workers.protocol.sampling import SamplingParams


def bad_word_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each banned word as the tokenizer spells it, alone and after a space (as vLLM bans)."""
    if tokenizer is None or not words:
        return []
    spelled: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = [t for t in tokenizer.encode(text) if t != getattr(tokenizer, "bos_token_id", -1)]
            if ids and ids not in spelled:
                spelled.append(ids)
    return spelled


def banned_next_tokens(bad_words_ids: Sequence[Sequence[int]], history: Sequence[int]) -> set[int]:
    """The tokens that would complete a banned word after `history` (the output so far)."""
    banned = set()
    for word in bad_words_ids:
        prefix = list(word[:-1])
        if not prefix or list(history[len(history) - len(prefix) :]) == prefix:
            banned.add(word[-1])
    return banned


@torch.inference_mode()  # the runner's logits are inference tensors: in place only in here
def apply_row_constraints(
    logits: Tensor,
    row: int,
    params: SamplingParams,
    bad_words_ids: Sequence[Sequence[int]],
    output_tail: Sequence[int],
) -> None:
    """`logit_bias`, `allowed_token_ids` and `bad_words` on row `row`, in place."""
    vocab_size = logits.shape[-1]
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab_size]
        bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype)
        logits[row, ids] += bias.to(logits.device)
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
        keep[[t for t in params.allowed_token_ids if t < vocab_size]] = True
        logits[row].masked_fill_(~keep, float("-inf"))
    if bad_words_ids:
        banned = [t for t in banned_next_tokens(bad_words_ids, output_tail) if t < vocab_size]
        if banned:
            logits[row, banned] = float("-inf")


def output_tail(request: Request, num_tokens: int = 64) -> list[int]:
    """The last output tokens (enough for any banned word), without copying the whole output."""
    start = max(request.prompt_len, len(request.all_token_ids) - num_tokens)
    return request.all_token_ids[start:]


@torch.inference_mode()
def apply_token_constraints(
    logits: Tensor, rows: Sequence[Request], backend: GrammarBackend | None
) -> None:
    """Every constraint of every row of one step's `logits` (row i is `rows[i]`'s), in place."""
    for i, request in enumerate(rows):
        params = request.params
        if params.logit_bias or params.allowed_token_ids is not None or request.bad_words_ids:
            apply_row_constraints(logits, i, params, request.bad_words_ids, output_tail(request))
    guided = [i for i, request in enumerate(rows) if request.matcher is not None]
    if not guided:
        return
    bitmask = backend.allocate_bitmask(len(rows))
    backend.fill_bitmasks([rows[i].matcher for i in guided], bitmask, guided)
    backend.apply_bitmask(logits, bitmask, guided)


@torch.inference_mode()
def constrain_drafts(
    logits: Tensor, request: Request, drafts: Sequence[int], backend: GrammarBackend | None
) -> list[int]:
    """Mask a sequence's `k + 1` verify rows; the drafts its grammar allows, in order.

    Row i is the target's distribution after drafts 1..i: it gets the constraints as they stand
    there. A draft the grammar forbids ends the run (its row and those after it are not
    verified); the matcher is rolled back to where it stood, since the engine advances it only
    on the tokens it finally appends.
    """
    drafts = list(drafts)
    tail = output_tail(request)
    for i in range(len(drafts) + 1):
        if (
            request.params.logit_bias
            or request.params.allowed_token_ids is not None
            or (request.bad_words_ids)
        ):
            history = tail + drafts[:i]
            apply_row_constraints(logits, i, request.params, request.bad_words_ids, history)
    matcher = request.matcher
    if matcher is None:
        return drafts
    bitmask = backend.allocate_bitmask(len(drafts) + 1)
    num_advanced = 0
    num_valid = len(drafts)
    for i, draft in enumerate(drafts):
        matcher.fill_bitmask(bitmask, i)
        if not matcher.accept_token(draft):
            num_valid = i
            break
        num_advanced += 1
        if matcher.is_terminated():  # the draft ended the grammar: nothing can follow it
            num_valid = i + 1
            break
    if num_valid == len(drafts) and not matcher.is_terminated():
        matcher.fill_bitmask(bitmask, num_valid)
    matcher.rollback(num_advanced)
    rows = list(range(min(num_valid + 1, num_advanced + 1)))
    backend.apply_bitmask(logits, bitmask, rows)
    return drafts[:num_valid]
