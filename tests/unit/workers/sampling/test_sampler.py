"""Sampler: greedy, temperature, top-k, top-p, seeds, and independence from the batch."""

from __future__ import annotations

import math

import pytest
import torch
from support.sampling import reference_penalties

from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.sampling.sampler import (
    Sampler,
    apply_penalties,
    make_generator,
    suppress_stop_tokens,
)

GREEDY = SamplingParams(temperature=0.0)


def _sample_one(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, gen=None) -> int:
    return int(sampler.sample(logits.unsqueeze(0), [params], [gen])[0])


def _frequencies(logits: list[float], params: SamplingParams, draws: int = 20_000) -> torch.Tensor:
    """Empirical distribution of ``draws`` samples of one row (the sampler's own generator)."""
    batch = torch.tensor(logits).expand(draws, -1)
    tokens = Sampler(seed=1234).sample(batch, [params] * draws, [None] * draws)
    return torch.bincount(tokens, minlength=len(logits)).double() / draws


# ---- generators ----------------------------------------------------------------------------


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    # Seeds past 2**64 - 1 wrap (SamplingParams refuses them; a caller's own may not).
    wrapped, small = make_generator(2**64 + 5), make_generator(5)
    assert torch.equal(torch.rand(3, generator=wrapped), torch.rand(3, generator=small))
    make_generator(-1)


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax_and_output_shape() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    tokens = Sampler().sample(logits, [GREEDY] * 6, [None] * 6)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    assert Sampler().sample(logits, [GREEDY] * 2, [None] * 2).tolist() == [1, 0]


def test_top_k_1_is_greedy_and_draws_nothing() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    gens = [make_generator(s) for s in range(8)]
    states = [g.get_state() for g in gens]
    params = [SamplingParams(temperature=1.3, top_k=1, seed=s) for s in range(8)]
    assert torch.equal(Sampler().sample(logits, params, gens), logits.argmax(dim=-1))
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states, strict=True))


def test_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([[1.0, 2.0, 1.9999]])
    assert _sample_one(Sampler(), logits[0], SamplingParams(temperature=1e-8)) == 1


# ---- distributions ----------------------------------------------------------------------------

PROBS = [0.1, 0.2, 0.3, 0.4]
LOGITS = [math.log(p) for p in PROBS]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    freq = _frequencies(LOGITS, SamplingParams(temperature=temperature))
    expected = torch.softmax(torch.tensor(LOGITS, dtype=torch.float64) / temperature, dim=0)
    # 20k draws: one standard deviation is <= 0.0036, so 0.015 is over four.
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_top_k_renormalises_over_the_k_best() -> None:
    freq = _frequencies(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(
        freq, torch.tensor([0, 0, 3 / 7, 4 / 7]).double(), atol=0.015, rtol=0
    )


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # Sorted: 0.4, 0.3 (mass 0.7 >= 0.65), so 0.2 and 0.1 are cut.
    freq = _frequencies(LOGITS, SamplingParams(top_p=0.65))
    torch.testing.assert_close(
        freq, torch.tensor([0, 0, 3 / 7, 4 / 7]).double(), atol=0.015, rtol=0
    )


def test_top_p_applies_after_top_k() -> None:
    # top-k 3 leaves 0.2, 0.3, 0.4 -> 2/9, 3/9, 4/9; top_p 0.5 then keeps 4/9 + 3/9.
    freq = _frequencies(LOGITS, SamplingParams(top_k=3, top_p=0.5))
    torch.testing.assert_close(
        freq, torch.tensor([0, 0, 3 / 7, 4 / 7]).double(), atol=0.015, rtol=0
    )


def test_small_top_p_keeps_only_the_top_token() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 300)
    params = [SamplingParams(top_p=1e-6, seed=s) for s in range(64)]
    gens = [make_generator(s) for s in range(64)]
    assert torch.equal(Sampler().sample(logits, params, gens), logits.argmax(dim=-1))


