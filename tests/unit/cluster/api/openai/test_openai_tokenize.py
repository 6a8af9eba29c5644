"""`/tokenize`'s text to token ids: the chat template's generation prompt and the special
tokens, on the real model's BPE tokenizer (the routes end to end: the integration module
`test_api_http_surface`)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.api.errors import ApiError
from pagedserve.cluster.api.openai.chat_messages import ChatMessage
from pagedserve.cluster.api.openai.tokenization import chat_turns, encode
from pagedserve.workers.model.tokenizer import ByteTokenizer, HFTokenizer, render_chat

CHAT = [{"role": "user", "content": "What is a KV cache?"}]


def test_the_generation_prompt_is_the_assistant_turn_opened(smollm2_tokenizer):
    opened = render_chat(smollm2_tokenizer, CHAT)
    closed = render_chat(smollm2_tokenizer, CHAT, add_generation_prompt=False)
    assert opened.startswith(closed) and opened[len(closed) :] == "<|im_start|>assistant\n"
    assert render_chat(ByteTokenizer(), CHAT, add_generation_prompt=False) == (
        "<|user|>\nWhat is a KV cache?\n"
    )


def test_special_tokens_are_what_generation_adds(smollm2_tokenizer):
    with_bos = HFTokenizer(smollm2_tokenizer.hf_tokenizer, add_bos=True)
    bos = with_bos.bos_token_id
    text = "Paged attention"
    assert encode(with_bos, text, True) == [bos, *encode(with_bos, text, False)]
    assert encode(with_bos, text, True) == with_bos.encode(text), "as the router tokenizes"
    assert bos not in encode(with_bos, text, False)
    assert encode(ByteTokenizer(), text, False) == list(text.encode())


def test_a_turn_without_content_is_named():
    turns = [ChatMessage(role="user", content="a"), ChatMessage(role="assistant")]
    with pytest.raises(ApiError, match=r"messages\[1\].content") as caught:
        chat_turns(turns)
    assert caught.value.param == "messages[1]"
