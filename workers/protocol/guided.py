"""`GuidedSpec`: what a request's output must match, as every front end states it.

Frozen and made of strings only, so it crosses process boundaries (Ray, gRPC, a handoff)
unchanged and hashes the same everywhere: the compile cache keys on `cache_key`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# A bound on the text a grammar is compiled from: compile time and memory grow with it, and one
# request must not tie up a compile thread for long (the compile time bound is the other guard).
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1_024


class GuidedKind(StrEnum):
    """What `GuidedSpec.value` holds."""

    JSON_OBJECT = "json_object"  # any JSON object (value unused)
    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON list of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF dialect, root rule `root`)
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's structural tag, as JSON (tool calls)


@dataclass(frozen=True)
class GuidedSpec:
    """One request's grammar.

    Attributes:
        kind: what `value` holds.
        value: the schema (JSON text), regex, choices (a JSON list of strings), EBNF grammar
            or structural tag (JSON text: free text and tagged JSON, as tool calls are built);
            empty for `json_object`.
        strict: for `json_schema`: properties not in the schema are refused (OpenAI's
            `strict: true`); without it `additionalProperties` is taken as the schema says.
    """

    kind: GuidedKind
    value: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidedKind):
            try:
                object.__setattr__(self, "kind", GuidedKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in GuidedKind)
                raise ValueError(f"guided.kind must be one of {kinds}, got {self.kind!r}") from None
        if not isinstance(self.value, str):
            raise ValueError(f"{self.field_name} must be a string, got {type(self.value).__name__}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(
                f"{self.field_name} has {len(self.value)} characters; at most {MAX_SPEC_CHARS}"
            )
        if self.kind in (GuidedKind.JSON_SCHEMA, GuidedKind.STRUCTURAL_TAG):
            _parse_json(self.field_name, self.value, dict)
        elif self.kind is GuidedKind.CHOICE:
            self.choices()
        elif self.kind in (GuidedKind.REGEX, GuidedKind.GRAMMAR) and not self.value:
            raise ValueError(f"{self.field_name} must not be empty")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, strict: bool = True) -> GuidedSpec:
        """A spec from a schema given as a dict or as JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(GuidedKind.JSON_SCHEMA, text, strict)

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedSpec:
        """A spec whose output is exactly one of `choices`."""
        if not isinstance(choices, list | tuple):
            raise ValueError(f"guided_choice must be a list of strings, got {choices!r}")
        return cls(GuidedKind.CHOICE, json.dumps(list(choices)))

    @property
    def field_name(self) -> str:
        """The request field errors name (the vLLM-style name; the front ends rename it)."""
        return {
            GuidedKind.JSON_OBJECT: "response_format",
            GuidedKind.JSON_SCHEMA: "guided_json",
            GuidedKind.REGEX: "guided_regex",
            GuidedKind.CHOICE: "guided_choice",
            GuidedKind.GRAMMAR: "guided_grammar",
            GuidedKind.STRUCTURAL_TAG: "tools",
        }[self.kind]

    def choices(self) -> list[str]:
        """The choices of a `choice` spec (validated: 1..1024 non-empty strings)."""
        choices = _parse_json(self.field_name, self.value, list)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise ValueError(f"guided_choice must hold 1..{MAX_CHOICES} strings")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise ValueError(f"guided_choice[{i}] must be a non-empty string, got {choice!r}")
        return choices

    @property
    def cache_key(self) -> str:
        """A hash of everything that decides the compiled grammar (with the tokenizer's)."""
        text = f"{self.kind.value}\0{int(self.strict)}\0{self.value}"
        return hashlib.sha256(text.encode()).hexdigest()


def _parse_json(field_name: str, text: str, expected: type) -> Any:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{field_name} is not valid JSON: {error}") from None
    if not isinstance(parsed, expected):
        raise ValueError(
            f"{field_name} must be a JSON {expected.__name__}, got {type(parsed).__name__}"
        )
    return parsed
