"""Sampled outputs under JSON schemas always validate: twelve schemas (nested objects, bounded
arrays, enums, patterns, numbers with bounds, nullable fields), each sampled at temperature 1
with n = 4 on tiny-llama, whose random weights would never write JSON on their own: every
branch must end because its document is complete (finish reason `stop`) and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
from support.engine import finish_clean

from pagedserve import LLM, SamplingParams
from pagedserve.workers.protocol.guided import GuidedSpec

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.com$"},
                },
                "required": ["id", "email"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -50, "maximum": 50},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["items"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": [1, 2, 3]},
        },
        "required": ["color", "size"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["price", "qty"],
    },
    "nullable": {
        "type": "object",
        "properties": {
            "note": {"type": ["string", "null"], "maxLength": 5},
            "score": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]
            },
        },
        "required": ["note", "score"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
    "const_and_boolean": {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "flag": {"type": "boolean"}},
        "required": ["version", "flag"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "string", "maxLength": 4},
        "minItems": 1,
        "maxItems": 3,
    },
    "deep": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "optional_and_closed": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 100},
            "y": {"type": "string", "maxLength": 3},
        },
        "required": ["x"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def outputs(tiny_llama):
    loaded, _ = tiny_llama
    llm = LLM(loaded_model=loaded, block_size=16, num_kv_blocks=512, attention_backend="torch")
    prompts = [f"Write the {name} document: " for name in SCHEMAS]
    params = [
        SamplingParams(
            n=4, temperature=1.0, max_tokens=160, seed=7 + i, guided=GuidedSpec.json_schema(s)
        )
        for i, s in enumerate(SCHEMAS.values())
    ]
    results = llm.generate(prompts, params)
    finish_clean(llm)
    return dict(zip(SCHEMAS, results, strict=True))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_branch_is_a_valid_document(outputs, name):
    result = outputs[name]
    assert result.error is None and len(result.outputs) == 4
    for branch in result.outputs:
        assert branch.finish_reason == "stop", (name, branch.text)
        jsonschema.validate(json.loads(branch.text), SCHEMAS[name])


def test_the_branches_differ(outputs):
    """Temperature 1 really sampled (a grammar that left one path would prove nothing)."""
    texts = {branch.text for result in outputs.values() for branch in result.outputs}
    assert len(texts) > len(SCHEMAS) * 2
