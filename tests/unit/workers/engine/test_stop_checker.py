"""check_stop: EOS, ignore_eos, min_tokens, stop token ids, stop strings, length limits."""

from __future__ import annotations

import pytest

from pagedserve.workers.engine.stop_checker import check_stop
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import FinishReason

EOS = {258}


def stop(params: SamplingParams, output: list[int], *args, **kwargs) -> FinishReason | None:
    """`check_stop` for a whole output list (it reads only its length and last token)."""
    return check_stop(params, len(output), output[-1] if output else None, *args, **kwargs)


def test_finish_reason_values() -> None:
    assert [r.value for r in FinishReason] == [
        "stop",
        "length",
        "abort",
        "timeout",
        "error",
        "moved",
    ]
    assert FinishReason.STOP == "stop" and str(FinishReason.LENGTH) == "length"


def test_running_sequence_goes_on() -> None:
    p = SamplingParams(max_tokens=5)
    assert stop(p, [], EOS, False) is None
    assert stop(p, [1, 2], EOS, False) is None
    assert stop(p, [258, 2], EOS, False) is None  # EOS earlier, not last


def test_eos_stops_unless_ignored() -> None:
    assert stop(SamplingParams(), [1, 258], EOS, False) is FinishReason.STOP
    assert stop(SamplingParams(ignore_eos=True), [1, 258], EOS, False) is None
    assert stop(SamplingParams(), [1, 7], {7, 258}, False) is FinishReason.STOP


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=[42], ignore_eos=True)
    assert stop(p, [1, 42], EOS, False) is FinishReason.STOP


@pytest.mark.parametrize(("num_tokens", "stops"), [(1, False), (2, False), (3, True), (4, True)])
def test_min_tokens_gates_eos_and_stop_ids(num_tokens: int, stops: bool) -> None:
    p = SamplingParams(min_tokens=3, stop_token_ids=[42])
    for last in (258, 42):
        out = [1] * (num_tokens - 1) + [last]
        assert (stop(p, out, EOS, False) is FinishReason.STOP) is stops


def test_stop_string_hit_stops() -> None:
    assert stop(SamplingParams(min_tokens=5), [1], EOS, True) is FinishReason.STOP


def test_max_tokens_and_context_limit_give_length() -> None:
    p = SamplingParams(max_tokens=3)
    assert stop(p, [1, 2, 3], EOS, False) is FinishReason.LENGTH
    assert stop(p, [1], EOS, False, max_model_len_hit=True) is FinishReason.LENGTH
    # min_tokens never holds back a hard length limit.
    p = SamplingParams(max_tokens=8, min_tokens=8)
    assert stop(p, [1], EOS, False, max_model_len_hit=True) is FinishReason.LENGTH


def test_stop_wins_over_length_on_the_same_token() -> None:
    p = SamplingParams(max_tokens=2)
    assert stop(p, [1, 258], EOS, False) is FinishReason.STOP
    assert stop(p, [1, 2], EOS, True) is FinishReason.STOP
