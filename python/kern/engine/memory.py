"""The scheduler's one door to the cache's books (``kern.pool``): make room, land, take pages
and slots, wake, release, share prefill, prompt snapshots, and the draft pages speculation
holds. Every other engine module sees the pool through these verbs and plain ids.

Design notes
------------
* Admission takes a prefix hit from ``Cache.match``, capped one token short of the prompt
  (recompute the last token for logits), its node locked while the request runs; a parked
  hit is woken and its plan landed first; a hit ending mid-page has its shared page copied
  before anything is written past it. Which hits are exact is the page kind's rule
  (``kern.models.pages.Pages.exact_hit``). A model that resumes only at snapshots (a
  recurrent state, qwen3_5; a window, DeepSeek-V4) matches all but the prompt's last token,
  uses a hit only where a snapshot sits, and copies the snapshot into its own slot (or the
  window pages its next token reads).
* A hit is worth taking only if it fits: one ending mid-page keeps its locked page *and*
  needs a copy of it, one page more than the same prompt without the hit, so when the pages
  cannot be had with the hit, admission retries without it (:meth:`Memory.admit`). Not when
  the hit's path holds no more device pages than the hit itself (stateless): unlocking it
  cannot make the retry fit, which then only parked again what the hit's wake had just
  brought back, at every step the request waited (tests/test_abort_wake.py's woken-no-room
  case, run to the end: 280 pages woken and 290 parked in 41 steps before, 12 and 22 now).
* Plans pass through: whatever ``make_room`` parks is handed to ``Runner.park`` in one list
  before anything is allocated again (:meth:`Memory.land`, the one door), a wake's plan to
  ``Runner.wake`` before the pages are read. Counters come from the returned values alone
  (``Evicted``, ``Woken.keys``).
* Two verbs where one flag was: :meth:`Memory.take_pages` and :meth:`Memory.take_slot` serve
  the target and, when the tree has nothing left to give, take every running request's draft
  pages and slots first (:meth:`Memory.drop_drafts`), so draft memory can never deadlock the
  target's; :meth:`Memory.take_draft_pages` and :meth:`Memory.take_draft_slot` serve a draft
  and never do. Draft pages are private to their request and never given to the tree.
* Sharing with the tree while a request runs (prefill pages, prompt-end snapshots):
  :class:`kern.engine.sharing.Sharing`, which memory is.
* Window pages (DeepSeek-V4's, gpt-oss's sliding layers'):
  :class:`kern.engine.window_pages.WindowPages`, which memory holds as ``windows``; such a
  model resumes only at a snapshot, as a stateful one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kern.arith import cdiv
from kern.engine.mover import HitRule, Mover
from kern.engine.request import Request
from kern.engine.sharing import Sharing
from kern.engine.window_pages import WindowPages
from kern.metrics import Metrics
from kern.pool import Cache, Evicted, Match, PoolFull, Room, Stats, ids, u32

__all__ = ["HitRule", "Memory", "Mover"]


class Memory(Sharing):
    """The cache's books for one scheduler, with ``runner`` landing their plans and
    ``metrics`` counting what they return. ``running`` is the scheduler's own list of running
    requests (read, never changed here): the requests whose drafts a target page may take."""

    def __init__(
        self,
        cache: Cache,
        runner: Mover,
        metrics: Metrics,
        running: list[Request],
        snapshot_pages: int = 1,
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.metrics = metrics
        self.running = running
        self.page_tokens = cache.page_tokens
        self.stateful = runner.stateful
        # Window pages (kern.engine.window_pages); a mover that predates them has none.
        self.window: int = getattr(runner, "window_tokens", 0)
        # Resumes only where a snapshot sits: a recurrent state, or a window.
        self.snapshots = self.stateful or bool(self.window)
        self.hits = runner.pages
        self.windows = WindowPages(self, snapshot_pages) if self.window else None
        # Every page the pool can give to requests (a stateful pool keeps its first slots).
        self.max_pages = cache.pages_free
        host = cache.host
        # The arenas' sizes: the runner allocates exactly what the pool's geometry says.
        self.arena_bytes = (cache.device.arena_bytes, 0 if host is None else host.arena_bytes)

    # --- reads ----------------------------------------------------------------------------

    def stats(self) -> Stats:
        return self.cache.stats()

    @property
    def pages_free(self) -> int:
        return self.cache.pages_free

    def match(self, tokens: Sequence[int]) -> Match:
        """The longest cached prefix of ``tokens``, **locked** when it hit (see
        ``kern.pool``): :meth:`unlock` its node once done."""
        return self.cache.match(u32(tokens))

    def unlock(self, node: int) -> None:
        self.cache.unlock(node)

    @staticmethod
    def pages(m: Match) -> list[int]:
        """A match's pages as ids (valid while its lock is held)."""
        return ids(m.pages)

    # --- admission ------------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        """Start ``req`` (admission) with its longest usable hit, else with none: its pages
        (and slot), its hit locked and its shared pages copied where it writes. False if it
        cannot have its pages (and slot) now, leaving nothing allocated or locked."""
        cap = len(req.tokens) - 1  # recompute the last token for logits
        m = self.match(self._lookup(req))  # locked when it hit
        hit = self._usable_hit(m, cap)
        if hit > 0:
            started = self._admit_with_hit(req, m, hit)
            if started is not None:
                return started
        elif m.node is not None:
            self.unlock(m.node)
        return self._start_at(req, None, None, 0)

    def _admit_with_hit(self, req: Request, m: Match, hit: int) -> bool | None:
        """Start ``req`` on its hit: True when started, None when a start without the hit
        may still fit, False when it cannot either."""
        node = m.node  # locked by the caller's match; unlocked here unless admitted
        assert node is not None
        cap = len(req.tokens) - 1
        if m.resident_len < hit or (self.snapshots and m.state_slot is None):
            if self.wake(node):
                m = self.match(self._lookup(req))  # the woken pages, under their own lock
                self.unlock(node)
                node = m.node
                assert node is not None
                hit = self._usable_hit(m, cap)
            else:
                # Without the parked part, a stateless hit keeps its resident prefix; a
                # stateful one has no state to resume from.
                hit = 0 if self.snapshots else self._exact(m, min(hit, m.resident_len))
        if hit > 0 and self._start_at(req, m, node, hit):
            return True
        self.unlock(node)
        pt = self.page_tokens
        if hit > 0 and not self.snapshots and cdiv(m.resident_len, pt) <= hit // pt:
            # Unlocking gives the start without the hit at most the path's device pages, no
            # more than the hit's own: it cannot fit either. Trying would only park again what
            # a wake just brought back, at every step this request waits.
            return False
        return None

    def _start_at(self, req: Request, m: Match | None, node: int | None, hit: int) -> bool:
        """Allocate what ``req`` needs past a ``hit``-token prefix (``m``'s, locked on
        ``node`` by the caller) and start it there. False, with nothing allocated, if the
        pages (or the slot) cannot be had."""
        pt = self.page_tokens
        shared = self.pages(m)[: hit // pt] if m is not None and hit else []
        need = cdiv(len(req.tokens), pt) - len(shared)
        slot = None
        if self.stateful:
            slot = self.take_slot()
            if slot is None:
                return False
        window: list[int] = []
        spare: list[int] = []
        if self.windows is not None:
            # The window pages the hit's next token reads (each a copy of the snapshot), and
            # spares up to the few a running request keeps.
            pages = self.windows.admit(hit)
            if pages is None:
                if slot is not None:
                    self.free_slot(slot)
                return False
            window, spare = pages
        own = self.take_pages(need)
        if own is None:
            if slot is not None:
                self.free_slot(slot)
            if self.windows is not None:
                self.windows.free(window + spare)
            return False
        if m is not None and hit % pt:
            # The hit's last page is shared with the tree: copy it before writing past the hit.
            self.runner.copy_pages([self.pages(m)[hit // pt]], [own[0]])
        if slot is not None and m is not None and hit:
            assert m.state_slot is not None
            self.runner.copy_slots([m.state_slot], [slot])
        if window:
            assert m is not None and m.state_slot is not None
            self.runner.restore_window(m.state_slot, [p for p in window if p >= 0])
        req.window = window if self.window else None
        req.window_spare = spare
        req.block_table = shared + own
        req.node = node
        req.slot = slot
        req.num_computed = hit
        if req.cached_tokens is None:
            # The first admission (a preempted request resumes without counting again).
            req.cached_tokens = hit
            req.t_admit = time.perf_counter()
            metrics = self.metrics
            metrics.queue_time.observe(req.t_admit - req.t_submit)
            if req.counts_prompt:
                # A prompt of n choices is looked up once, as it is counted once.
                metrics.prefix_queries.inc(len(req.prompt_ids))
                if hit:
                    metrics.prefix_hits.inc(hit)
                metrics.prompt_tokens.inc(len(req.prompt_ids))
        return True

    def _lookup(self, req: Request) -> Sequence[int]:
        """The key admission matches: the page kind's (the request's tokens), all but the
        last token where a hit resumes only at a snapshot."""
        key = self.hits.hit_key(req.tokens)
        if self.snapshots:
            # A snapshot resumes at most one token short of the prompt (the last is recomputed
            # for its logits): one at the full length would be the deepest the match returns,
            # and unusable, hiding the ones before it.
            key = key[: len(req.tokens) - 1]
        return key

    def _exact(self, m: Match, hit: int) -> int:
        """The longest part of ``hit`` a sequence may resume at, by the page kind's rule."""
        return self.hits.exact_hit(m, hit)

    def _usable_hit(self, m: Match, cap: int) -> int:
        if not self.snapshots:
            return self._exact(m, min(m.hit_len, cap))
        # A recurrent state or a window is resumed only from a snapshot taken at exactly the
        # hit length.
        if m.state_len is None or m.state_len > cap:
            return 0
        return m.state_len

    # --- make room and take -----------------------------------------------------------------

    def make_room(self, pages: int, slots: int = 0) -> bool:
        """Evict until ``pages`` pages and ``slots`` slots can be allocated together (as far
        as the tree can go) and land what was parked, before anything is allocated again.
        True when they can."""
        return self.land(self.cache.make_room(pages, slots=slots))

    def land(self, room: Room) -> bool:
        """Count what ``room``'s eviction loop took and land what it parked, before any page
        it freed is written. True when the room asked for is there."""
        m = self.metrics
        plans = []
        for ev in room.evicted:
            match ev:
                case Evicted.Parked(_, plan, dropped):
                    m.parked.inc()
                    if dropped:
                        m.dropped_parked.inc(len(dropped))
                    plans.append(plan)
                case Evicted.Dropped(_, parked):
                    if parked:
                        m.dropped_parked.inc()
                    else:
                        m.dropped_resident.inc()
        self.runner.park(plans)
        return room.fits

    def take_pages(self, n: int) -> list[int] | None:
        """``n`` pages for the target, making room and, when the tree has nothing left to
        give, taking the running requests' draft pages; None when they cannot be had."""
        if n <= 0:
            return []
        pages, room = self.cache.take_pages(n)  # make room and allocate, in one call
        self.land(room)
        if pages is None and self.drop_drafts():
            pages, room = self.cache.take_pages(n)
            self.land(room)
        return None if pages is None else ids(pages)

    def take_draft_pages(self, n: int) -> list[int] | None:
        """``n`` pages for a draft, making room but never taking other drafts' pages."""
        if n <= 0:
            return []
        pages, room = self.cache.take_pages(n)
        self.land(room)
        return None if pages is None else ids(pages)

    def take_slot(self) -> int | None:
        """A state slot for the target, making room (and, as :meth:`take_pages`, taking
        draft memory); None when none can be had."""
        if not self.make_room(0, slots=1) and not (
            self.drop_drafts() and self.make_room(0, slots=1)
        ):
            return None
        return self.cache.alloc_slot()

    def take_draft_slot(self) -> int | None:
        """A state slot for a draft, making room; never taking draft memory."""
        if not self.make_room(0, slots=1):
            return None
        return self.cache.alloc_slot()

    def free_slot(self, slot: int) -> None:
        self.cache.free_slot(slot)

    def wake(self, node: int) -> bool:
        """Bring the parked part of ``node``'s path back (locked by the caller). False when
        the room cannot be had.

        A wake brings every parked entry on the path back whole, however little of it the
        hit reads (a repeated prompt's parked leaf holds its answer too), and a match does not
        say how many pages that is: so evict one entry at a time, in the make-room loop's own
        order, until the wake fits. Sizing the room by the hit instead evicted nothing, the
        wake was refused and the parked prefix recomputed."""
        slots = 1 if self.stateful else 0
        while True:
            try:
                woken = self.cache.wake(node)
                break
            except PoolFull:
                # pages_free counts free chunks too: one page more than that cannot fit
                # without an eviction, so each round evicts an entry or ends.
                room = self.cache.make_room(self.cache.pages_free + 1, slots=slots)
                self.land(room)
                if not room.evicted:
                    return False
        if woken.keys:
            self.metrics.woken.inc(len(woken.keys))
        self.runner.wake(woken.plan)
        return True

    # --- give back --------------------------------------------------------------------------

    def release(self, req: Request, *, snapshot: bool) -> None:
        """Give the request's computed tokens and pages to the tree, unlock, free the rest
        (its draft memory too)."""
        n = req.num_computed
        num_pages = cdiv(n, self.page_tokens)
        keep, extra = req.block_table[:num_pages], req.block_table[num_pages:]
        node, req.node = req.node, None
        slot = req.slot
        if self.windows is not None and req.window is not None:
            slot = self.windows.release(req, snapshot)
        state = slot if (n > 0 and snapshot and slot is not None) else None
        # One call: the tree takes what it lacks and frees the rest (the request's duplicate
        # pages, and the slot when it already holds a snapshot at this length), the match's
        # lock is released and the pages past the computed tokens are freed. (With nothing
        # computed, `keep` is empty and the insert of an empty key changes nothing.)
        ins = self.cache.release(
            u32(req.tokens[:n]), u32(keep), state=state, node=node, free=u32(extra)
        )
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        if state is not None:
            slot = None
        if slot is not None:
            self.cache.free_slot(slot)
        self.free_draft(req)
        req.slot = None
        req.block_table = []
        req.num_computed = 0

    def drop_drafts(self) -> bool:
        """Free every running request's draft pages (their drafts start over from the whole
        context): target pages come first. True if any were held."""
        held = [r for r in self.running if r.draft is not None and r.draft.holds_memory()]
        for r in held:
            self.free_draft(r)
        return bool(held)

    def free_draft(self, req: Request) -> None:
        """Give back ``req``'s draft pages and slots (never cached: private to it)."""
        d = req.draft
        if d is None:
            return
        if d.table:
            self.cache.free_pages(u32(d.table))
        for slot in (d.slot, d.saved):
            if slot is not None:
                self.cache.free_slot(slot)
        d.table = []
        d.computed = 0
        d.slot = d.saved = None
