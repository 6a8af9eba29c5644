"""Structured outputs on the real model, SmolLM2-135M-Instruct (its 49,152-token BPE
vocabulary through xgrammar's Hugging Face tokenizer info): a grammar that allows every
greedy path leaves greedy decoding exactly as it is, and a chat answer under a JSON schema
validates."""

from __future__ import annotations

import json

import jsonschema
from support.engine import finish_clean
from support.real_model import prompt_ids

from pagedserve import LLM, SamplingParams
from pagedserve.workers.model.tokenizer import render_chat
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec


def engine(loaded) -> LLM:
    return LLM(loaded_model=loaded, block_size=16, num_kv_blocks=256, attention_backend="torch")


def test_greedy_under_a_grammar_allowing_any_text_is_unconstrained_greedy(smollm2):
    """`[\\s\\S]*` allows every text and the end anywhere: the mask must change no allowed
    token's logit, and the matcher must advance one token per token (else it would refuse a
    later token or forbid the EOS where greedy ends)."""
    loaded, _ = smollm2
    llm = engine(loaded)
    prompts = prompt_ids(loaded)[:3]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    spec = GuidedSpec(GuidedKind.REGEX, r"[\s\S]*")
    guided = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, guided=spec))
    for plain, constrained in zip(free, guided, strict=True):
        assert constrained.outputs[0].token_ids == plain.outputs[0].token_ids
        assert constrained.outputs[0].finish_reason == plain.outputs[0].finish_reason
    finish_clean(llm)


def test_a_chat_answer_under_a_schema_validates(smollm2):
    loaded, _ = smollm2
    llm = engine(loaded)
    schema = {
        "type": "object",
        "properties": {
            "capital": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 2000},
        },
        "required": ["capital", "country", "population_millions"],
    }
    chat = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    prompt = render_chat(loaded.tokenizer, chat)
    params = SamplingParams(
        n=4, temperature=1.0, seed=0, max_tokens=64, guided=GuidedSpec.json_schema(schema)
    )
    (result,) = llm.generate([prompt], params)
    for branch in result.outputs:
        assert branch.finish_reason == "stop", branch.text
        jsonschema.validate(json.loads(branch.text), schema)
    finish_clean(llm)
