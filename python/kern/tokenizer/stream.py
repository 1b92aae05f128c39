"""Incremental detokenization of one sequence (:class:`TextStream`), for streaming answers."""

from __future__ import annotations

import tokenizers

__all__ = ["TextStream"]


class TextStream:
    """Incremental detokenization of one sequence, for streaming answers.

    ``step(id)`` returns the text that id releases: everything decoded so far except a
    trailing U+FFFD, which may be a multi-byte character still incomplete (byte-level BPE
    splits them) and is held back until the next token completes it, shows it invalid, or
    :meth:`finish` ends the sequence. ``finish()`` returns what is still held, so the
    concatenation of every ``step`` and ``finish`` is exactly ``decode`` of all ids, the text
    ``kern run`` prints: an answer that ends inside a character ends with U+FFFD there too.
    Mutable; one per sequence.

    Each step decodes a short window (the ids since the last time nothing was held, plus
    :data:`_CONTEXT` ids before them, so decoders that treat a sequence's first token
    specially see the same neighbours) and returns what lies past the part already returned.
    ``tokenizers``' own ``DecodeStream`` was dropped: it holds everything while the text ends in
    U+FFFD and has no way to flush what it holds at the end, so an answer ending inside a
    character lost its last bytes.
    """

    _CONTEXT = 4

    def __init__(self, backend: tokenizers.Tokenizer, *, skip_special_tokens: bool) -> None:
        self._tok = backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0  # the window: self._ids[self._start:]
        self._sent = 0  # characters of the window's text already returned

    def step(self, token_id: int) -> str:
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        self._ids.append(token_id)
        text = self._decode()
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        out = text[self._sent : end]
        self._sent = max(self._sent, end)
        if end == len(text) and len(self._ids) - self._start > 2 * self._CONTEXT:
            # Nothing held: slide the window so each step decodes a bounded number of ids.
            self._start = len(self._ids) - self._CONTEXT
            self._sent = len(self._decode())
        return out

    def finish(self) -> str:
        """The text still held back (a trailing U+FFFD, or ""). The stream may go on after."""
        text = self._decode()
        out = text[self._sent :]
        self._sent = len(text)
        return out

    def _decode(self) -> str:
        return self._tok.decode(self._ids[self._start :], skip_special_tokens=self._skip)
