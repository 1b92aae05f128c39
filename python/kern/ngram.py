"""The n-gram drafter (prompt lookup): proposes the tokens that followed the latest earlier
occurrence of the context's last n tokens, in the sequence's own context. No model.

Design notes
------------
* Incremental: :meth:`NgramDrafter.extend` indexes each new token once (``max_n`` dict
  stores), :meth:`NgramDrafter.draft` looks up ``max_n`` keys at most, so a request pays
  O(max_n) per token, whatever its length. The index keeps, per n-gram, only where its
  latest occurrence ended: the most recent continuation is the likeliest to repeat.
* A value per sequence, owned by whoever drives it (``kern.generate`` for ``kern run``, the
  scheduler's request for the server); :meth:`NgramDrafter.sync` catches up with a token list
  that grew elsewhere (tokens the request produced at rows 1).
* Drafts are only proposals: the target verifies them (greedy: its own argmax; sampling: its
  own draw, see kern.sampler), so they change how many tokens a step yields, never which.
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
        for n in range(min(self.max_n, len(self.tokens)), 0, -1):
            start = self._next.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
