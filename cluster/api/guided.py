"""Structured-output fields of both front ends → one `GuidedSpec`, checked at the router.

A request names its grammar at most one way: OpenAI's `response_format` (`json_object`, or
`json_schema` with `strict`), the vLLM-style extras (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, or the same under `structured_outputs`), or the gRPC
`SamplingParams` fields. Here the spec is built and its syntax checked without a tokenizer
(xgrammar builds the grammar; the worker compiles it for its vocabulary, off its step), so a
malformed schema, regex or grammar is an INVALID_ARGUMENT naming the field the client sent,
before any work is queued. The Router's process imports xgrammar (and with it torch) on the
first request that sets one of these fields, never at start.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.cluster.api.errors import ApiError
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec

_SPEC_FIELD = re.compile(r"^(guided_[a-z_]+|response_format)")


def guided_spec(sent: dict[str, tuple[GuidedKind, Any, bool]]) -> GuidedSpec | None:
    """The one grammar of a request.

    Args:
        sent: request field name (as the client sent it) → (kind, value, strict), for every
            structured-output field the request set (a `json_object` value is ignored).

    Returns:
        The checked spec, or None when no field was set.

    Raises:
        ApiError: INVALID_ARGUMENT naming the field: more than one was set, or the value is
            not a valid schema, regex, choice list or grammar.
    """
    if not sent:
        return None
    if len(sent) > 1:
        first, *others = sorted(sent)
        names = " and ".join([first, *others])
        raise ApiError.invalid(f"{names}: at most one structured-output field may be set", first)
    ((field, (kind, value, strict)),) = sent.items()
    # Imported here: xgrammar imports torch, which the Router's process loads only once a
    # request asks for a grammar (tests/unit/cluster/test_light_imports.py).
    from pagedserve.workers.structured.xgrammar_backend import check_syntax

    try:
        spec = _spec(kind, value, strict)
        check_syntax(spec)
    except ValueError as error:
        # The spec names its own field (`guided_json`, ...): name the one the client sent.
        message = _SPEC_FIELD.sub(field, str(error), count=1)
        raise ApiError.invalid(message, field) from None
    return spec


def _spec(kind: GuidedKind, value: Any, strict: bool) -> GuidedSpec:
    if kind is GuidedKind.JSON_OBJECT:
        return GuidedSpec(kind)
    if kind is GuidedKind.JSON_SCHEMA:
        if isinstance(value, dict):
            return GuidedSpec.json_schema(value, strict)
        if not isinstance(value, str):
            raise ValueError("guided_json must be a JSON schema (an object, or its JSON text)")
        return GuidedSpec(kind, value, strict)
    if kind is GuidedKind.CHOICE:
        if not isinstance(value, list):
            raise ValueError("guided_choice must be a list of strings")
        return GuidedSpec(kind, json.dumps(value))
    if not isinstance(value, str):
        raise ValueError(f"guided_{kind.value} must be a string")
    return GuidedSpec(kind, value)