def test_never_samples_masked_tokens() -> None:
    logits = torch.full((2000, 6), float("-inf"))
    logits[:, [1, 4]] = torch.tensor([0.0, 0.5])
    tokens = Sampler().sample(logits, [SamplingParams(temperature=1.5)] * 2000, [None] * 2000)
    assert set(tokens.tolist()) == {1, 4}


def test_large_top_k_and_half_precision_logits() -> None:
    logits = torch.randn(3, 10, dtype=torch.bfloat16)
    params = [SamplingParams(top_k=1000, seed=1)] * 3
    tokens = Sampler().sample(logits, params, [make_generator(1)] * 3)
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < 10)).all()


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="one params and one generator per row"):
        Sampler().sample(torch.zeros(2, 4), [GREEDY], [None, None])
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        Sampler().sample(torch.zeros(4), [GREEDY], [None])


# ---- reproducibility ---------------------------------------------------------------------------

TARGET = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=123)
OTHERS = [
    SamplingParams(temperature=0.7, seed=5),
    SamplingParams(temperature=1.2, top_p=0.5),
    GREEDY,
    SamplingParams(top_k=3, seed=123),  # same seed, own generator
]


def _run(order: list[int], steps: list[torch.Tensor]) -> list[int]:
    """The target row's tokens over ``steps`` when batched with ``OTHERS`` in ``order``.

    ``order`` lists row sources: -1 is the target, i >= 0 is ``OTHERS[i]``.
    """
    sampler = Sampler(seed=len(order))  # a different sampler-owned stream each run
    params = [TARGET if i < 0 else OTHERS[i] for i in order]
    gens = [make_generator(p.seed) for p in params]
    target_row = order.index(-1)
    out = []
    for step_logits in steps:
        rows = [step_logits[0] if i < 0 else step_logits[1 + i] for i in order]
        out.append(int(sampler.sample(torch.stack(rows), params, gens)[target_row]))
    return out


def test_seeded_row_is_independent_of_the_batch() -> None:
    torch.manual_seed(3)
    steps = [torch.randn(1 + len(OTHERS), 64) for _ in range(8)]
    alone = _run([-1], steps)
    assert len(set(alone)) > 1  # really sampling, not stuck on one token
    for order in ([0, -1, 1], [3, 2, 1, 0, -1], [-1, 3, 0], [2, -1, 2, 1, 3]):
        assert _run(order, steps) == alone, order


def test_same_row_in_a_32_row_batch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(32, 259)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(32)]
    batched = Sampler().sample(logits, params, [make_generator(s) for s in range(32)])
    alone = [_sample_one(Sampler(), logits[s], params[s], make_generator(s)) for s in range(32)]
    assert batched.tolist() == alone


def test_branches_equal_requests_run_alone_with_offset_seeds() -> None:
    torch.manual_seed(5)
    steps = [torch.randn(100) for _ in range(6)]
    request = SamplingParams(n=4, temperature=1.0, top_k=50, seed=1000)
    branches = [request.for_branch(j) for j in range(4)]
    gens = [make_generator(b.seed) for b in branches]
    together = [Sampler().sample(s.expand(4, -1), branches, gens).tolist() for s in steps]
    for j in range(4):
        alone_params = SamplingParams(temperature=1.0, top_k=50, seed=1000 + j)
        gen = make_generator(alone_params.seed)
        alone = [_sample_one(Sampler(), s, alone_params, gen) for s in steps]
        assert [row[j] for row in together] == alone
    assert len({tuple(row[j] for row in together) for j in range(4)}) > 1


def test_greedy_branches_all_equal() -> None:
    logits = torch.randn(100)
    request = SamplingParams(n=4, temperature=0.0, seed=9)
    branches = [request.for_branch(j) for j in range(4)]
    tokens = Sampler().sample(
        logits.expand(4, -1), branches, [make_generator(b.seed) for b in branches]
    )
    assert tokens.tolist() == [int(logits.argmax())] * 4


def test_unseeded_rows_repeat_with_the_same_sampler_seed() -> None:
    logits = torch.randn(16, 30)
    params = [SamplingParams()] * 16
    a = Sampler(seed=7).sample(logits, params, [None] * 16)
    b = Sampler(seed=7).sample(logits, params, [None] * 16)
    assert torch.equal(a, b)


# ---- min_tokens masking -----------------------------------------------------------------------


def test_suppress_stop_tokens_before_min_tokens() -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[2]),
        SamplingParams(min_tokens=3, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(min_tokens=3),
    ]
    logits = torch.zeros(3, 6)
    suppress_stop_tokens(logits, params, [2, 2, 3], eos_token_ids={5, 99})
    inf = float("-inf")
    assert logits.tolist() == [
        [0, 0, inf, 0, 0, inf],
        [0, 0, inf, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],  # reached min_tokens
    ]


# ---- penalties ------------------------------------------------------------------------------


PENALTY_LOGITS = [2.0, -1.0, 0.5, 1.5, -0.25, 0.0, 1.0, -2.0]
PENALTY_PROMPT = [1, 3, 3, 7]
PENALTY_OUTPUT = [0, 3, 0, 6, 0]
PENALTY_CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=0.4),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),  # below 1 rewards repeats
    SamplingParams(presence_penalty=-1.0, frequency_penalty=0.3, repetition_penalty=1.3),
]


@pytest.mark.parametrize("params", PENALTY_CASES)
def test_penalties_match_the_reference_definition(params: SamplingParams) -> None:
    logits = torch.tensor([PENALTY_LOGITS, PENALTY_LOGITS])
    untouched = SamplingParams()
    histories = [PENALTY_PROMPT + PENALTY_OUTPUT] * 2
    apply_penalties(logits, [params, untouched], histories, [len(PENALTY_PROMPT)] * 2)
    expected = reference_penalties(PENALTY_LOGITS, PENALTY_PROMPT, PENALTY_OUTPUT, params)
    torch.testing.assert_close(logits[0], torch.tensor(expected), rtol=0, atol=1e-6)
    assert logits[1].tolist() == PENALTY_LOGITS  # a row without penalties is left alone


@pytest.mark.parametrize("params", PENALTY_CASES)
def test_sampled_distribution_with_penalties_is_the_reference_one(params: SamplingParams) -> None:
    """What the engine does per step (penalties, then the sampler) draws from the softmax of
    the reference penalised logits."""
    params = SamplingParams(**{**params.__dict__, "temperature": 0.8})
    draws = 20_000
    logits = torch.tensor(PENALTY_LOGITS).expand(draws, -1).clone()
    history = PENALTY_PROMPT + PENALTY_OUTPUT
    apply_penalties(logits, [params] * draws, [history] * draws, [len(PENALTY_PROMPT)] * draws)
    tokens = Sampler(seed=99).sample(logits, [params] * draws, [None] * draws)
    freq = torch.bincount(tokens, minlength=len(PENALTY_LOGITS)).double() / draws
    penalised = reference_penalties(PENALTY_LOGITS, PENALTY_PROMPT, PENALTY_OUTPUT, params)
    expected = torch.softmax(torch.tensor(penalised, dtype=torch.float64) / 0.8, dim=0)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)  # > 4 sigma at 20k draws


def test_greedy_with_penalties_takes_the_penalised_argmax() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.tensor([PENALTY_LOGITS])
    # Token 0 (2.0) was generated 3 times: -4.0; tokens 3 (1.5) and 6 (1.0) once: -0.5, -1.0;
    # so token 2 (0.5, never generated) wins.
    apply_penalties(logits, [params], [PENALTY_PROMPT + PENALTY_OUTPUT], [len(PENALTY_PROMPT)])
    assert _sample_one(Sampler(), logits[0], params) == 2


def test_penalties_count_the_output_only_for_frequency_and_presence() -> None:
    """A token of the prompt alone is untouched by presence/frequency (OpenAI's definition)."""
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    logits = torch.zeros(1, 8)
    apply_penalties(logits, [params], [[7, 7, 7, 2]], [3])
    assert logits[0].tolist() == [0, 0, -2.0, 0, 0, 0, 0, 0]
