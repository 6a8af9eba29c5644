"""Tokenizers a worker (and the router) can use: a built-in byte tokenizer and an HF wrapper.

``ByteTokenizer`` goes with the built-in ``tiny-llama`` model and needs no files; ``HFTokenizer``
wraps the tokenizer of a local HF checkpoint. Both satisfy the ``Tokenizer`` protocol, which is
all the rest of the system relies on. ``render_chat`` turns chat messages into a prompt with the
model's chat template (tiny-llama has a plain built-in one; an HF tokenizer without a template
makes a chat request fail with ``NoChatTemplate``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pagedserve.workers.protocol.errors import NoChatTemplate

logger = logging.getLogger(__name__)

# A checkpoint directory holding this file uses the byte tokenizer (written by save_tiny_llama),
# so a saved tiny-llama reloads with exactly the tokenizer it was built for.
BYTE_TOKENIZER_MARKER = "pagedserve_tokenizer.json"

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and router need from a tokenizer."""

    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens left out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then the special tokens ``<pad>``, ``<bos>``, ``<eos>``.

    ``encode`` adds no special tokens unless ``add_bos=True``; ``decode`` drops special ids and
    replaces invalid UTF-8 (e.g. a multi-byte character cut in half) with U+FFFD.
    """

    NUM_BYTES = 256
    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259
    special_tokens: dict[str, int] = {"<pad>": 256, "<bos>": 257, "<eos>": 258}

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Byte ids of ``text`` in UTF-8, with ``<bos>`` first when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the byte ids among ``token_ids``; special ids are skipped.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        data = bytearray()
        for token_id in token_ids:
            token_id = int(token_id)
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} outside [0, {self.vocab_size})")
            if token_id < self.NUM_BYTES:
                data.append(token_id)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token's text: its byte (U+FFFD when not valid UTF-8 alone), or a special's name."""
        for name, special_id in self.special_tokens.items():
            if token_id == special_id:
                return name
        return self.decode([token_id])

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """tiny-llama's chat format: a ``<|role|>`` line before each turn, then (with
        ``add_generation_prompt``) ``<|assistant|>`` (plain bytes: the model has no special
        tokens for them)."""
        turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return turns + "<|assistant|>\n" if add_generation_prompt else turns


class HFTokenizer:
    """A transformers tokenizer behind the ``Tokenizer`` protocol.

    ``encode`` never lets the HF tokenizer add special tokens itself (some add ``</s>`` too, which
    must never end a prompt). It prepends ``bos`` when ``add_bos`` is true; by default that is
    whatever the model's tokenizer does on its own (Llama: yes, Qwen2: no), so prompts match what
    the model was trained on. ``decode`` skips special tokens.
    """

    def __init__(self, tokenizer: Any, *, add_bos: bool | None = None) -> None:
        """Wrap ``tokenizer``.

        Args:
            tokenizer: a ``PreTrainedTokenizerBase``.
            add_bos: prepend ``bos`` in ``encode``; ``None`` copies what ``tokenizer`` does.
        """
        self._tokenizer = tokenizer
        self.vocab_size: int = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.bos_token_id: int | None = tokenizer.bos_token_id
        if add_bos is None:
            add_bos = _adds_bos(tokenizer)
        self.add_bos: bool = add_bos and self.bos_token_id is not None

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (e.g. for chat templates)."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with ``bos`` first when ``self.add_bos``."""
        ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens skipped."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (special tokens by name; U+FFFD for part of a
        character), as vLLM shows it beside a log-probability."""
        return self._tokenizer.decode([int(token_id)], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders function tools (it reads a ``tools`` variable)."""
        template = getattr(self._tokenizer, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` by the model's own template, ending where the
        assistant's reply starts (without ``add_generation_prompt``: after the last turn);
        ``tools`` (OpenAI's shape) for templates that take them.

        Raises:
            NoChatTemplate: the tokenizer has none.
        """
        if not self.has_chat_template:
            raise NoChatTemplate("messages: this model has no chat template")
        turns = [dict(m) for m in messages]
        return self._tokenizer.apply_chat_template(
            turns, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def _adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` puts ``bos`` first when asked to add its special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True)
    return bool(with_special) and with_special[0] == bos


def render_chat(
    tokenizer: Tokenizer | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a chat, by the model's chat template.

    Args:
        tokenizer: the model's tokenizer (``None``: the model has none).
        messages: turns as ``{"role": ..., "content": ...}``; roles among system, user,
            assistant, developer, tool.
        add_generation_prompt: end with the assistant's turn opened (what generation needs).
        tools: function tools for a template that renders them (``template_takes_tools``).

    Raises:
        NoChatTemplate: the model has no tokenizer or its tokenizer no chat template.
        RequestRejected: a message is malformed (named by its index).
    """
    from pagedserve.workers.protocol.errors import RequestRejected

    if not messages:
        raise RequestRejected("messages is empty: a chat needs at least one message")
    for i, message in enumerate(messages):
        if message.get("role") not in _CHAT_ROLES:
            roles = ", ".join(sorted(_CHAT_ROLES))
            raise RequestRejected(f"messages[{i}].role must be one of {roles}")
        if not isinstance(message.get("content"), str):
            raise RequestRejected(f"messages[{i}].content must be a string")
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None or not getattr(tokenizer, "has_chat_template", True):
        raise NoChatTemplate(
            "messages: this model has no chat template; send a plain prompt instead "
            "(/v1/completions, or `prompt` over gRPC)"
        )
    if tools is not None:
        return apply(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    return apply(messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(path: str, strict: bool = False) -> Tokenizer | None:
    """The tokenizer for a model name, checkpoint directory or GGUF file, or ``None``.

    ``"tiny-llama"`` and directories written by ``save_tiny_llama`` give a ``ByteTokenizer``;
    built-in GGUF models and ``.gguf`` files give their converted checkpoint's tokenizer
    (converting on first use); other directories with tokenizer files give an ``HFTokenizer``
    (``local_files_only``; nothing is ever downloaded). A tokenizer that fails to load is logged
    and treated as absent, since token-id prompts still work without one; with ``strict``
    (`pagedserve serve`'s check before it starts anything) it raises ``ValueError`` instead.
    """
    from pagedserve.workers.model.registry import (
        BUILTIN_GGUF,
        TINY_LLAMA_NAME,
        is_gguf_file,
        resolve_model,
    )

    if path == TINY_LLAMA_NAME:
        return ByteTokenizer()
    if path in BUILTIN_GGUF or is_gguf_file(path):
        path = resolve_model(path).path
    if not os.path.isdir(path):
        return None
    marker = os.path.join(path, BYTE_TOKENIZER_MARKER)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            kind = json.load(f).get("type")
        if kind != "byte":
            raise ValueError(f"{marker}: unknown tokenizer type {kind!r}")
        return ByteTokenizer()
    if not any(os.path.isfile(os.path.join(path, name)) for name in _HF_TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # a broken tokenizer must not stop token-id serving
        if strict:
            raise ValueError(f"its tokenizer files do not load: {exc}") from exc
        logger.warning("no tokenizer loaded from %s: %s", path, exc)
        return None
    return HFTokenizer(hf_tokenizer)
