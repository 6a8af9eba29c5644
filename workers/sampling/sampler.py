"""Turns a batch of next-token logits into one token per row.

A row's token depends only on its own logits, its own parameters and its own generator, never on
the other rows of the batch: that is what makes a seeded request give the same text alone and
among 32 others, and branch ``j`` of an ``n``-way request equal the request run alone with
``seed + j``. Three choices keep it so:

* every sampled row takes the same path (sort, truncate, inverse CDF) whatever its neighbours
  need, so no row's result depends on which fast path the batch happened to take;
* every sampled row draws exactly one uniform number per step from its generator, so a seeded
  generator advances identically however the batch is composed;
* the batched tensor ops used (softmax, sort, cumsum along the vocab) reduce within a row only.

Before any of it, ``apply_penalties`` (presence, frequency, repetition, as vLLM defines them)
changes the logits of the rows that ask for penalties, greedy rows included.

Sampled row, per step::

    logits / temperature ──sort desc (stable)──► top-k: keep the first k
        ──softmax──► top-p: keep the shortest prefix with mass >= top_p
        ──► u ~ U[0, 1) from the row's generator ──► first kept token whose CDF > u · mass
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pagedserve.workers.protocol.sampling import SEED_LIMIT, SamplingParams
from pagedserve.workers.sampling.logprobs import raw_logits, record_sample_logprobs
from pagedserve.workers.structured.masking import apply_token_constraints

if TYPE_CHECKING:
    from pagedserve.workers.engine.request import Request


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator seeded for one request (or one branch of it).

    Args:
        seed: the request's seed; ``None`` for an unseeded request.
        device: where the generator draws. CPU (the default) draws identically on every machine.

    Returns:
        The seeded generator, or ``None`` for an unseeded request, whose rows then draw from
        the sampler's own generator.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    # `SamplingParams` holds seeds in [0, 2**64) (torch's range); the modulo keeps a caller
    # that builds its own seeds (seed + branch index) in range the same way.
    generator.manual_seed(seed % SEED_LIMIT)
    return generator


@torch.inference_mode()  # the runner's logits are inference tensors: in place only in here
def suppress_stop_tokens(
    logits: Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Collection[int],
) -> None:
    """Mask EOS and ``stop_token_ids`` in place for rows that have not reached ``min_tokens``.

    Optional: ``check_stop`` already ignores those tokens before ``min_tokens``; masking them
    keeps them out of the output too (as vLLM does). Call it before ``Sampler.sample``.

    Args:
        logits: ``[S, V]`` logits, modified in place.
        params: one ``SamplingParams`` per row.
        num_output_tokens: tokens each row has generated so far.
        eos_token_ids: the model's EOS ids (ignored for rows with ``ignore_eos``).
    """
    vocab_size = logits.shape[-1]
    for row, (p, num_out) in enumerate(zip(params, num_output_tokens, strict=True)):
        if num_out >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        ids = [t for t in banned if t < vocab_size]
        if ids:
            kept = logits[row, ids].clone()
            logits[row, ids] = float("-inf")
            if p.has_token_constraints and not torch.isfinite(logits[row]).any():
                # A grammar (or allowed_token_ids) that allows only a stop here: the stop
                # stays, since a row with nothing left to sample has no token at all.
                logits[row, ids] = kept


@torch.inference_mode()  # the runner's logits are inference tensors: in place only in here
def apply_penalties(
    logits: Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
) -> None:
    """Presence, frequency and repetition penalties, in place, as vLLM applies them.

    For a row with penalties, with ``count[t]`` the occurrences of token ``t`` in its output::

        if t in prompt or output:  logit[t] = logit[t] / rep if logit[t] > 0 else logit[t] * rep
        logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

    Rows without penalties are left untouched (and cost nothing). Call it after
    ``suppress_stop_tokens`` and before ``Sampler.sample``.

    Args:
        logits: ``[S, V]`` float logits, modified in place.
        params: one ``SamplingParams`` per row.
        token_ids: each row's prompt followed by its output so far.
        prompt_lens: how many of ``token_ids`` are the prompt, per row.
    """
    vocab_size = logits.shape[-1]
    for row, p in enumerate(params):
        if not p.has_penalties:
            continue
        ids = torch.tensor(token_ids[row], dtype=torch.int64, device=logits.device)
        ids = ids[ids < vocab_size]  # out-of-vocab ids (never sampled) cannot be penalised
        prompt_len = min(prompt_lens[row], ids.numel())
        counts = torch.bincount(ids[prompt_len:], minlength=vocab_size).to(logits.dtype)
        in_output = counts > 0
        if p.repetition_penalty != 1:
            seen = in_output.clone()
            seen[ids[:prompt_len]] = True
            penalised = torch.where(
                logits[row] > 0,
                logits[row] / p.repetition_penalty,
                logits[row] * p.repetition_penalty,
            )
            logits[row] = torch.where(seen, penalised, logits[row])
        logits[row] -= p.frequency_penalty * counts + p.presence_penalty * in_output


class Sampler:
    """Picks the next token of every row of a batch.

    Owns one generator, used by the rows of unseeded requests (their samples are random anyway,
    so sharing it costs nothing). Seeded rows bring their own from ``make_generator``.
    """

    def __init__(self, seed: int = 0) -> None:
        """Create a sampler.

        Args:
            seed: seeds the generator of unseeded rows, so a whole run is repeatable.
        """
        self._generator = make_generator(seed)

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Tensor:
        """One next token per row.

        Args:
            logits: ``[S, V]`` float logits of the last position of each row.
            params: the row's parameters (a branch's own, from ``for_branch``).
            generators: the row's generator, or ``None`` to use the sampler's.

        Returns:
            ``[S]`` int64 token ids on ``logits.device``.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [S, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"need one params and one generator per row: {num_rows} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        logits = logits.float()
        tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy:
            # argmax returns the first maximal index: ties go to the lowest id, deterministically.
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        if sampled:
            rows = [params[i] for i in sampled]
            uniforms = self._draw_uniforms([generators[i] for i in sampled], logits.device)
            tokens[sampled] = _sample_rows(logits[sampled], rows, uniforms)
        return tokens

    def generator_of(self, generator: torch.Generator | None) -> torch.Generator:
        """The generator a row draws from: its own, or the sampler's for an unseeded row."""
        return self._generator if generator is None else generator

    def _draw_uniforms(
        self, generators: Sequence[torch.Generator | None], device: torch.device
    ) -> Tensor:
        """Exactly one U[0, 1) draw per row, from the row's generator (or the sampler's)."""
        draws = []
        for generator in generators:
            g = self._generator if generator is None else generator
            draws.append(torch.rand((), generator=g, device=g.device, dtype=torch.float64))
        if all(d.device == draws[0].device for d in draws):
            return torch.stack(draws).to(device)  # one copy for the batch, not one per row
        return torch.stack([d.to(device) for d in draws])


def _sample_rows(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> Tensor:
    """Temperature, top-k, top-p, then an inverse-CDF draw, for rows that sample.

    Args:
        logits: ``[R, V]`` float32 logits.
        params: the rows' parameters (none greedy).
        uniforms: ``[R]`` float64 draws in ``[0, 1)``.

    Returns:
        ``[R]`` int64 token ids.
    """
    probs, sorted_ids, num_kept = _sorted_filtered_probs(logits, params)
    chosen = _inverse_cdf(probs, num_kept, uniforms)
    return sorted_ids.gather(1, chosen.unsqueeze(1)).squeeze(1)


def sampling_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``[R, V]`` float64: the distribution ``Sampler.sample`` draws each sampled row from
    (temperature, top-k, top-p applied, renormalised), over the vocabulary in id order.

    Speculative verification compares drafts against exactly this distribution.
    """
    probs, sorted_ids, num_kept = _sorted_filtered_probs(logits, params)
    positions = torch.arange(probs.shape[1], device=probs.device)
    kept = torch.where(positions < num_kept.unsqueeze(1), probs, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(1, sorted_ids, kept)


def _sorted_filtered_probs(
    logits: Tensor, params: Sequence[SamplingParams]
) -> tuple[Tensor, Tensor, Tensor]:
    """Temperature, top-k and top-p over each row sorted by logit: the part sampling and
    speculative verification share.

    Returns:
        ``[R, V]`` float64 probabilities in sorted order (top-k's cut rows zero), ``[R, V]``
        the token id at each sorted place, and ``[R]`` how many sorted tokens top-k and top-p
        keep.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits.float() / temperature.unsqueeze(1)
    # Stable, so equal logits keep id order and a given draw always picks the same token.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    num_top_k = _top_k_sizes(params, logits.shape[1], device)
    positions = torch.arange(logits.shape[1], device=device)
    sorted_logits = sorted_logits.masked_fill(positions >= num_top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1).double()
    return probs, sorted_ids, torch.minimum(num_top_k, _top_p_sizes(probs, params))


def _top_k_sizes(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> Tensor:
    """``[R]`` how many of the sorted tokens top-k keeps (all of them when it is off)."""
    sizes = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def _top_p_sizes(probs: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """``[R]`` length of the shortest prefix of the sorted ``probs`` whose mass is >= top_p.

    A token is kept when the mass strictly before it is still below top_p, so the first token is
    always kept. Rows with top_p = 1 keep everything: rounding in the running sum must not cut
    off a tail of tiny but legal tokens.
    """
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=probs.device)
    mass_before = probs.cumsum(dim=-1) - probs
    sizes = (mass_before < top_p.unsqueeze(1)).sum(dim=-1)
    return torch.where(top_p >= 1.0, probs.shape[1], sizes)


def _inverse_cdf(probs: Tensor, num_kept: Tensor, uniforms: Tensor) -> Tensor:
    """``[R]`` sorted positions drawn from ``probs`` renormalised over their first ``num_kept``.

    Position ``i`` is chosen when ``cdf[i-1] <= u * mass < cdf[i]``, so zero-probability
    positions are never chosen; the clamp guards the last kept one against rounding.
    """
    positions = torch.arange(probs.shape[1], device=probs.device)
    kept = torch.where(positions < num_kept.unsqueeze(1), probs, 0.0)
    cdf = kept.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    num_positive = (kept > 0).sum(dim=-1).clamp(min=1)
    return torch.minimum(chosen, num_positive - 1)


def sample_rows(
    sampler: Sampler,
    logits: Tensor,
    rows: Sequence[Request],
    eos_token_ids: Collection[int],
    tokenizer: Any,
    grammar_backend: Any = None,
) -> list[int]:
    """One token per sequence of a step (row `i` of `logits` is `rows[i]`'s): token constraints
    applied (`logit_bias`, `allowed_token_ids`, `bad_words`, the grammar's bitmask for the whole
    batch: `structured/masking.py`), stop tokens suppressed below `min_tokens`, penalties
    applied, sampled; the log-probabilities a row asks for are recorded on it, of the model's
    own logits. `grammar_backend` builds the bitmask (needed when a row has a matcher)."""
    params = [r.params for r in rows]
    raw = raw_logits(logits, params)
    apply_token_constraints(logits, rows, grammar_backend)
    suppress_stop_tokens(logits, params, [r.num_output_tokens for r in rows], eos_token_ids)
    apply_penalties(logits, params, [r.all_token_ids for r in rows], [r.prompt_len for r in rows])
    tokens = sampler.sample(logits, params, [r.generator for r in rows]).tolist()
    record_sample_logprobs(rows, raw, tokens, tokenizer)
    return tokens
