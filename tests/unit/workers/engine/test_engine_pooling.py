"""Embedding requests (`SamplingParams.pooling`): a prefill-only request whose result is HF's
own last hidden state (after the final norm), last-token or mean pooled and L2-normalised;
beside generation in one batch, through the prefix cache, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.engine import finish_clean
from support.real_model import prompt_ids

from pagedserve.workers.engine.outputs import RequestOutput
from pagedserve.workers.offline.llm import LLM
from pagedserve.workers.protocol.sampling import Pooling, SamplingParams

PROMPTS = [
    list(b"Embeddings pool the final hidden state of a prompt."),
    list(b"A second, shorter prompt."),
    list(b"x"),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def embed(pooling: Pooling | str) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=pooling)


def hf_embedding(model, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
    """HF's forward over the prompt: its last hidden state pooled, then L2-normalised."""
    with torch.inference_mode():
        states = model.model(torch.tensor([token_ids])).last_hidden_state[0].float()
    pooled = states[-1] if pooling is Pooling.LAST else states.mean(dim=0)
    return F.normalize(pooled, dim=0)


def assert_embeds(output: RequestOutput, model, token_ids: list[int], pooling: Pooling) -> None:
    (completion,) = output.outputs
    assert completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "stop"
    vector = torch.tensor(completion.embedding)
    torch.testing.assert_close(
        vector, hf_embedding(model, token_ids, pooling), atol=2e-5, rtol=1e-5
    )
    assert float(vector.norm()) == pytest.approx(1.0, abs=1e-6)


def engine(loaded, **config) -> LLM:
    options = {"block_size": 8, "num_kv_blocks": 64, "attention_backend": "torch", **config}
    return LLM(loaded_model=loaded, **options)


@pytest.mark.parametrize("pooling", list(Pooling))
def test_embeddings_equal_hf_s_pooled_last_hidden_state(tiny_llama, pooling):
    loaded, reference = tiny_llama
    llm = engine(loaded)
    outputs = llm.generate(PROMPTS, embed(pooling))
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert_embeds(output, reference.model, prompt, pooling)
    assert llm.engine.num_steps == 1, "one prefill step for the batch, no decode"
    finish_clean(llm)


def test_embeddings_ride_in_generation_s_batches(tiny_llama):
    loaded, reference = tiny_llama
    llm = engine(loaded)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    params = [GREEDY, embed("last"), embed("mean"), GREEDY]
    outputs = llm.generate(prompts, params)
    for output, prompt in zip(outputs[::3], prompts[::3], strict=True):
        assert output.outputs[0].token_ids == reference.greedy(prompt, 12)
        assert output.outputs[0].embedding is None
    assert_embeds(outputs[1], reference.model, prompts[1], Pooling.LAST)
    assert_embeds(outputs[2], reference.model, prompts[2], Pooling.MEAN)
    finish_clean(llm)


def test_last_pooling_shares_the_prefix_cache(tiny_llama):
    """A cached prefix is not recomputed; the last token always is, so the vector is the
    same; the embedding's blocks are free at once, and cached for the next request."""
    loaded, reference = tiny_llama
    llm = engine(loaded)
    prompt = PROMPTS[0]  # 51 tokens: 6 full blocks
    (first,) = llm.generate([prompt], embed("last"))
    usage = llm.stats()  # one step: its blocks were freed in the step that pooled
    assert llm.engine.num_steps == 1 and usage.used_blocks == 0
    assert usage.cached_free_blocks == 6
    (again,) = llm.generate([prompt], embed("last"))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    torch.testing.assert_close(
        torch.tensor(again.outputs[0].embedding),
        torch.tensor(first.outputs[0].embedding),
        atol=1e-6,
        rtol=1e-6,
    )
    assert_embeds(again, reference.model, prompt, Pooling.LAST)
    (generated,) = llm.generate([prompt], GREEDY)
    assert generated.num_cached_tokens == 48, "generation hits the embedding's blocks"
    assert generated.outputs[0].token_ids == reference.greedy(prompt, 12)
    finish_clean(llm)


