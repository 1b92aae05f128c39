"""Window pages (a page kind with them, ``kern.models.window``; DeepSeek-V4's): the part of
the cache's books (``kern.engine.memory``) that takes them as a request's rows reach them, gives
them back once those rows settle, and makes the snapshots a hit resumes from.

Design notes
------------
* A running request holds only the window pages its next rows can read, taken as its chunks
  reach them (:meth:`WindowPages.grow`: a prefill chunk is cut to the pages that can be had,
  so a lone request always runs on the slots the pool keeps) and given back once its rows
  settle (:meth:`WindowPages.trim`, after a verify: a rejected draft never loses a window
  entry it needs).
* A model with window pages resumes only at a snapshot (one window page), as a stateful one
  does at a state: at each entry's end (the request's last window page, the one before
  folded in: :meth:`WindowPages.release`, which needs no new page), at the prompt-end
  snapshot (a copy), and every ``snapshot_pages`` pages of prefill that are also window page
  ends (:meth:`WindowPages.share`, a copy each). A hit copies its snapshot into the window
  pages its next token reads (``Memory`` at admission). A snapshot that cannot have its page
  is skipped: a cache, never a reason to wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kern.engine.request import Request
from kern.pool import ids, u32

if TYPE_CHECKING:
    from kern.engine.mover import Books

__all__ = ["WindowPages"]


class WindowPages:
    """The window pages of ``memory``'s requests (see the notes); snapshots every
    ``snapshot_pages`` pages of prefill (where window pages end too)."""

    def __init__(self, memory: Books, snapshot_pages: int = 1) -> None:
        if snapshot_pages < 1:
            raise ValueError(f"snapshot_pages must be >= 1, got {snapshot_pages}")
        self.memory = memory
        self.window = memory.window
        pt = memory.page_tokens
        # Whole pages and window pages both end there.
        self.every = snapshot_pages * (pt * self.window // math.gcd(pt, self.window))

    def take(self, n: int) -> list[int] | None:
        """``n`` window pages (slots) for the target, making room and, as :meth:`take_pages`,
        taking draft memory; None when they cannot be had."""
        if n <= 0:
            return []
        mem = self.memory
        if not mem.make_room(0, slots=n) and not (mem.drop_drafts() and mem.make_room(0, slots=n)):
            return None
        return [mem.cache.alloc_slot() for _ in range(n)]

    def take_one(self) -> int | None:
        got = self.take(1)
        return None if got is None else got[0]

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if p >= 0:
                self.memory.cache.free_slot(p)

    def grow(self, req: Request, k: int) -> int:
        """Window pages for ``req``'s next ``k`` rows, as many as can be had in order: the
        number of rows they cover (0: not even the next one's)."""
        w, nc, window = self.window, req.num_computed, req.window
        assert window is not None
        for j in range(nc // w, (nc + k - 1) // w + 1):
            if j < len(window) and window[j] >= 0:
                continue
            page = self.take_one()
            if page is None:
                return max(0, j * w - nc)
            window.extend([-1] * (j + 1 - len(window)))
            window[j] = page
        return k

    def trim(self, req: Request) -> None:
        """Give back the window pages before ``req``'s next row's window (its rows settled)."""
        window = req.window
        if not window:
            return
        j = max(0, req.num_computed - self.window + 1) // self.window - 1
        while j >= 0 and window[j] >= 0:
            self.memory.cache.free_slot(window[j])
            window[j] = -1
            j -= 1

    def release(self, req: Request, snapshot: bool) -> int | None:
        """Give back ``req``'s window pages but, with ``snapshot``, its last, folded into the
        snapshot at its computed length (returned, for the tree)."""
        w, window, n = self.window, req.window, req.num_computed
        assert window is not None
        last = window[(n - 1) // w] if n > 0 and snapshot else None
        if last is not None:
            self.memory.runner.snapshot_window(window, n, last)
        self.free([p for p in window if p != last])
        req.window = None
        return last

    def share(self, req: Request, before: int) -> None:
        """Give the tree a snapshot (a copy of the window, and the pages) at each point every
        ``every`` tokens that ``req``'s step from ``before`` passed, so a request
        sharing its prefix resumes there: the prefill of a long shared prompt, while this one
        still runs. A snapshot whose window page cannot be had is skipped."""
        mem = self.memory
        cache, pt, every = mem.cache, mem.page_tokens, self.every
        assert req.window is not None
        for end in range(before // every * every + every, req.num_computed + 1, every):
            page = self.take_one()
            if page is None:
                return
            mem.runner.snapshot_window(req.window, end, page)
            key = u32(req.tokens[:end])
            ins = cache.insert(key, u32(req.block_table[: end // pt]), page)
            if ins.woken:
                mem.metrics.woken.inc(ins.woken)
            m = cache.match(key)  # locks the path, now all resident, its snapshot at end
            assert m.node is not None and m.resident_len == end and m.state_len == end
            req.block_table[: end // pt] = ids(m.pages)
            if req.node is not None:
                cache.unlock(req.node)
            req.node = m.node
