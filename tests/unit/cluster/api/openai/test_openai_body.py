"""Reading an OpenAI request body: JSON depth, non-finite numbers."""

from __future__ import annotations

import pytest

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.reading import MAX_JSON_DEPTH, json_depth, parse_json


def test_json_depth():
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1, {"b": []}]}) == 4


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000, 200_000])
def test_deep_nesting_is_a_400_not_a_crash(levels):
    with pytest.raises(ApiError) as raised:
        parse_json(("[" * levels + "]" * levels).encode())
    assert raised.value.http_status == 400 and "nests deeper" in raised.value.message


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(constant):
    with pytest.raises(ApiError) as raised:
        parse_json(f'{{"temperature": {constant}}}'.encode())
    assert raised.value.http_status == 400 and constant in raised.value.message


def test_a_body_within_the_limits_parses():
    assert parse_json(b'{"a": [1, 2.5, {"b": "c"}]}') == {"a": [1, 2.5, {"b": "c"}]}