def test_mean_pooling_takes_no_hit_and_sums_its_chunks(tiny_llama):
    loaded, reference = tiny_llama
    llm = engine(loaded, enable_chunked_prefill=True, max_num_batched_tokens=16)
    prompt = PROMPTS[0]
    (warm,) = llm.generate([prompt], GREEDY)  # caches the prompt's full blocks
    (mean,) = llm.generate([prompt], embed("mean"))
    assert warm.num_cached_tokens == 0 and mean.num_cached_tokens == 0
    assert_embeds(mean, reference.model, prompt, Pooling.MEAN)
    (last,) = llm.generate([prompt], embed("last"))  # 4 chunks of 16 less the cached 48
    assert last.num_cached_tokens == 48
    assert_embeds(last, reference.model, prompt, Pooling.LAST)
    finish_clean(llm)


def test_an_embedding_s_last_token_is_never_drafted(tiny_llama):
    """Chunks of 16 leave the last of 49 prompt tokens to a step of its own, which looks like a
    decode step to speculative decoding (and the prompt repeats itself, so n-grams would
    propose): it is pooled, never drafted, beside a generation that speculates."""
    loaded, reference = tiny_llama
    llm = engine(
        loaded,
        speculative={"method": "ngram", "num_tokens": 3},
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    prompt = list(b"ab" * 24 + b"a")
    room = SamplingParams(max_tokens=16, pooling="last")  # max_tokens would leave room to draft
    outputs = llm.generate([prompt, PROMPTS[1]], [room, GREEDY])
    assert_embeds(outputs[0], reference.model, prompt, Pooling.LAST)
    assert outputs[1].outputs[0].token_ids == reference.greedy(PROMPTS[1], 12)
    finish_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_mean_pooling_request_sums_each_position_once(tiny_llama, mode):
    loaded, reference = tiny_llama
    long_prompt = list(b"Mean pooling sums every prompt position once, even when preempted. " * 2)
    llm = engine(
        loaded,
        num_kv_blocks=24,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        preemption_mode=mode,
        num_swap_blocks=64,
        watermark=0.0,
    )
    generation = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[1][::-1], long_prompt]
    outputs = llm.generate(prompts, [generation, generation, embed("mean")])
    assert outputs[2].metrics.num_preemptions > 0
    assert_embeds(outputs[2], reference.model, long_prompt, Pooling.MEAN)
    for output, prompt in zip(outputs[:2], prompts[:2], strict=True):
        assert output.outputs[0].token_ids == reference.greedy(prompt, 32)
    finish_clean(llm)


def test_smollm2_embeddings_equal_hf(smollm2):
    loaded, reference = smollm2
    texts = prompt_ids(loaded)
    prompts = [texts[3], texts[8], texts[12]]  # 140, 23 and 37 tokens: a text and two chats
    llm = LLM(loaded_model=loaded, block_size=16, num_kv_blocks=32, linear_backend="torch")
    poolings = [Pooling.LAST, Pooling.MEAN, Pooling.LAST]
    outputs = llm.generate(prompts, [embed(pooling) for pooling in poolings])
    for output, prompt, pooling in zip(outputs, prompts, poolings, strict=True):
        assert_embeds(output, reference.model, prompt, pooling)
    finish_clean(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pooling": "max"}, "pooling must be one of last, mean, got 'max'"),
        ({"pooling": "last", "n": 2}, "n must be 1 for an embedding"),
        ({"pooling": "mean", "logprobs": 1}, "logprobs: an embedding"),
        ({"pooling": "mean", "prompt_logprobs": 0}, "prompt_logprobs: an embedding"),
    ],
)
def test_bad_pooling_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(pooling="mean").pooling is Pooling.MEAN
