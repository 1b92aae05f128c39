"""The n-gram drafter (prompt lookup): proposes the tokens that followed the latest earlier
occurrence of the context's last n tokens, in the sequence's own context. No model.

Design notes
------------
* A match whose continuation runs into the end of the context (a loop shorter than the
  drafts asked for) is continued with the same period, so a repeating answer drafts ``k``
  tokens every step, not only up to the end of the context.
* Incremental: :meth:`NgramDrafter.extend` indexes each new token once (``max_n`` dict
  stores), :meth:`NgramDrafter.draft` looks up ``max_n`` keys at most, so a request pays
  O(max_n) per token, whatever its length. The index keeps, per n-gram, only where its
  latest occurrence ended: the most recent continuation is the likeliest to repeat.
* A value per sequence, owned by whoever drives it (``kern.engine.generate`` for ``kern run``, the
  scheduler's request for the server); :meth:`NgramDrafter.sync` catches up with a token list
  that grew elsewhere (tokens the request produced at rows 1).
* Drafts are only proposals: the target verifies them (greedy: its own argmax; sampling: its
  own draw, see kern.engine.sampler), so they change how many tokens a step yields, never which.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramDrafter"]

# The longest n-gram looked up: a 3-token match is specific enough on answers that repeat
# themselves, and shorter ones are tried when it misses.
DEFAULT_MAX_N = 3


class NgramDrafter:
    """Drafts from the context itself: the tokens that followed the most recent earlier
    occurrence of the context's last n tokens (n = max_n down to 1)."""

    def __init__(self, tokens: Sequence[int] = (), max_n: int = DEFAULT_MAX_N) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> start of the tokens that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the context."""
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens) - 1  # the new token continues n-grams ending before it
            for n in range(1, self.max_n + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n : end])] = end

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with ``tokens``, a longer list this context is a prefix of."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` proposed next tokens (possibly none)."""
        if k <= 0:
            return []
        src = self.tokens
        for n in range(min(self.max_n, len(src)), 0, -1):
            start = self._next.get(tuple(src[-n:]))
            if start is not None:
                # The context repeats with period len(src) - start from there: continue the
                # copy past its end with what was just drafted (an overlapping copy, as LZ77
                # does), so a loop shorter than k still drafts k tokens.
                out = src[start : start + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(src) - start)])
                return out
        return []
