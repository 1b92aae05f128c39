"""Window pages (a page kind with them, ``kern.models.window``; DeepSeek-V4's and gpt-oss's):
the part of the cache's books (``kern.engine.memory``) that takes them as a request's rows reach
them, gives them back once those rows settle, and makes the snapshots a hit resumes from.

Design notes
------------
* A running request holds only the window pages its next rows can read, taken as its chunks
  reach them (:meth:`WindowPages.grow`: a prefill chunk is cut to the pages that can be had)
  and given back once its rows settle (:meth:`WindowPages.trim`, after a verify: a rejected
  draft never loses a window entry it needs), except that it keeps :data:`RESERVE`, held or
  spare, from its admission on: a decode step never needs more, so a running request is
  never stopped by the snapshots its own locked path pins (the path of its hit and of the
  snapshots its prefill shared). Admission takes them, or fails as for pages; the pool keeps
  enough slots for a lone request and its hit's snapshot
  (``kern.engine.load.WINDOW_SLOTS``).
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

__all__ = ["RESERVE", "WindowPages"]

# Window pages a running request keeps, held or spare: the two a query's window spans.
RESERVE = 2


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

    def admit(self, hit: int) -> tuple[list[int], list[int]] | None:
        """The window pages of a request starting at ``hit``: its table (the pages the
        snapshot is copied into, at the indices its next token reads) and its spares, RESERVE
        in all; None when they cannot be had."""
        w = self.window
        lo = max(0, hit - w + 1) // w
        restore = (hit - 1) // w + 1 - lo if hit else 0
        got = self.take(max(RESERVE, restore))
        if got is None:
            return None
        return [-1] * lo + got[:restore] if hit else [], got[restore:]

    def grow(self, req: Request, k: int) -> int:
        """Window pages for ``req``'s next ``k`` rows, as many as can be had in order: the
        number of rows they cover (0: not even the next one's)."""
        w, nc, window = self.window, req.num_computed, req.window
        assert window is not None
        for j in range(nc // w, (nc + k - 1) // w + 1):
            if j < len(window) and window[j] >= 0:
                continue
            page = req.window_spare.pop() if req.window_spare else self.take_one()
            if page is None:
                return max(0, j * w - nc)
            window.extend([-1] * (j + 1 - len(window)))
            window[j] = page
        return k

    def trim(self, req: Request) -> None:
        """Give back the window pages before ``req``'s next row's window (its rows settled),
        keeping RESERVE, held or spare."""
        window = req.window
        if not window:
            return
        j = max(0, req.num_computed - self.window + 1) // self.window - 1
        held = sum(p >= 0 for p in window[j + 1 :])
        while j >= 0 and window[j] >= 0:
            if held + len(req.window_spare) < RESERVE:
                req.window_spare.append(window[j])
            else:
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
        self.free(req.window_spare)
        req.window = None
        req.window_spare = []
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
            if not mem.wake_path(key):
                cache.free_slot(page)
                return
            ins = cache.insert(key, u32(req.block_table[: end // pt]), page)
            if ins.woken:
                mem.metrics.woken.inc(ins.woken)
            m = cache.match(key)  # locks the path, now all resident, its snapshot at end
            assert m.node is not None and m.resident_len == end and m.state_len == end
            req.block_table[: end // pt] = ids(m.pages)
            if req.node is not None:
                cache.unlock(req.node)
            req.node = m.node
