"""Window pages (``kern.models.pages``: a page kind's sliding-window entries in pages of their
own, the pool's slots): which of a sequence's window pages a run of positions reaches, and the
table a runner that owns its memory derives from a block table. Index arithmetic only, shared
by the runner, the cache's books (``kern.engine.memory``) and the page kinds that keep them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kern.arith import cdiv

__all__ = ["shadow_window", "window_span"]


def window_span(start: int, end: int, window: int) -> range:
    """The window pages (indices into a sequence's table) positions ``[start, end)`` read and
    write: from the window of ``start`` to the page of ``end - 1``."""
    return range(max(0, start - window + 1) // window, (end - 1) // window + 1)


def shadow_window(
    block_table: Sequence[int], page_tokens: int, window: int, end: int, start: int = 0
) -> list[int]:
    """A window table for a runner that owns its memory (``Runner.with_pages``: tests,
    ``kern run``): window page ``j`` of a sequence is ``cdiv(page_tokens, window)`` window
    pages per page of the page its first position lies in, so two sequences with disjoint
    pages never share one. Indices ``[0, cdiv(end, window))``, -1 before window page
    ``start`` (a step reads only its span: no work for the whole context every step)."""
    per = cdiv(page_tokens, window)
    out = [-1] * start
    for j in range(start, cdiv(end, window)):
        p = j * window // page_tokens
        out.append(block_table[p] * per + j - cdiv(p * page_tokens, window))
    return out
