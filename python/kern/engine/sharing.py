"""Sharing with the prefix tree while a request runs: the part of the cache's books
(``kern.engine.memory.Memory``, which is a :class:`Sharing`) that gives the tree a running
request's prefill pages and its prompt-end snapshot.

Design notes
------------
* Prefill pages are shared at once (stateless models): the full pages a prefill chunk
  computed go into the tree right after the step, the request locking their node, so a
  request that arrives while another with the same system prompt runs hits it.
* Prompt-end snapshots (stateful models): a recurrent model resumes only where a state
  snapshot sits, and the request-end one lies after the answer, so a repeated prompt would
  hit nothing. The prefill is cut to stop one token short of the prompt's end (the token a
  hit recomputes for its logits); right after that step the state is copied into a slot of
  its own and given to the tree with the prompt's pages (the partial last page as a copy,
  the request keeps writing its own), so the same prompt again resumes there. If no slot or
  page can be had the snapshot is skipped: it is a cache, never a reason to wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kern.engine.request import Request
from kern.pool import ids, u32

if TYPE_CHECKING:
    from kern.engine.mover import HitRule, Mover
    from kern.engine.window_pages import WindowPages
    from kern.metrics import Metrics
    from kern.pool import Cache

__all__ = ["Sharing"]


class Sharing:
    """The sharing verbs of ``kern.engine.memory.Memory`` (see the notes)."""

    cache: Cache
    runner: Mover
    metrics: Metrics
    page_tokens: int
    stateful: bool
    snapshots: bool
    hits: HitRule
    windows: WindowPages | None

    def take_pages(self, n: int) -> list[int] | None:
        raise NotImplementedError

    def take_slot(self) -> int | None:
        raise NotImplementedError

    def wake(self, node: int) -> bool:
        raise NotImplementedError

    def wake_path(self, key: object) -> bool:
        """Bring back the parked part of the tree's path along ``key`` (a request's own
        tokens), so that an insert of ``key`` leaves it all resident: an insert through a
        parked entry holding a state snapshot it is not given again leaves that entry parked
        and frees the caller's pages for its tokens, which a running request still reads.
        False when the room cannot be had."""
        m = self.cache.match(key)
        if m.node is None:
            return True
        try:
            return m.resident_len == m.hit_len or self.wake(m.node)
        finally:
            self.cache.unlock(m.node)

    def share_prefill(self, req: Request) -> None:
        """Give the full pages a prefill chunk just computed to the tree at once, so requests
        arriving while this one runs hit them (a shared system prompt), not only after it
        ends. The insert frees the request's copies of pages the tree already held, so the
        request then reads the tree's pages, under a lock on their node. (A stateful model
        shares only at exact state snapshots.)"""
        cache, pt = self.cache, self.page_tokens
        n = req.num_computed // pt * pt
        if n == 0:
            return
        key = u32(req.tokens[:n])
        ins = cache.insert(key, u32(req.block_table[: n // pt]), None)
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        m = cache.match(key)  # locks the path, now all resident
        assert m.node is not None and m.resident_len == n
        req.block_table[: n // pt] = ids(m.pages)
        if req.node is not None:
            cache.unlock(req.node)
        req.node = m.node

    def prompt_snapshot_at(self, req: Request) -> int | None:
        """Where ``req``'s prompt-end snapshot goes (see the design notes), if it still needs
        one: one token short of the prompt, past its hit, before its first output."""
        if not (self.snapshots or self.hits.prompt_snapshots) or req.prompt_snapshot_done:
            return None
        if req.num_output:
            return None
        at = len(req.prompt_ids) - 1
        if at <= 0 or at <= (req.cached_tokens or 0):
            req.prompt_snapshot_done = True  # a repeat resumed there: the tree has it
            return None
        return at

    def prompt_snapshot(self, req: Request) -> None:
        """Give the tree the state ``req`` has now (its prompt but the last token computed)
        with the pages that hold those tokens; the request then reads the tree's full pages
        under a lock, and keeps its own partial last page."""
        req.prompt_snapshot_done = True
        cache, pt, n = self.cache, self.page_tokens, req.num_computed
        full = n // pt
        # Pages that carry a state (Pages.prompt_snapshots): the page copy is the snapshot.
        slot = self.take_slot() if self.stateful else None
        if self.windows is not None:
            slot = self.windows.take_one()
        if self.snapshots and slot is None:
            return
        pages = req.block_table[:full]
        if n % pt:
            copy = self.take_pages(1)
            if copy is None:
                if slot is not None:
                    cache.free_slot(slot)
                return
            self.runner.copy_pages([req.block_table[full]], copy)
            pages = pages + copy
        if slot is not None and self.window:
            assert req.window is not None
            self.runner.snapshot_window(req.window, n, slot)
        elif slot is not None:
            assert req.slot is not None
            self.runner.copy_slots([req.slot], [slot])
        key = u32(req.tokens[:n])
        if self.snapshots and not self.wake_path(key):
            if slot is not None:
                cache.free_slot(slot)
            if n % pt:
                cache.free_pages(u32(pages[-1:]))
            return
        ins = cache.insert(key, u32(pages), slot)
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        m = cache.match(key)  # locks the path, now all resident, its snapshot at n
        assert m.node is not None and m.resident_len == n
        assert slot is None or m.state_len == n
        req.block_table[:full] = ids(m.pages)[:full]
        if req.node is not None:
            cache.unlock(req.node)
        req.node = m.node
