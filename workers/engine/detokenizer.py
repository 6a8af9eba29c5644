"""Incremental detokenization: token ids in, text deltas out, stop strings applied.

Two layers, each holding back text for its own reason::

    token ids ──decode a window──► committed text ──stop strings──► emitted deltas
                 holds an incomplete         holds a tail that could still
                 UTF-8 tail (U+FFFD)         grow into a stop string

Decoding follows vLLM's ``detokenize_incrementally``: only the window
``ids[prefix_offset:]`` is decoded each step, and the new text is what it adds to the text of
``ids[prefix_offset:read_offset]``. The prefix gives tokenizers that decode a token differently
at the start of a string (leading spaces) the context they need; the window stays a few tokens
long, so a long output costs linear, not quadratic, time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# A window still ending in U+FFFD after this many held tokens holds invalid bytes, not a
# character in flight; past it, commit all but the last few tokens so a long run of invalid bytes
# cannot make every step decode an ever longer window.
_MAX_HELD_TOKENS = 16
# UTF-8 characters are at most 4 bytes, so an unfinished one spans at most the last 3 tokens.
_MIN_TAIL_TOKENS = 4


class Decoder(Protocol):
    """All the detokenizer needs from a tokenizer."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; invalid UTF-8 becomes U+FFFD, special ids decode to ""."""
        ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, handling partial UTF-8 and stop strings.

    Owns one output's token ids, its text so far, and how much of that text has been emitted.
    The deltas returned by ``append`` and then ``flush``, concatenated, equal ``text``.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        """Start an empty output.

        Args:
            tokenizer: anything with ``decode(ids) -> str``.
            stop: strings that end the output when they appear in it.
            include_stop_str_in_output: keep the matched stop string at the end of ``text``.
        """
        self._tokenizer = tokenizer
        self._stop = [stop] if isinstance(stop, str) else list(stop)
        self._include_stop = include_stop_str_in_output
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Emitted text is kept as pieces, never rebuilt: a step touches only `_held`, the
        # committed text not yet emitted (with stop strings, shorter than the longest one).
        self._emitted: list[str] = []
        self._num_emitted = 0
        self._held = ""
        self._skip = 0  # characters to emit silently: another detokenizer emitted them
        self._stopped_by: str | None = None

    @property
    def text(self) -> str:
        """Text so far (truncated at the stop string when stopped); excludes an unfinished
        UTF-8 character until ``flush``. Joined on each call: not for every step."""
        return "".join(self._emitted) + self._held

    @property
    def num_emitted_chars(self) -> int:
        """How much of ``text`` ``append``/``flush`` have returned so far."""
        return self._num_emitted

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the output, or ``None``."""
        return self._stopped_by

    @property
    def token_ids(self) -> list[int]:
        """Every token id appended so far (a copy)."""
        return list(self._token_ids)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens.

        Args:
            token_ids: the new tokens, in order.

        Returns:
            New text that is safe to emit now ("" once stopped).
        """
        if self._stopped_by is not None:
            return ""
        self._token_ids.extend(token_ids)
        self._add_text(self._decode_new())
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever was held back, at the end of generation.

        Returns:
            The held-back text, with an unfinished UTF-8 character as U+FFFD.
        """
        if self._stopped_by is None:
            self._add_text(self._decode_new(final=True))
        return self._emit(final=True)

    def resume(self, token_ids: Sequence[int], num_emitted_chars: int) -> None:
        """Take over an output another detokenizer streamed (a request moved here): its tokens,
        of whose text the first ``num_emitted_chars`` characters were already emitted there.
        Later calls return only the rest, including text the other one still held back."""
        self.append(token_ids)
        text = self.text
        # All at once, the text may be committed less far than token by token (a window ending
        # mid-character waits): what is not committed yet is skipped when it comes.
        num_here = min(num_emitted_chars, len(text))
        self._emitted = [text[:num_here]]
        self._num_emitted = num_here
        self._held = text[num_here:]
        self._skip = num_emitted_chars - num_here

    def _decode_new(self, final: bool = False) -> str:
        """Text the window adds since the last commit; "" while it ends mid-character."""
        ids = self._token_ids
        prefix_text = self._tokenizer.decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(ids[self._prefix_offset :])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            return new_text[len(prefix_text) :]
        if len(ids) - self._read_offset > _MAX_HELD_TOKENS:
            return self._commit_invalid_run(prefix_text, new_text)
        return ""

    def _commit_invalid_run(self, prefix_text: str, new_text: str) -> str:
        """Commit a long run of invalid bytes up to a split that decodes the same either way."""
        ids = self._token_ids
        for split in range(len(ids) - _MIN_TAIL_TOKENS, len(ids) - 2 * _MIN_TAIL_TOKENS, -1):
            head = self._tokenizer.decode(ids[self._prefix_offset : split])
            tail = self._tokenizer.decode(ids[split:])
            # Equal only if no character straddles the split, so later tokens cannot change head.
            if head + tail == new_text and head.startswith(prefix_text) and head != prefix_text:
                self._prefix_offset, self._read_offset = self._read_offset, split
                return head[len(prefix_text) :]
        return ""

    def _add_text(self, new_text: str) -> None:
        """Append committed text and stop at the first stop string it completes.

        A stop string that the new text completes starts in `_held`, never in emitted text:
        its start was a possible stop prefix, and `_emit` holds every such tail back.
        """
        if not new_text:
            return
        old_len = len(self._held)
        self._held += new_text
        match = self._find_stop(old_len)
        if match is not None:
            start, stop = match
            self._stopped_by = stop
            self._held = self._held[: start + len(stop) if self._include_stop else start]

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The stop string match (in `_held`) that ends first among those ending in the new
        text.

        Earliest end (ties: longest) is what a token-by-token stream would see first, so the
        result does not depend on how many tokens each ``append`` brought.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = self._held.find(stop, max(0, old_len - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _emit(self, final: bool) -> str:
        """The not yet emitted text, less a tail that may still become a stop string."""
        end = len(self._held)
        if not final and self._stopped_by is None:
            end -= self._stop_prefix_len()
        delta, self._held = self._held[:end], self._held[end:]
        if delta:
            self._emitted.append(delta)
            self._num_emitted += len(delta)
        if self._skip:
            skipped = min(self._skip, len(delta))
            self._skip -= skipped
            delta = delta[skipped:]
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of a stop
        string (such a suffix never reaches into emitted text: it would have been held)."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest
