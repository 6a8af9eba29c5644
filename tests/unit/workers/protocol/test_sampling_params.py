"""SamplingParams: validation names the field, normalisation, greediness, branch seeds."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from pagedserve.workers.protocol.sampling import SamplingKwargs, SamplingParams


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (
        1,
        16,
        1.0,
        1.0,
        0,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.is_greedy


def test_sampling_kwargs_name_every_field() -> None:
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert list(typing.get_type_hints(SamplingKwargs)) == fields
    assert SamplingKwargs.__required_keys__ == frozenset()


def test_stop_normalised_to_a_fresh_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    shared = ["x"]
    p = SamplingParams(stop=shared)
    p.stop.append("y")
    assert shared == ["x"]


def test_temperature_message_is_exact() -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(temperature=-1.0)
    assert str(excinfo.value) == "temperature must be >= 0, got -1.0"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 65),
        ("n", 2.0),
        ("n", True),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", "16"),
        ("temperature", -0.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_k", False),
        ("seed", "7"),
        ("seed", 7.0),
        ("seed", True),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", b"x"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("min_tokens", 1.0),
        ("include_stop_str_in_output", "yes"),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", True),
        ("seed", -1),  # would sample exactly as 2**64 - 1
        ("seed", 2**64),
        ("seed", 2**70),
    ],
)
def test_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert str(excinfo.value).startswith(field), str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 64},
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 100_000},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"min_tokens": 16},
        {"max_tokens": 1, "min_tokens": 1},
        {"stop_token_ids": [0]},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 10},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 1e-7}, True),  # would overflow logits / temperature
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 0.7, "top_p": 0.01}, False),
    ],
)
def test_is_greedy(kwargs: dict[str, object], greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_for_branch_offsets_the_seed() -> None:
    p = SamplingParams(n=4, seed=7, temperature=0.8, top_k=5, stop=["x"], max_tokens=9)
    branches = [p.for_branch(j) for j in range(4)]
    assert [b.seed for b in branches] == [7, 8, 9, 10]
    for b in branches:
        assert b.n == 1
        assert (b.temperature, b.top_k, b.stop, b.max_tokens) == (0.8, 5, ["x"], 9)
    assert branches[2] == SamplingParams(seed=9, temperature=0.8, top_k=5, stop=["x"], max_tokens=9)
    assert p.n == 4 and p.seed == 7  # the request itself is untouched


def test_for_branch_wraps_the_seed_as_a_generator_takes_it() -> None:
    p = SamplingParams(n=3, seed=2**64 - 2)
    assert [p.for_branch(j).seed for j in range(3)] == [2**64 - 2, 2**64 - 1, 0]


def test_for_branch_without_seed_stays_unseeded() -> None:
    p = SamplingParams(n=3)
    assert [p.for_branch(j).seed for j in range(3)] == [None, None, None]


@pytest.mark.parametrize("index", [-1, 4, 1.0])
def test_for_branch_rejects_bad_index(index: object) -> None:
    with pytest.raises(ValueError, match="^index"):
        SamplingParams(n=4).for_branch(index)  # type: ignore[arg-type]


def test_has_penalties() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
