"""Log-probabilities of sampled and prompt tokens: HF's log_softmax of the same logits."""

from __future__ import annotations

import pickle

import pytest
import torch
from support.engine import finish_clean

from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.offline.llm import LLM
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import TokenLogprob
from pagedserve.workers.sampling.logprobs import prompt_logprob_positions
from pagedserve.workers.worker.stream import stream_deltas

PROMPT = list(b"Log-probabilities score every token of a text, prompt included.")


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[T, V]`` log_softmax of HF's own forward over the whole sequence (row p: token p+1)."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].double().log_softmax(dim=-1)


def assert_matches(item: TokenLogprob, reference: torch.Tensor, token: int, k: int) -> None:
    assert item.token_id == token
    assert item.logprob == pytest.approx(float(reference[token]), abs=1e-4)
    assert item.rank == 1 + int((reference > reference[token] + 1e-6).sum())
    assert len(item.top) == k
    best = reference.topk(k).indices.tolist()
    assert [top.token_id for top in item.top] == best
    for top in item.top:
        assert top.logprob == pytest.approx(float(reference[top.token_id]), abs=1e-4)
        assert top.token == ByteTokenizer().token_text(top.token_id)
    assert item.token == ByteTokenizer().token_text(token)


def engine(loaded, **config) -> LLM:
    options = {"block_size": 8, "num_kv_blocks": 64, "attention_backend": "torch", **config}
    return LLM(loaded_model=loaded, **options)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.3, "seed": 3}])
def test_sampled_tokens_carry_raw_logprobs(tiny_llama, sampling):
    """Raw: the model's own distribution, whatever temperature and penalties do to sampling."""
    loaded, reference = tiny_llama
    params = SamplingParams(
        max_tokens=8, ignore_eos=True, logprobs=3, presence_penalty=1.0, **sampling
    )
    llm = engine(loaded)
    (out,) = llm.generate([PROMPT], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    reference_rows = hf_logprobs(reference.model, PROMPT + completion.token_ids)
    for j, (token, item) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert_matches(item, reference_rows[len(PROMPT) - 1 + j], token, 3)
    assert out.prompt_logprobs is None
    finish_clean(llm)


@pytest.mark.parametrize("preemption_mode", [None, "recompute", "swap"])
def test_prompt_logprobs_over_chunks_and_preemption(tiny_llama, preemption_mode):
    loaded, reference = tiny_llama
    config = {"max_num_batched_tokens": 16}  # the prompt takes several chunks
    if preemption_mode:  # two long requests in a pool that holds one: one is preempted
        config.update(num_kv_blocks=14, preemption_mode=preemption_mode, watermark=0.0)
    llm = engine(loaded, **config)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    other = list(b"Another prompt that competes for the same small pool of blocks.")
    outs = llm.generate([PROMPT, other], params)
    for prompt, out in zip([PROMPT, other], outs, strict=True):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        rows = hf_logprobs(reference.model, prompt)
        for p, item in enumerate(out.prompt_logprobs[1:]):
            assert_matches(item, rows[p], prompt[p + 1], 2)
        assert out.outputs[0].token_ids == reference.greedy(prompt, 40)
    if preemption_mode:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    finish_clean(llm)


def test_prompt_logprobs_never_take_prefix_cache_hits(tiny_llama):
    loaded, _ = tiny_llama
    llm = engine(loaded)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    llm.generate([PROMPT], plain)
    (hit,) = llm.generate([PROMPT], plain)
    (scored_out,) = llm.generate([PROMPT], scored)
    assert hit.num_cached_tokens > 0 and scored_out.num_cached_tokens == 0
    assert all(len(item.top) == 0 for item in scored_out.prompt_logprobs[1:])
    finish_clean(llm)


def test_branches_and_stream_deltas_carry_their_own_logprobs(tiny_llama):
    loaded, reference = tiny_llama
    params = SamplingParams(n=2, max_tokens=6, seed=1, logprobs=1, prompt_logprobs=1)
    llm = engine(loaded)
    llm.engine.add_request("r", PROMPT, params)
    deltas = []
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            deltas += stream_deltas(delta)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        tokens = [t for d in mine for t in d.token_ids]
        items = [item for d in mine for item in d.logprobs]
        assert [item.token_id for item in items] == tokens and len(tokens) == 6
        rows = hf_logprobs(reference.model, PROMPT + tokens)
        for j, item in enumerate(items):
            assert_matches(item, rows[len(PROMPT) - 1 + j], tokens[j], 1)
        assert len(mine[0].prompt_logprobs) == len(PROMPT)
        assert all(d.prompt_logprobs is None for d in mine[1:])
    assert pickle.loads(pickle.dumps(deltas)) == deltas  # they cross Ray as they are
    finish_clean(llm)


def test_prompt_positions_of_a_chunk():
    # prompt of 10 tokens: positions 0..8 score tokens 1..9; position 9 samples.
    assert prompt_logprob_positions(0, 4, 10, 0) == range(0, 4)
    assert prompt_logprob_positions(4, 6, 10, 4) == range(4, 9)
    assert prompt_logprob_positions(0, 10, 10, 6) == range(6, 9)  # recomputed after preemption
    assert not prompt_logprob_positions(10, 1, 10, 9)  # decoding: nothing
    assert not prompt_logprob_positions(12, 1, 10, 0)  # another branch decoding: nothing
    with pytest.raises(RuntimeError, match="never computed"):
        prompt_logprob_positions(4, 4, 10, 0)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.0, True])
def test_bad_logprob_counts_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})
