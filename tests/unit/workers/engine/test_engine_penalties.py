"""Penalties in the engine: what it generates equals the reference definition step by step."""

from __future__ import annotations

import pytest
import torch
from support.engine import finish_clean
from support.sampling import reference_penalties

from pagedserve.workers.offline.llm import LLM
from pagedserve.workers.protocol.sampling import SamplingParams

PROMPT = list(b"Penalties keep a model from repeating itself")


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """HF's own forward over the whole sequence each step, reference penalties, argmax."""
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].double().tolist()
            penalised = reference_penalties(logits, prompt, output, params)
            output.append(max(range(len(penalised)), key=penalised.__getitem__))
    return output


@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"repetition_penalty": 1.5},
        {"presence_penalty": -0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.2},
    ],
)
def test_greedy_with_penalties_follows_the_reference(tiny_llama, penalties):
    loaded, reference = tiny_llama
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **penalties)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    penalised, unpenalised = (
        out.outputs[0].token_ids for out in llm.generate([PROMPT, PROMPT], [params, plain])
    )
    assert penalised == reference_greedy(reference.model, PROMPT, params)
    assert unpenalised == reference.greedy(PROMPT, 12)  # a neighbour without penalties: as before
    assert penalised != unpenalised  # the penalties did change what was generated
    finish_clean(llm)


def test_branches_are_penalised_by_their_own_output(tiny_llama):
    """n > 1: each branch counts its own tokens (seeded sampling, so branches differ)."""
    loaded, _ = tiny_llama
    params = SamplingParams(n=3, max_tokens=10, seed=5, frequency_penalty=2.0, ignore_eos=True)
    llm = LLM(loaded_model=loaded, block_size=8, num_kv_blocks=64, attention_backend="torch")
    (together,) = llm.generate([PROMPT], params)
    for j, completion in enumerate(together.outputs):
        (alone,) = llm.generate([PROMPT], params.for_branch(j))
        assert completion.token_ids == alone.outputs[0].token_ids
    finish_clean(llm)
