"""`GuidedSpec`, the xgrammar backend and the compile service, without an engine."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from pagedserve.workers.model.tokenizer import ByteTokenizer
from pagedserve.workers.protocol.guided import MAX_SPEC_CHARS, GuidedKind, GuidedSpec
from pagedserve.workers.structured.compiler import GrammarCompiler
from pagedserve.workers.structured.masking import constrain_drafts
from pagedserve.workers.structured.xgrammar_backend import XGrammarBackend, check_syntax

EOS = ByteTokenizer.eos_token_id


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(ByteTokenizer(), ByteTokenizer.vocab_size, [EOS])


def allowed(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, [0])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def walk(backend, spec, text: str):
    matcher = backend.new_matcher(backend.compile(spec))
    for byte in text.encode():
        assert matcher.accept_token(byte), (text, chr(byte))
    return matcher


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (GuidedSpec(GuidedKind.REGEX, "a(b"), "guided_regex"),
        (GuidedSpec(GuidedKind.GRAMMAR, "root ::= missing"), "guided_grammar"),
        (GuidedSpec.json_schema({"type": "nonsense"}), "guided_json"),
    ],
)
def test_a_bad_spec_is_refused_naming_its_field_without_a_tokenizer(spec, field):
    with pytest.raises(ValueError, match=f"^{field} is invalid: "):
        check_syntax(spec)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "json_schema", "value": "{not json"}, "guided_json is not valid JSON"),
        ({"kind": "json_schema", "value": "[1]"}, "guided_json must be a JSON dict"),
        ({"kind": "choice", "value": "[]"}, "guided_choice must hold 1..1024 strings"),
        ({"kind": "choice", "value": '["a", 3]'}, r"guided_choice\[1\] must be a non-empty"),
        ({"kind": "regex", "value": ""}, "guided_regex must not be empty"),
        ({"kind": "yaml", "value": "x"}, "guided.kind must be one of"),
        ({"kind": "regex", "value": "a" * (MAX_SPEC_CHARS + 1)}, "guided_regex has 65537"),
    ],
)
def test_spec_checks_its_value_when_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuidedSpec(**kwargs)


def test_cache_key_depends_on_kind_value_and_strict():
    schema = {"type": "object"}
    keys = {
        GuidedSpec.json_schema(schema).cache_key,
        GuidedSpec.json_schema(schema, strict=False).cache_key,
        GuidedSpec(GuidedKind.REGEX, json.dumps(schema)).cache_key,
    }
    assert len(keys) == 3
    assert GuidedSpec.json_schema(schema).cache_key == GuidedSpec.json_schema(schema).cache_key


def test_the_matcher_allows_exactly_the_grammars_next_bytes_and_eos_only_at_its_end(backend):
    spec = GuidedSpec(GuidedKind.REGEX, "ab|ac")
    matcher = backend.new_matcher(backend.compile(spec))
    assert allowed(backend, matcher) == {ord("a")}
    assert not matcher.accept_token(ord("b"))  # refused, and nothing changed
    assert matcher.accept_token(ord("a"))
    assert allowed(backend, matcher) == {ord("b"), ord("c")}
    assert matcher.accept_token(ord("c"))
    assert allowed(backend, matcher) == {EOS}
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_choice_and_json_object(backend):
    choice = GuidedSpec.choice(["yes", "no"])
    assert walk(backend, choice, "no").accept_token(EOS)
    matcher = walk(backend, GuidedSpec(GuidedKind.JSON_OBJECT), '{"k": [1, true]}')
    assert allowed(backend, matcher) == {EOS}
    assert not backend.new_matcher(
        backend.compile(GuidedSpec(GuidedKind.JSON_OBJECT))
    ).accept_token(ord("[")), "json_object is an object, never an array"


def test_json_rows_never_allow_a_control_byte_even_in_a_bounded_string(backend):
    # xgrammar 0.2.9's rule for a string with maxLength lets control bytes in; json.loads
    # refuses them, so the backend masks them for every JSON row.
    spec = GuidedSpec.json_schema({"type": "string", "maxLength": 4})
    matcher = walk(backend, spec, '"a')
    assert not allowed(backend, matcher) & set(range(0x20))
    bitmask = backend.allocate_bitmask(2)
    backend.fill_bitmasks([matcher], bitmask, [1])
    logits = torch.zeros(2, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[0]).all(), "rows without a grammar are left alone"
    assert not set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) & set(range(0x20))


def test_rollback_undoes_accepted_tokens(backend):
    matcher = walk(backend, GuidedSpec(GuidedKind.REGEX, "abc|abd"), "ab")
    assert matcher.accept_token(ord("c")) and matcher.accept_token(EOS)
    matcher.rollback(2)
    assert not matcher.is_terminated() and allowed(backend, matcher) == {ord("c"), ord("d")}


class _Drafting:
    """What `constrain_drafts` reads of a sequence."""

    def __init__(self, matcher) -> None:
        from pagedserve.workers.protocol.sampling import SamplingParams

        self.params = SamplingParams(guided=GuidedSpec(GuidedKind.REGEX, "x"))
        self.matcher = matcher
        self.bad_words_ids: list[list[int]] = []
        self.prompt_len = 0
        self.all_token_ids: list[int] = []


def test_a_draft_the_grammar_forbids_ends_the_drafts_and_the_matcher_is_rolled_back(backend):
    matcher = walk(backend, GuidedSpec(GuidedKind.REGEX, "a[bc]+d"), "a")
    drafts = [ord("b"), ord("x"), ord("c")]  # "x" is forbidden: it and all after it go
    rows = torch.zeros(len(drafts) + 1, backend.vocab_size)
    kept = constrain_drafts(rows, _Drafting(matcher), drafts, backend)
    assert kept == [ord("b")]
    assert set(torch.isfinite(rows[0]).nonzero().flatten().tolist()) == {ord("b"), ord("c")}
    after_b = {ord("b"), ord("c"), ord("d")}
    assert set(torch.isfinite(rows[1]).nonzero().flatten().tolist()) == after_b
    assert allowed(backend, matcher) == {ord("b"), ord("c")}, "rolled back to before the drafts"


def test_drafts_all_allowed_mask_every_row_as_the_matcher_stands_there(backend):
    matcher = walk(backend, GuidedSpec(GuidedKind.REGEX, "ab?c"), "")
    rows = torch.zeros(3, backend.vocab_size)
    kept = constrain_drafts(rows, _Drafting(matcher), [ord("a"), ord("c")], backend)
    assert kept == [ord("a"), ord("c")]
    assert set(torch.isfinite(rows[2]).nonzero().flatten().tolist()) == {EOS}
    assert allowed(backend, matcher) == {ord("a")}


def test_the_compiler_caches_by_spec_and_shares_a_running_compile(backend):
    compiler = GrammarCompiler(backend, "tiny-llama", num_threads=2)
    spec = GuidedSpec(GuidedKind.REGEX, "[0-9]{2}")
    first, again = compiler.submit(spec), compiler.submit(spec)
    assert first is again and compiler.num_compiles == 1 and compiler.num_cache_hits == 1
    other = compiler.submit(GuidedSpec(GuidedKind.REGEX, "[0-9]{3}"))
    assert other is not first and compiler.num_compiles == 2
    assert first.result(timeout=60) is not None
    compiler.close()


def test_a_failed_compile_is_not_kept(backend):
    compiler = GrammarCompiler(backend, "tiny-llama")
    bad = GuidedSpec(GuidedKind.GRAMMAR, "root ::= undefined_rule")
    with pytest.raises(ValueError, match="guided_grammar is invalid"):
        compiler.submit(bad).result(timeout=60)
    compiler.submit(bad)
    assert compiler.num_compiles == 2
    compiler.close()


def test_compiles_run_on_the_pool_not_the_caller(backend):
    seen = []

    class Recording:
        def compile(self, spec):
            seen.append(threading.current_thread().name)
            return backend.compile(spec)

    compiler = GrammarCompiler(Recording(), "tiny-llama")
    compiler.submit(GuidedSpec(GuidedKind.REGEX, "z")).result(timeout=60)
    assert seen and seen[0].startswith("grammar-compile")
    compiler.close()
