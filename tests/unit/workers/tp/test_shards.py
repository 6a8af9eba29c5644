"""Which heads, rows and vocabulary each rank owns, and the group sizes refused."""

import pytest

from pagedserve.workers.engine.checks import EngineConfigError
from pagedserve.workers.tp.shards import check_tp_size, plan_shards, split_evenly


def test_split_evenly_gives_the_first_parts_the_remainder():
    assert split_evenly(3, 2) == [(0, 2), (2, 3)]
    assert split_evenly(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_evenly(5, 5) == [(i, i + 1) for i in range(5)]


def test_smollm2_shape_splits_by_kv_head_groups():
    # SmolLM2-135M: 9 query heads over 3 KV heads; k = 2 gives ranks 2 and 1 KV heads.
    first, second = plan_shards(2, num_heads=9, num_kv_heads=3, intermediate=1536, vocab=49152)
    assert (first.kv_heads, second.kv_heads) == ((0, 2), (2, 3))
    assert (first.q_heads, second.q_heads) == ((0, 6), (6, 9))
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    assert (first.vocab, second.vocab) == ((0, 24576), (24576, 49152))
    assert (first.num_kv_heads, second.num_q_heads) == (2, 3)


@pytest.mark.parametrize(
    ("size", "heads", "kv_heads", "words"),
    [
        (0, 8, 2, "integer >= 1"),
        (3, 8, 2, "more than m's 2 KV heads"),
        (2, 9, 2, "not a whole number per KV head"),
    ],
)
def test_refused_sizes_name_the_flag(size, heads, kv_heads, words):
    with pytest.raises(EngineConfigError, match=words) as caught:
        check_tp_size(size, heads, kv_heads, "m")
    assert caught.value.field == "tensor_parallel_size"
    assert "tensor_parallel_size" in str(caught.value)
