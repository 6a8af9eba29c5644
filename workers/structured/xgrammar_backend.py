"""The xgrammar backend: `GuidedSpec` → xgrammar `Grammar` → `CompiledGrammar` → matchers.

`check_syntax` builds the tokenizer-free `Grammar` only (the router's check); `XGrammarBackend`
compiles it for one tokenizer. The vocabulary xgrammar sees is the model's logits width: ids
past the tokenizer's own vocabulary (padding rows of the embedding) are never allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from torch import Tensor

from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.protocol.guided import GuidedKind, GuidedSpec


def build_grammar(spec: GuidedSpec) -> xgr.Grammar:
    """The tokenizer-free grammar of `spec`; ValueError naming the field when it is invalid."""
    try:
        return _grammar_of(spec)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"{spec.field_name} is invalid: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", lines[0])


def check_syntax(spec: GuidedSpec) -> None:
    """Raise ValueError naming the field unless `spec` is a grammar xgrammar can build."""
    build_grammar(spec)


def _grammar_of(spec: GuidedSpec) -> xgr.Grammar:
    if spec.kind is GuidedKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind is GuidedKind.JSON_SCHEMA:
        # Compact JSON (", " and ": " between items, no newlines): what the OpenAI API returns,
        # and it keeps a weak model from spending its tokens on whitespace.
        return xgr.Grammar.from_json_schema(
            spec.value, any_whitespace=False, strict_mode=spec.strict
        )
    if spec.kind is GuidedKind.REGEX:
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind is GuidedKind.STRUCTURAL_TAG:
        return xgr.Grammar.from_structural_tag(spec.value)
    if spec.kind is GuidedKind.CHOICE:
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choices())
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(spec.value)


@dataclass(frozen=True)
class XGrammarCompiled:
    """A compiled grammar, and the extra mask its rows get (JSON: no control bytes)."""

    grammar: xgr.CompiledGrammar
    extra_mask: Tensor | None


class XGrammarMatcher:
    """A `Matcher` over xgrammar's `GrammarMatcher`."""

    def __init__(self, matcher: xgr.GrammarMatcher, extra_mask: Tensor | None) -> None:
        self.inner = matcher
        self.extra_mask = extra_mask

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


class XGrammarBackend:
    """xgrammar for one tokenizer.

    Args:
        tokenizer: the model's tokenizer (`ByteTokenizer` or `HFTokenizer`).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end a sequence: the only tokens allowed once the grammar
            is complete.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        stop_ids = sorted(int(t) for t in eos_token_ids)
        self.tokenizer_info = _tokenizer_info(tokenizer, vocab_size, stop_ids)
        # One compile thread inside xgrammar per call: the engine's pool runs compiles
        # concurrently, and the step's threads must keep the cores.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._json_mask = self._without_control_bytes()

    def compile(self, spec: GuidedSpec) -> XGrammarCompiled:
        grammar = build_grammar(spec)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"{spec.field_name} cannot be compiled: {_reason(error)}") from None
        is_json = spec.kind in (GuidedKind.JSON_OBJECT, GuidedKind.JSON_SCHEMA)
        return XGrammarCompiled(compiled, self._json_mask if is_json else None)

    def new_matcher(self, compiled: XGrammarCompiled) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.grammar), compiled.extra_mask)

    def _without_control_bytes(self) -> Tensor:
        """One bitmask row allowing every token but those holding a byte below 0x20.

        JSON never has one unescaped, and compact JSON (no newlines) none between tokens; but
        xgrammar 0.2.9's rule for a string with `maxLength` lets them into the string (its
        plain string rule does not), which `json.loads` then refuses."""
        mask = self.allocate_bitmask(1)[0]
        for token_id, text in enumerate(self.tokenizer_info.decoded_vocab):
            if any(byte < 0x20 for byte in text):
                mask[token_id // 32] &= ~(1 << (token_id % 32))
        return mask

    def allocate_bitmask(self, num_rows: int) -> Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmasks(
        self, matchers: Sequence[XGrammarMatcher], bitmask: Tensor, rows: Sequence[int]
    ) -> None:
        self._batch.batch_fill_next_token_bitmask([m.inner for m in matchers], bitmask, list(rows))
        for matcher, row in zip(matchers, rows, strict=True):
            if matcher.extra_mask is not None:
                bitmask[row] &= matcher.extra_mask

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Sequence[int]) -> None:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(rows)
        )


def _tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    if isinstance(tokenizer, ByteTokenizer):
        # Token i < 256 is the byte i; the specials are empty (never allowed but as stops).
        vocab = [bytes([i]) for i in range(ByteTokenizer.NUM_BYTES)]
        vocab += [b""] * (vocab_size - len(vocab))
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None:
        raise ValueError("structured outputs need a Hugging Face or byte tokenizer")
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
