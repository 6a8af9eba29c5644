"""Verification of drafts: greedy acceptance, and rejection sampling that keeps the target's
distribution exactly (chi-square over many seeded draws: deterministic, cannot flake)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.sampling.sampler import Sampler, sampling_probs
from pagedserve.workers.spec.verify import verify_greedy, verify_sampled

VOCAB = 6
# The target's next-token distributions at three positions (rows do not depend on the
# prefix here, so each row is also the distribution given any accepted prefix).
TARGET = torch.tensor(
    [
        [0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
        [0.30, 0.05, 0.05, 0.20, 0.00, 0.40],
        [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
    ],
    dtype=torch.float64,
)
DRAWS = 30_000
# Chi-square critical value for 5 degrees of freedom at p = 0.001 (and 4 where a token has
# probability 0 and is left out).
CRITICAL = {5: 20.515, 4: 18.467}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom over the tokens with p > 0."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[support] * counts.sum()
    observed = counts[support].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("drafts", [[1, 5], [4, 4], [0, 3]])
def test_rejection_sampling_keeps_the_target_distribution(drafts):
    """The first emitted token follows TARGET[0] and, after an accepted first draft, the
    second follows TARGET[1], whatever the drafts are (a likely one, an impossible one at
    position 1 (p = 0), an unlikely one)."""
    generator = torch.Generator().manual_seed(1234)
    first = torch.zeros(VOCAB, dtype=torch.int64)
    second = torch.zeros(VOCAB, dtype=torch.int64)
    accepted = 0
    for _ in range(DRAWS):
        verdict = verify_sampled(TARGET, drafts, generator)
        assert 0 <= verdict.num_accepted <= len(drafts)
        assert len(verdict.token_ids) == verdict.num_accepted + 1
        assert verdict.token_ids[: verdict.num_accepted] == drafts[: verdict.num_accepted]
        first[verdict.token_ids[0]] += 1
        if verdict.num_accepted >= 1:
            second[verdict.token_ids[1]] += 1
        accepted += verdict.num_accepted
    for counts, probs in [(first, TARGET[0]), (second, TARGET[1])]:
        statistic, df = chi_square(counts, probs)
        assert statistic < CRITICAL[df], (counts.tolist(), probs.tolist(), statistic)
    # Acceptance of the first draft is its target probability (q one-hot).
    assert abs(int(second.sum()) / DRAWS - float(TARGET[0, drafts[0]])) < 0.015


def test_a_wrong_sampler_would_fail_the_test():
    """The check has power: emitting the draft whenever the target gives it any mass (no
    rejection step) is caught."""
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for _ in range(DRAWS):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        token = 1 if u < 0.8 else int(torch.multinomial(TARGET[0], 1, generator=generator))
        counts[token] += 1
    statistic, df = chi_square(counts, TARGET[0])
    assert statistic > CRITICAL[df]


def test_a_seed_repeats_exactly():
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(7)
        runs.append([verify_sampled(TARGET, [1, 5], generator) for _ in range(200)])
    assert runs[0] == runs[1]


def test_all_accepted_draws_the_bonus_from_the_last_row():
    certain = torch.zeros(3, VOCAB, dtype=torch.float64)
    certain[0, 2] = certain[1, 4] = certain[2, 1] = 1.0
    verdict = verify_sampled(certain, [2, 4], torch.Generator().manual_seed(0))
    assert verdict.token_ids == [2, 4, 1] and verdict.num_accepted == 2


def test_greedy_accepts_the_matching_prefix_plus_the_target_token():
    logits = torch.log(TARGET.float())  # argmax per row: 1, 5, 2
    assert verify_greedy(logits, [1, 5]).token_ids == [1, 5, 2]
    assert verify_greedy(logits, [1, 0]) == verify_greedy(logits, [1, 3])
    assert verify_greedy(logits, [1, 0]).token_ids == [1, 5]
    assert verify_greedy(logits, [3, 5]).token_ids == [1]
    assert verify_greedy(logits, [3, 5]).num_accepted == 0


def test_sampling_probs_is_the_samplers_distribution():
    """Over many draws, `Sampler.sample` lands on each token as often as `sampling_probs`
    says, with temperature, top-k and top-p applied."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=0)]
    probs = sampling_probs(logits, params)[0]
    assert abs(float(probs.sum()) - 1.0) < 1e-12
    assert (probs > 0).sum() <= 4
    sampler = Sampler(seed=0)
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for _ in range(20_000):
        counts[int(sampler.sample(logits, params, [generator])[0])] += 1
    statistic, df = chi_square(counts, probs)
    assert statistic < {1: 10.828, 2: 13.816, 3: 16.266}[df]
