"""The n-gram drafter (prompt lookup, ``draft = "ngram"``, the default at rows above 1):
proposes the tokens that followed the latest earlier occurrence of the context's last n
tokens, in the sequence's own context. No model, no memory.

Design notes
------------
* A match whose continuation runs into the end of the context (a loop shorter than the
  drafts asked for) is continued with the same period, so a repeating answer drafts ``k``
  tokens every step, not only up to the end of the context.
* Incremental: :meth:`NgramDrafter.extend` indexes each new token once (``max_n`` dict
  stores), :meth:`NgramDrafter.draft` looks up ``max_n`` keys at most, so a request pays
  O(max_n) per token, whatever its length. The index keeps, per n-gram, only where its
  latest occurrence ended: the most recent continuation is the likeliest to repeat.
* One index per sequence, on its request's draft state (:class:`NgramState`), for the server
  and ``kern run`` alike; :meth:`NgramDrafter.sync` catches up with the request's tokens (what
  it produced since, at any rows).
* Drafts are only proposals: the target verifies them (greedy: its own argmax; sampling: its
  own draw, see kern.engine.sampler), so they change how many tokens a step yields, never which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kern.chunk import SeqChunk
from kern.engine.drafters import DraftMemory, num_drafts
from kern.engine.request import DraftState, Request

__all__ = ["NgramDrafter", "NgramDrafting", "NgramDrafts", "NgramState"]

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


@dataclass(eq=False, slots=True)
class NgramState(DraftState):
    """A request's drafts and its n-gram index (built at its first drafting step)."""

    index: NgramDrafter | None = None


class NgramDrafts:
    """Drafts from n-gram lookup in each request's own context, planned at once: no model,
    no memory (a ``kern.engine.drafters.Drafter``)."""

    def __init__(self, rows: int) -> None:
        if rows < 2:
            raise ValueError(f"speculation needs rows >= 2, got {rows}")
        self.rows = rows

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """Up to ``rows - 1`` drafts, fewer than ``room`` (what the step's budget leaves)."""
        k = min(num_drafts(self.rows, req), room)
        if k <= 0:
            return None
        d = req.draft
        if d is None:
            d = req.draft = NgramState()
        assert isinstance(d, NgramState)
        if d.index is None:
            d.index = NgramDrafter(req.tokens)
        else:
            d.index.sync(req.tokens)
        d.drafts = d.index.draft(k)
        return len(d.drafts), len(d.drafts)

    def run(self, reqs: Sequence[Request], memory: DraftMemory) -> None:
        pass  # drafted when planned

    def accepted(self, req: Request, accepted: int) -> None:
        pass  # the index catches up with the tokens at the next plan

    def stepped(
        self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: DraftMemory
    ) -> None:
        pass


class NgramDrafting:
    """The n-gram drafter as the engine sees it (a ``kern.engine.drafters.Drafting``):
    nothing to check, size or load."""

    reads_mtp = False

    def check(self, target: Any, config: Any = None) -> None:
        pass

    def prepare(self, config: Any, layout: Any, ops: Any, target: Any) -> int:
        return 0

    def load(self, runner: Any, checkpoint: Any) -> None:
        pass

    def drafter(self, rows: int, runner: Any) -> NgramDrafts:
        return NgramDrafts(rows)
