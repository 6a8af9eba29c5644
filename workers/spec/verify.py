"""Verification of draft tokens against the target's logits at every draft position.

The verify forward gives ``k + 1`` rows of logits per request: row ``i`` is the target's next
token distribution after the request's tokens and drafts ``d_1 … d_i``. A verdict is the
tokens the request gains this step: the accepted drafts, then one token of the target's own.

- greedy: accept the longest prefix of drafts equal to the target's argmax, then the argmax
  at the first mismatch (or after the last draft);
- sampling (Leviathan et al. 2023, Chen et al. 2023): accept ``d_i`` with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection draw from
  ``norm(max(0, p_i − q_i))`` and stop; when all are accepted draw the bonus from ``p_k``.
  Every proposer here drafts one token per position (``q_i`` one-hot), so acceptance is
  ``p_i(d_i)`` and the residual is ``p_i`` without ``d_i``. Each emitted token is then
  distributed exactly as the target's sampler would draw it.

Draws come from the request's own generator (one uniform per accept test and one per draw),
so a seeded request repeats exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one request gains from a verify step."""

    token_ids: list[int]  # accepted drafts, then the target's own token
    num_accepted: int  # how many of the drafts were accepted


def verify_greedy(logits: Tensor, drafts: Sequence[int]) -> Verdict:
    """Accept the drafts while they equal the target's argmax.

    Args:
        logits: ``[k + 1, V]`` the target's logits after each draft prefix (processed as the
            sampler would: penalties and stop-token suppression already applied).
        drafts: the ``k`` draft tokens.
    """
    targets = logits.argmax(dim=-1).tolist()  # first maximal index, as `Sampler.sample`
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return Verdict(list(drafts[:accepted]) + [targets[accepted]], accepted)


def verify_sampled(probs: Tensor, drafts: Sequence[int], generator: torch.Generator) -> Verdict:
    """Rejection sampling against one-hot draft distributions.

    Args:
        probs: ``[k + 1, V]`` float64 target distributions (see `sampler.sampling_probs`).
        drafts: the ``k`` draft tokens.
        generator: the request's generator (or the sampler's, for an unseeded request).
    """
    probs = probs.to("cpu", torch.float64)
    for i, draft in enumerate(drafts):
        if _uniform(generator) < probs[i, draft].item():
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        return Verdict(list(drafts[:i]) + [_draw(residual, generator)], i)
    return Verdict(list(drafts) + [_draw(probs[len(drafts)], generator)], len(drafts))


def _uniform(generator: torch.Generator) -> float:
    return torch.rand((), generator=generator, device=generator.device, dtype=torch.float64).item()


def _draw(weights: Tensor, generator: torch.Generator) -> int:
    """An inverse-CDF draw from unnormalised ``weights``; zero-weight ids are never drawn."""
    cdf = weights.cumsum(dim=0)
    target = _uniform(generator) * cdf[-1].item()
    chosen = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    last_positive = int(torch.nonzero(weights > 0).max())
    return min(chosen, last_positive)
