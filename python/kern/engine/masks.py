"""A grammar's mask on a row of logits: xgrammar's token bitmask (one matcher per request,
:class:`Matcher`; a step's rows filled in one call, :func:`apply_all`), the control-character
tokens a JSON answer must not hold, and the UTF-8 rule on the byte after a lead byte
(kern.engine.structured's design notes say why each exists).

``Matcher`` reads from its grammars (kern.engine.structured.Grammars): ``vocab_size``,
``batch`` (xgrammar's BatchGrammarMatcher), ``banned`` (the control-character tokens),
``token_bytes`` and ``first_byte``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["BATCH_THREADS", "Matcher", "apply_all", "ban_second_bytes", "lead_byte"]

# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (maxLength) as
# [^"\\\r\n]: raw control characters pass, which JSON forbids (seen: a tool call's
# arguments with \x0e in a string). Its unbounded strings exclude them; so do
# kern.engine.grammar_compile.build_grammar's.
# UTF-8 lead bytes whose next byte is narrower than 80..BF: no overlong forms, no
# surrogates, nothing past U+10FFFF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


# Threads xgrammar fills a step's masks with: one took 0.72 ms per batch-32 step, two 2.7 ms, on
# the 2-core machine this was measured on (32 JSON-schema rows of the tiny vocabulary).
BATCH_THREADS = 1


class Matcher:
    """One request's grammar state."""

    def __init__(self, xgr: Any, compiled: Any, grammars: Any) -> None:
        self._xgr = xgr
        grammar, self._ban_controls = compiled
        self._matcher = xgr.GrammarMatcher(grammar)
        self._g = grammars
        self._lead = -1  # a lead byte whose next byte UTF-8 restricts, just emitted

    def apply(self, logits: Tensor) -> None:
        """Set the logits [1, vocab] of tokens the grammar does not allow next to -inf."""
        apply_all(logits, [(0, self)])

    @property
    def done(self) -> bool:
        """The grammar has ended (its end-of-sequence token was accepted)."""
        return bool(self._matcher.is_terminated())

    def _extra(self, row: Tensor) -> None:
        """What this matcher bans beyond xgrammar's mask and the control tokens, in ``row``
        [vocab]."""
        if self._lead >= 0:
            ban_second_bytes(row, self._lead, self._g.first_byte)

    def accept(self, token: int) -> bool:
        """Advance by the token sampled; False if the grammar refuses it."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        self._lead = lead_byte(self._g.token_bytes, token)
        return True


def lead_byte(token_bytes: list[bytes], token: int) -> int:
    """The UTF-8 lead byte ``token`` ends with whose next byte UTF-8 restricts, or -1."""
    raw = token_bytes[token] if token < len(token_bytes) else b""
    return raw[-1] if raw and raw[-1] in _SECOND_BYTE else -1


def ban_second_bytes(row: Tensor, lead: int, first_byte: Tensor) -> None:
    """Set ``row`` [vocab]'s tokens that cannot follow the lead byte ``lead`` to -inf."""
    lo, hi = _SECOND_BYTE[lead]
    outside = (first_byte < lo) | (first_byte > hi)
    row[: outside.shape[0]][outside] = -torch.inf


def apply_all(logits: Tensor, rows: list[tuple[int, Matcher]]) -> None:
    """Mask rows of ``logits`` [N, vocab], each ``(row, matcher)`` by its matcher: one bitmask
    filled row by row and applied in one call. Each
    row's mask is its matcher's alone, so a row's result does not depend on the others."""
    if not rows:
        return
    first = rows[0][1]
    bitmask = first._xgr.allocate_token_bitmask(logits.shape[0], first._g.vocab_size)
    first._g.batch.batch_fill_next_token_bitmask(
        [m._matcher for _, m in rows], bitmask, [k for k, _ in rows]
    )
    first._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[k for k, _ in rows])
    banning = [k for k, m in rows if m._ban_controls]
    if banning:
        banned = first._g.banned
        logits[torch.tensor(banning).unsqueeze(1), banned.unsqueeze(0)] = -torch.inf
    for k, m in rows:
        if m._lead >= 0:
            m._extra(logits[k])
