"""Tokenizers: the built-in byte tokenizer, the HF wrapper, and which one a model path gets."""

from __future__ import annotations

import pytest

from pagedserve.workers.model.tiny_llama import TINY_LLAMA_NAME, save_tiny_llama
from pagedserve.workers.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    render_chat,
)
from pagedserve.workers.protocol.errors import NoChatTemplate, RequestRejected


@pytest.mark.parametrize("text", ["", "hello, world", "héllo wörld", "日本語", "a😀b", "\x00\n\t"])
def test_byte_tokenizer_roundtrip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_special_ids() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (
        256,
        257,
        258,
        259,
    )
    assert tok.special_tokens == {"<pad>": 256, "<bos>": 257, "<eos>": 258}
    assert tok.encode("hi", add_bos=True) == [257, 104, 105]
    assert tok.decode([257, 104, 256, 105, 258]) == "hi"


def test_byte_tokenizer_invalid_utf8_is_replaced() -> None:
    tok = ByteTokenizer()
    euro = "€".encode()  # 3 bytes
    assert tok.decode(list(euro[:2])) == "\ufffd"
    assert tok.decode([*euro[:2], ord("a")]) == "\ufffda"


def test_byte_tokenizer_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="259"):
        ByteTokenizer().decode([65, 259])


def _save_hf_tokenizer(path: str, *, with_bos_template: bool) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos_template:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.save_pretrained(path)


@pytest.mark.parametrize("adds_bos", [True, False])
def test_hf_tokenizer_follows_the_model_on_bos(tmp_path, adds_bos: bool) -> None:
    _save_hf_tokenizer(str(tmp_path), with_bos_template=adds_bos)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 6)
    assert tok.add_bos is adds_bos
    expected = [1, 3, 4, 5] if adds_bos else [3, 4, 5]
    assert tok.encode("hello world !") == expected
    assert tok.decode([1, 3, 4, 2]) == "hello world"


def test_hf_tokenizer_explicit_add_bos(tmp_path) -> None:
    _save_hf_tokenizer(str(tmp_path), with_bos_template=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert HFTokenizer(hf, add_bos=True).encode("hello") == [1, 3]
    assert HFTokenizer(hf, add_bos=False).encode("hello") == [3]


def test_load_tokenizer_by_model(tmp_path) -> None:
    assert isinstance(load_tokenizer(TINY_LLAMA_NAME), ByteTokenizer)
    assert load_tokenizer(str(tmp_path / "missing")) is None
    assert load_tokenizer(str(tmp_path)) is None  # a directory without tokenizer files
    saved = save_tiny_llama(tmp_path / "tiny")
    assert isinstance(load_tokenizer(saved), ByteTokenizer)


def test_hf_chat_template_renders_the_prompt(tmp_path) -> None:
    _save_hf_tokenizer(str(tmp_path), with_bos_template=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    hf.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant{% endif %}"
    )
    tok = HFTokenizer(hf)
    turns = [{"role": "user", "content": "hello world"}]
    prompt = render_chat(tok, turns)
    assert prompt == "<s>user hello world</s><s>assistant"
    assert tok.encode(prompt)[0] == 1  # a special token in the text parses as itself


def test_chat_without_a_template_or_with_bad_messages_is_refused(tmp_path) -> None:
    _save_hf_tokenizer(str(tmp_path), with_bos_template=False)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and not tok.has_chat_template
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(NoChatTemplate, match="messages: this model has no chat template"):
        render_chat(tok, user)
    with pytest.raises(NoChatTemplate, match="messages: this model has no chat template"):
        tok.apply_chat_template(user)
    with pytest.raises(NoChatTemplate, match="messages: this model has no chat template"):
        render_chat(None, user)
    assert render_chat(ByteTokenizer(), user) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(RequestRejected, match="messages is empty"):
        render_chat(ByteTokenizer(), [])
    with pytest.raises(RequestRejected, match=r"messages\[0\].content must be a string"):
        render_chat(ByteTokenizer(), [{"role": "user", "content": None}])
