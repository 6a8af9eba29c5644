"""Beam search's scoring, step by step, as HF transformers' `generate(num_beams=...)` does it.

`BeamScorer` owns one beam-search request's finished hypotheses and its early-stop state; it
knows nothing of blocks. Each step it gets the live beams' cumulative log-probabilities and
their next-token log-probabilities (log-softmax of the raw logits, in float32) and says which
continuations live on. `workers/beam/groups.py` turns that into forks and frees of KV blocks.

One step, with `W` the width and `E` the number of stop ids (transformers 5.x `_beam_search`)::

    acc[b, t] = cumulative[b] + logprob[b, t]          over every live beam b and token t
    top K = max(2, 1 + E) * W candidates of acc        (K so that W of them never stop)
    a candidate stops when its token is a stop id, or when the output reaches max_tokens
    among the top W candidates, those that stop become finished hypotheses, scored
        acc / generated_len ** length_penalty          (generated_len counts the stop token)
    the best W candidates that do not stop are the next live beams
    the W best finished hypotheses are kept

and it ends when every candidate stopped (max_tokens), when `early_stopping` is True and W
hypotheses are finished, or when no live beam can still beat the worst of W finished ones:
its best cumulative log-probability over the current length (`early_stopping` False), or over
`max_tokens` when `early_stopping` is "never" and `length_penalty` > 0.

The first step sees one live beam (the prompt); HF's `-1e9` start scores for the other beams
make its first top-K come from that beam alone, which is what one row gives.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedserve.workers.beam.checks import EarlyStopping
from pagedserve.workers.protocol.stream import FinishReason


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token included), the sum of their
    log-probabilities, and its score (that sum / len ** length_penalty, HF's
    `sequences_scores`)."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True)
class Continuation:
    """One next live beam: live beam `parent` extended by `token`."""

    parent: int
    token: int
    cumulative_logprob: float


@dataclass(frozen=True, slots=True)
class BeamStep:
    """What one step decided: the next live beams, best first (none once `done`)."""

    continuations: tuple[Continuation, ...]
    done: bool


def length_normalized(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """HF's hypothesis score: the sum over the generated length to the `length_penalty`."""
    return cumulative_logprob / (length**length_penalty)


class BeamScorer:
    """One beam-search request's scoring state: its finished hypotheses (at most `width`,
    best first) and whether a live beam may still beat them.

    Args:
        width: beams kept per step (`SamplingParams.n`).
        max_tokens: the longest output (a candidate reaching it stops).
        stop_ids: tokens that finish a beam (EOS and `stop_token_ids`; none with `ignore_eos`
            and no `stop_token_ids`).
        prompt_len: tokens of the prompt (the beams' own tokens follow it).
        length_penalty: the exponent of the length in a finished hypothesis's score.
        early_stopping: True, False or "never", as HF defines them (see the module docstring).
    """

    def __init__(
        self,
        width: int,
        max_tokens: int,
        stop_ids: Collection[int],
        prompt_len: int,
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
    ) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.prompt_len = prompt_len
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * width
        self.finished: list[Hypothesis] = []
        self.improvable = True  # HF's `is_early_stop_heuristic_unsatisfied`

    @property
    def full(self) -> bool:
        return len(self.finished) == self.width

    def step(
        self,
        beams: Sequence[Sequence[int]],
        cumulative: Sequence[float],
        logprobs: torch.Tensor,
    ) -> BeamStep:
        """Score the next tokens of every live beam; keep the best.

        Args:
            beams: each live beam's tokens (prompt and output so far), all of equal length.
            cumulative: each live beam's summed log-probability so far.
            logprobs: `[len(beams), V]` float32 log-probabilities of each beam's next token.

        Returns:
            The next live beams (best first), and whether the search is over.
        """
        vocab = logprobs.shape[-1]
        start = torch.tensor(list(cumulative), dtype=torch.float32, device=logprobs.device)
        accumulated = (logprobs + start[:, None]).reshape(-1)
        values, indices = torch.topk(accumulated, k=min(self.num_candidates, accumulated.numel()))
        generated = len(beams[0]) - self.prompt_len + 1
        at_max = generated >= self.max_tokens
        candidates = [
            Continuation(index // vocab, index % vocab, value)
            for index, value in zip(indices.tolist(), values.tolist(), strict=True)
        ]
        stops = [at_max or c.token in self.stop_ids for c in candidates]
        self._add_finished(beams, candidates[: self.width], stops, generated)
        live = tuple(c for c, stop in zip(candidates, stops, strict=True) if not stop)
        live = live[: self.width]
        if live:
            self._update_improvable(live[0].cumulative_logprob, generated)
        done = all(stops) or not self.improvable or (self.full and self.early_stopping is True)
        return BeamStep(() if done else live, done)

    def _add_finished(
        self,
        beams: Sequence[Sequence[int]],
        top: Sequence[Continuation],
        stops: Sequence[bool],
        generated: int,
    ) -> None:
        """The top-`width` candidates that stopped join the finished hypotheses (unless no
        more may join: all `width` are in under `early_stopping` True, or none can improve)."""
        if not self.improvable or (self.full and self.early_stopping is True):
            return
        added = False
        for candidate, stop in zip(top, stops, strict=False):
            if not stop:
                continue
            output = tuple(beams[candidate.parent][self.prompt_len :]) + (candidate.token,)
            reason = FinishReason.STOP if candidate.token in self.stop_ids else FinishReason.LENGTH
            score = length_normalized(candidate.cumulative_logprob, generated, self.length_penalty)
            self.finished.append(Hypothesis(output, candidate.cumulative_logprob, score, reason))
            added = True
        if added:
            # Stable: a new hypothesis ties below an older one, as HF's merge puts old first.
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width :]

    def _update_improvable(self, best_live_logprob: float, generated: int) -> None:
        if not self.full:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = generated
        best_possible = length_normalized(best_live_logprob, best_length, self.length_penalty)
        self.improvable = self.improvable and best_possible > self.finished[-1].score

    def best(self, live: Sequence[tuple[Sequence[int], float, FinishReason]]) -> list[Hypothesis]:
        """The `width` best hypotheses, best first: the finished ones, and (for a search that
        ended early, aborted or timed out) its live beams as they stand.

        Args:
            live: each live beam's tokens (prompt and output), cumulative log-probability and
                the reason it ended; empty once the search is done.
        """
        hypotheses = list(self.finished)
        for tokens, cumulative, reason in live:
            output = tuple(tokens[self.prompt_len :])
            if not output:
                continue
            score = length_normalized(cumulative, len(output), self.length_penalty)
            hypotheses.append(Hypothesis(output, cumulative, score, reason))
        hypotheses.sort(key=lambda h: -h.score)
        return hypotheses[: self.width]
