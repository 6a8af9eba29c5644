"""HF's beam search as the reference for the engine's (`workers/beam/groups.py`)."""

from __future__ import annotations

import pytest
import torch

MAX_TOKENS = 12


def hf_beams(reference, prompt: list[int], width: int, max_tokens: int, **generate):
    """HF's `generate(num_beams=width)`: each returned beam's output ids and its score."""
    with torch.inference_mode():
        out = reference.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            **generate,
        )
    return [s[len(prompt) :].tolist() for s in out.sequences], out.sequences_scores.tolist()


def assert_equals_hf(reference, prompt, output, width=4, max_tokens=MAX_TOKENS, lp=1.0, **gen):
    """Every returned beam equals HF's `generate(num_beams=width, num_return_sequences=width)`:
    its token ids (ours end at the stop token; HF pads finished beams) and its score within
    1e-4, best first."""
    hf_ids, hf_scores = hf_beams(reference, prompt, width, max_tokens, length_penalty=lp, **gen)
    assert [o.index for o in output.outputs] == list(range(width))
    fill = _padding_ids(reference.model.generation_config)
    for ids, ours in zip(hf_ids, output.outputs, strict=True):
        assert ours.token_ids == ids[: len(ours.token_ids)]
        if len(ids) > len(ours.token_ids):  # HF pads a beam that stopped before the longest
            assert ours.finish_reason == "stop" and set(ids[len(ours.token_ids) :]) <= fill
    scores = [o.cumulative_logprob / len(o.token_ids) ** lp for o in output.outputs]
    assert scores == pytest.approx(hf_scores, abs=1e-4)
    assert scores == sorted(scores, reverse=True)  # best first


def _padding_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = generation_config.pad_token_id
    return set(eos) | ({pad} if pad is not None else set())
