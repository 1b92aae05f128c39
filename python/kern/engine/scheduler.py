"""The scheduler: one thread that runs every request through the runner, one step at a time.
It handles ints and handles only: the runner owns every tensor and lands every plan.

Design notes
------------
* Continuous batching: each step is one ``Runner.forward`` over every running request, decode
  rows first (one token each), then prefill chunks under a per-step token budget
  (``max_step_tokens``). A request joins or leaves between any two steps.
* One code path for prefill, decode and resume. A request is its tokens (prompt, then what it
  produced) and ``num_computed``, how many of them are in its KV. Each step computes the next
  chunk of ``tokens[num_computed:]``; a chunk that reaches the end asks for logits and yields a
  token. Decoding is a chunk of one. The same shapes ``kern.engine.generate`` runs, so a greedy
  answer is the same bits as ``kern run`` on the CPU backend (batch- and chunk-invariant, see
  docs/invariance.md).
* Admission is first come, first served: the head of the queue is admitted once the pages for
  its whole prompt can be had (making room from the cache if need be), so a prefill never
  preempts anyone. A prefix hit is taken from ``Cache.match``, capped one token short of the
  prompt (recompute the last token for logits), its node locked while the request runs; a
  parked hit is woken and its plan landed first; a hit ending mid-page has its shared page
  copied before anything is written past it. On a stateful model (qwen3_5) a hit is usable only
  where a state snapshot sits, and the snapshot is copied into the request's own slot.
* Admission always progresses. A hit is worth taking only if it fits: one ending mid-page
  keeps its locked page *and* needs a copy of it, one page more than the same prompt without
  the hit, so when the pages cannot be had with the hit, admission retries without it. With
  nothing running nothing is locked, so a request that passed :meth:`Scheduler.check` always
  fits then; the head waits only while others run, and they finish in bounded steps. The
  loop sleeps on its condition variable when there is nothing to run; it never spins.
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
* Speculative rows (``rows`` > 1, docs/serve.md): a decode step of a request verifies its
  last token and up to ``rows - 1`` n-gram drafts (kern.engine.ngram) as one chunk with a row of
  logits each. Row j is sampled as plain decoding samples that position (its context with
  the drafts before it, draw index ``num_output + j``), drafts are kept while they equal
  those tokens, and the first mismatch is replaced by the row's token: the answer is the
  rows-1 answer. Tokens are sent one by one up to a stop or ``max_tokens``; ``num_computed``
  then moves by the tokens sent and a recurrent state is rewound to the row of the last one
  (``Runner.keep_rows``), so nothing rejected or unsent is ever read, and the request-end
  snapshot sits where rows 1 puts it. Drafts use only the step budget the decode rows leave,
  never past ``max_tokens``, and a request with a grammar decodes one row at a time.
* Draft checkpoints (``draft``, kern.engine.draft): after the step is planned, the draft model runs
  for the requests that draft: one forward of catch-up chunks (every token its KV lacks: the
  prompt at the first decode step, then what the last verify accepted, counted in the step
  budget with the drafts), then ``rows - 2`` one-row steps, batched, greedy. Its pages are
  pool pages (``draft_table``), taken with the same make-room calls but never by preempting:
  a request that cannot have them decodes one row that step. A target allocation that fails
  drops every running request's draft pages before it preempts anyone (``_drop_drafts``),
  so draft memory can never deadlock the target's. The pages (and a stateful draft's two
  slots, kern.engine.draft) are freed in ``_release`` (end, abort, preemption) and never inserted
  into the tree. After a verify, ``draft_computed`` keeps the accepted drafts the draft
  itself computed (all but its last); a stateful draft past a rejected one is restored to
  its saved state instead.
* Preemption: a decode that needs a page when nothing is evictable preempts the youngest
  running request. Its computed tokens and pages go into the prefix tree (with its state, on a
  stateful model), it unlocks, and it goes back to the head of the queue. The tree's make-room
  loop then parks those pages to the host tier, or drops them when the host is full; on
  resume, the request matches its own tokens, waking them (no recompute) or recomputing what
  was dropped. The oldest request always fits alone (requests that cannot are refused at
  submit), so this never deadlocks, and no answer is ever cut short.
* Plans pass through: whatever ``make_room`` parks is handed to ``Runner.park`` in one list
  before anything is allocated again, a wake's plan to ``Runner.wake`` before the pages are
  read. Counters come from the returned values alone (``Evicted``, ``Woken.keys``).
* The thread talks to the app through two things only: ``submit``/``abort`` (locked inbox,
  a condition variable to wake the thread) and ``deliver``, called once per step with every
  event of that step, so crossing to the event loop costs one call per step, not per token.
  :meth:`Scheduler.step` runs one step on the calling thread (the tests drive it that way).
* If the loop raises, every open request is finished with ``abort`` and ``on_crash`` runs (the
  server prints the error and exits with code 101).
* Metrics are recorded here, on this thread, as things happen (kern.metrics): cheap calls on
  pre-labelled ``prometheus_client`` children, and one gauge snapshot per step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kern.batch import SeqChunk
from kern.engine.draft import argmax
from kern.engine.ngram import NgramDrafter
from kern.engine.runner import Runner
from kern.engine.sampler import Context, LogprobEntry, SamplingParams, TokenLog, logprobs, sample
from kern.metrics import Metrics
from kern.pool import Cache, Evicted, Match, PoolFull, Room

__all__ = ["Event", "LimitError", "Request", "Scheduler", "start_scheduler"]

log = logging.getLogger("kern")

# An event for one request: (token id or None, logprob entry or None, finish reason or None).
Event = tuple[int | None, LogprobEntry | None, str | None]


class LimitError(ValueError):
    """A request that can never fit: its message names the limit (the app answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate. The app builds it; after ``submit`` only the scheduler
    thread mutates it, except ``aborted`` and ``end_reason`` (set by ``Scheduler.abort``)."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    num_logprobs: int | None = None
    # End of sequence and stop ids are banned until this many tokens are out.
    min_tokens: int = 0
    # Structured output: a matcher the sampler masks with and this thread feeds each token
    # (kern.engine.structured.Matcher; opaque here).
    grammar: Any = None
    # Its tokens as a tensor for the penalties (kern.engine.sampler.TokenLog), made when first
    # needed.
    token_log: TokenLog | None = None
    # False for the 2nd..nth sequence of a request of n choices: its prompt counts once.
    counts_prompt: bool = True
    # Opaque to the scheduler: where the app routes this request's events.
    sink: Any = None
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_output: int = 0
    block_table: list[int] = field(default_factory=list)
    node: int | None = None
    slot: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    aborted: bool = False
    # The finish reason an abort ends it with: "stop" when the app matched a stop string.
    end_reason: str = "abort"
    order: int = 0
    # The prompt-end snapshot (stateful models) is taken or not needed.
    prompt_snapshot_done: bool = False
    # Speculative rows: the request's n-gram index over its tokens (built at its first
    # verify step), and the drafts this step verifies.
    drafter: NgramDrafter | None = None
    drafts: list[int] = field(default_factory=list)
    # A draft checkpoint's KV for this request (pool pages of the draft's page size) and how
    # many of its tokens are in it.
    draft_table: list[int] = field(default_factory=list)
    draft_computed: int = 0
    # A stateful draft's slots: its working state, and the state at the last accepted token
    # kept while it drafts past it (kern.engine.draft).
    draft_slot: int | None = None
    draft_saved: int | None = None
    # perf_counter() seconds: submitted, first admitted, first and latest token (0: not yet).
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0


class Scheduler:
    """Owns the runner and the cache. :meth:`run` loops on the calling thread (see
    :func:`start_scheduler`); :meth:`step` runs one step."""

    def __init__(
        self,
        runner: Runner,
        cache: Cache,
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        deliver: Callable[[list[tuple[Request, Event]]], None],
        metrics: Metrics | None = None,
        max_step_tokens: int = 512,
        max_running: int = 256,
        rows: int = 1,
        on_crash: Callable[[BaseException], None] | None = None,
        draft: Runner | None = None,
    ) -> None:
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError("max_step_tokens and max_running must be >= 1")
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.runner = runner
        self.cache = cache
        self.pt = cache.page_tokens
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.deliver = deliver
        self.metrics = metrics or Metrics()
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        # Positions a decode step verifies per sequence: 1 + up to rows - 1 n-gram drafts.
        self.rows = rows
        # A draft checkpoint's runner over the same pool pages (kern.engine.draft), or None: n-gram.
        self.draft = draft
        self.on_crash = on_crash
        self.stateful = runner.stateful
        # Every page the pool can give to requests (a stateful pool keeps its first slots).
        self.max_pages = cache.pages_free
        host = cache.host
        # The arenas' sizes: the runner allocates exactly what the pool's geometry says.
        self._arena_bytes = (cache.device.arena_bytes, 0 if host is None else host.arena_bytes)
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._poked = False  # a submit or an abort since the loop last looked
        self._stop = False
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._order = 0
        self.failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._gauges()

    # --- the app's side (any thread) ------------------------------------------------------

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` (or a crash); the thread
        that built the scheduler, see :func:`start_scheduler`."""
        self._thread = threading.current_thread()
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._poked or self._running or self._waiting):
                        self._cv.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # noqa: BLE001 - a PanicException too: nothing may hang
            self._crash(e)

    def stop(self) -> None:
        """Ask the loop to end after its step; waits for it unless called from it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise :class:`LimitError` when a request of this size can never be served."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise LimitError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} is over "
                f"the model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
        pool_tokens = self.max_pages * self.pt
        if total > pool_tokens:
            raise LimitError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} is over "
                f"the KV pool of {pool_tokens} tokens ({self.max_pages} pages)",
                "max_tokens",
            )

    def max_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a prompt of this length may ask for (the default when unset)."""
        return max(1, min(self.max_model_len, self.max_pages * self.pt) - prompt_len)

    def submit(self, req: Request) -> None:
        """Queue ``req`` (checked with :meth:`check` first). Its events go to ``deliver``."""
        req.tokens = list(req.prompt_ids)
        req.t_submit = time.perf_counter()
        with self._cv:
            if self.failed is not None:
                raise RuntimeError("the scheduler has stopped")
            self._inbox.append(req)
            self._poked = True
            self._cv.notify()

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Ask for ``req`` to end at the next step (a no-op once finished), counted with
        ``reason``: ``abort``, or ``stop`` when the app ends it at a stop string."""
        req.end_reason = reason
        req.aborted = True
        with self._cv:
            self._poked = True
            self._cv.notify()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    # --- one step -------------------------------------------------------------------------

    def step(self) -> None:
        """One step on the calling thread: take what was submitted and aborted, admit what
        fits, run one forward over the running requests, deliver the step's events."""
        with self._cv:
            self._poked = False
            for req in self._inbox:
                req.order = self._order
                self._order += 1
                self._waiting.append(req)
            self._inbox.clear()
        events: list[tuple[Request, Event]] = []
        self._reap_aborted(events)
        self._admit(events)
        self._forward(events)
        if events:
            self.deliver(events)
        self._gauges()

    def _gauges(self) -> None:
        s = self.cache.stats()
        # Pages requests hold: neither free nor the tree's. 0 when nothing runs.
        held = s.pages_used - s.resident_pages
        device_arena, host_arena = self._arena_bytes
        # One dict replaced whole: a scrape reads one step's values (kern.metrics).
        self.metrics.gauges = {
            "kern_num_requests_running": len(self._running),
            "kern_num_requests_waiting": len(self._waiting),
            "kern_kv_cache_usage_perc": held / self.max_pages,
            "kern_pool_pages_total": self.max_pages,
            "kern_pool_pages_free": s.pages_free,
            "kern_pool_pages_cached": s.resident_pages,
            "kern_pool_pages_held": held,
            # The slot class's own slots (Stats.slots_free also counts free chunks it could
            # grow into, which pages may take as well): free + held + cached == total.
            "kern_pool_slots_total": s.slot_capacity,
            "kern_pool_slots_free": s.slot_capacity - s.slots_used,
            "kern_pool_slots_held": s.slots_used - s.resident_states,
            "kern_pool_slots_cached": s.resident_states,
            "kern_host_pages_free": s.host_pages_free,
            "kern_host_pages_parked": s.parked_pages,
            "kern_cache_nodes": s.num_nodes,
            "kern_device_arena_bytes": device_arena,
            "kern_host_arena_bytes": host_arena,
        }

    def _crash(self, e: BaseException) -> None:
        traceback.print_exception(e)
        with self._cv:
            self.failed = e
            open_reqs = [*self._running, *self._waiting, *self._inbox]
            self._inbox.clear()
        try:
            self.deliver([(r, (None, None, "abort")) for r in open_reqs])
        finally:
            if self.on_crash is not None:
                self.on_crash(e)

    def _reap_aborted(self, events: list[tuple[Request, Event]]) -> None:
        if any(r.aborted for r in self._waiting):
            for r in [r for r in self._waiting if r.aborted]:
                self._waiting.remove(r)
                self._finish(r, r.end_reason, events, snapshot=False)
        for r in [r for r in self._running if r.aborted]:
            self._running.remove(r)
            self._finish(r, r.end_reason, events, snapshot=False)

    def _finish(
        self,
        req: Request,
        reason: str,
        events: list[tuple[Request, Event]],
        *,
        snapshot: bool = True,
    ) -> None:
        """End ``req`` with ``reason``; ``snapshot=False`` for an abort, whose last state
        need not match what the client received."""
        req.finish_reason = reason
        self._release(req, snapshot=snapshot)
        if req.cached_tokens is None:
            req.cached_tokens = 0
        self.metrics.finished(req, reason, time.perf_counter())
        events.append((req, (None, None, reason)))

    # --- memory ---------------------------------------------------------------------------

    def _make_room(self, pages: int, slots: int = 0) -> bool:
        """Evict until ``pages`` pages and ``slots`` slots can be allocated together (as far
        as the tree can go) and land what was parked, before anything is allocated again.
        True when they can."""
        return self._land(self.cache.make_room(pages, slots=slots))

    def _land(self, room: Room) -> bool:
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

    def _alloc_pages(self, n: int, *, take_drafts: bool = True) -> list[int] | None:
        """``n`` pages, making room; for the target (``take_drafts``) also taking running
        requests' draft pages when the tree has nothing left to give, never for a draft."""
        if n <= 0:
            return []
        pages, room = self.cache.take_pages(n)  # make room and allocate, in one call
        self._land(room)
        if pages is None and take_drafts and self._drop_drafts():
            pages, room = self.cache.take_pages(n)
            self._land(room)
        return None if pages is None else _ids(pages)

    def _alloc_slot(self, *, take_drafts: bool = True) -> int | None:
        """A state slot, making room (and, as ``_alloc_pages``, taking draft memory)."""
        if not self._make_room(0, slots=1) and not (
            take_drafts and self._drop_drafts() and self._make_room(0, slots=1)
        ):
            return None
        return self.cache.alloc_slot()

    def _wake(self, node: int, num_pages: int) -> bool:
        """Bring the parked part of ``node``'s path back (locked by the caller); it spans
        about ``num_pages`` pages. False when the room cannot be had."""
        try:
            woken = self.cache.wake(node)
        except PoolFull:
            self._make_room(num_pages, slots=1 if self.stateful else 0)
            try:
                woken = self.cache.wake(node)
            except PoolFull:
                return False
        if woken.keys:
            self.metrics.woken.inc(len(woken.keys))
        self.runner.wake(woken.plan)
        return True

    def _release(self, req: Request, *, snapshot: bool) -> None:
        """Give the request's computed tokens and pages to the tree, unlock, free the rest."""
        cache = self.cache
        n = req.num_computed
        num_pages = -(-n // self.pt)
        keep, extra = req.block_table[:num_pages], req.block_table[num_pages:]
        node, req.node = req.node, None
        slot = req.slot
        state = slot if (n > 0 and snapshot and slot is not None) else None
        # One call: the tree takes what it lacks and frees the rest (the request's duplicate
        # pages, and the slot when it already holds a snapshot at this length), the match's
        # lock is released and the pages past the computed tokens are freed. (With nothing
        # computed, `keep` is empty and the insert of an empty key changes nothing.)
        ins = cache.release(_u32(req.tokens[:n]), _u32(keep), state, node, _u32(extra))
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        if state is not None:
            slot = None
        if slot is not None:
            cache.free_slot(slot)
        self._free_draft(req)
        req.slot = None
        req.block_table = []
        req.num_computed = 0

    def _share_prefill(self, req: Request) -> None:
        """Give the full pages a prefill chunk just computed to the tree at once, so requests
        arriving while this one runs hit them (a shared system prompt), not only after it
        ends. The insert frees the request's copies of pages the tree already held, so the
        request then reads the tree's pages, under a lock on their node. (A stateful model
        shares only at exact state snapshots.)"""
        cache = self.cache
        n = req.num_computed // self.pt * self.pt
        if n == 0:
            return
        key = _u32(req.tokens[:n])
        ins = cache.insert(key, _u32(req.block_table[: n // self.pt]), None)
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        m = cache.match(key)  # locks the path, now all resident
        assert m.node is not None and m.resident_len == n
        req.block_table[: n // self.pt] = _ids(m.pages)
        if req.node is not None:
            cache.unlock(req.node)
        req.node = m.node

    # --- admission ------------------------------------------------------------------------

    def _admit(self, events: list[tuple[Request, Event]]) -> None:
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting[0]
            if not self._try_admit(req):
                if not self._running:
                    # Nothing is locked now, so a request that passed check() fits; this is
                    # a broken invariant, and the request ends instead of blocking the queue.
                    log.error(
                        "could not admit a %d-token request with nothing running (%d pages "
                        "free); ending it",
                        len(req.tokens),
                        self.cache.pages_free,
                    )
                    self._waiting.popleft()
                    self._finish(req, "abort", events, snapshot=False)
                    continue
                return
            self._waiting.popleft()
            self._running.append(req)

    def _try_admit(self, req: Request) -> bool:
        """Admit ``req`` with its longest usable hit, else with none; False if it cannot
        have its pages (and slot) now. Leaves nothing allocated or locked when False."""
        key = _u32(req.tokens)
        cap = len(req.tokens) - 1  # recompute the last token for logits
        m = self.cache.match(key)  # locked when it hit
        hit = self._usable_hit(m, cap)
        if hit > 0:
            if self._admit_with_hit(req, key, m, hit):
                return True
        elif m.node is not None:
            self.cache.unlock(m.node)
        return self._admit_at(req, None, None, 0)

    def _admit_with_hit(self, req: Request, key: np.ndarray, m: Match, hit: int) -> bool:
        cache = self.cache
        node = m.node  # locked by the caller's match; unlocked here unless admitted
        assert node is not None
        cap = len(req.tokens) - 1
        if m.resident_len < hit or (self.stateful and m.state_slot is None):
            parked = -(-m.hit_len // self.pt) - m.resident_len // self.pt
            if self._wake(node, parked):
                m = cache.match(key)  # the woken pages, under a lock of their own
                cache.unlock(node)
                node = m.node
                assert node is not None
                hit = self._usable_hit(m, cap)
            else:
                # Without the parked part, a stateless hit keeps its resident prefix; a
                # stateful one has no state to resume from.
                hit = 0 if self.stateful else min(hit, m.resident_len)
        if hit > 0 and self._admit_at(req, m, node, hit):
            return True
        cache.unlock(node)
        return False

    def _admit_at(self, req: Request, m: Match | None, node: int | None, hit: int) -> bool:
        """Allocate what ``req`` needs past a ``hit``-token prefix (``m``'s, locked on
        ``node`` by the caller) and start it there. False, with nothing allocated, if the
        pages (or the slot) cannot be had."""
        pt = self.pt
        shared = _ids(m.pages)[: hit // pt] if m is not None and hit else []
        need = -(-len(req.tokens) // pt) - len(shared)
        slot = None
        if self.stateful:
            slot = self._alloc_slot()
            if slot is None:
                return False
        own = self._alloc_pages(need)
        if own is None:
            if slot is not None:
                self.cache.free_slot(slot)
            return False
        if m is not None and hit % pt:
            # The hit's last page is shared with the tree: copy it before writing past the hit.
            self.runner.copy_pages([_ids(m.pages)[hit // pt]], [own[0]])
        if slot is not None and m is not None and hit:
            assert m.state_slot is not None
            self.runner.copy_slots([m.state_slot], [slot])
        req.block_table = shared + own
        req.node = node
        req.slot = slot
        req.num_computed = hit
        if req.cached_tokens is None:
            # The first admission (a preempted request resumes without counting again).
            req.cached_tokens = hit
            req.t_admit = time.perf_counter()
            m = self.metrics
            m.queue_time.observe(req.t_admit - req.t_submit)
            m.prefix_queries.inc(len(req.prompt_ids))
            if hit:
                m.prefix_hits.inc(hit)
            if req.counts_prompt:
                m.prompt_tokens.inc(len(req.prompt_ids))
        return True

    def _usable_hit(self, m: Match, cap: int) -> int:
        if not self.stateful:
            return min(m.hit_len, cap)
        # A recurrent model resumes only from a state taken at exactly the hit length.
        if m.state_len is None or m.state_len > cap:
            return 0
        return m.state_len

    # --- the forward ----------------------------------------------------------------------

    def _forward(self, events: list[tuple[Request, Event]]) -> None:
        budget = self.max_step_tokens
        pt = self.pt
        plan: list[tuple[Request, int]] = []
        # Requests a draft checkpoint drafts for: (draft_computed, catch-up, drafts) planned.
        wants: dict[Request, tuple[int, int, int]] = {}
        # Drafts take only what the step's decode rows leave of the budget, so speculation
        # never keeps a younger request from its token.
        spare = budget - sum(len(r.tokens) - r.num_computed == 1 for r in self._running)
        # Decode rows first, oldest first: they are cheap and keep streams flowing.
        for req in sorted(self._running, key=_decode_first):
            if req not in self._running:
                continue  # preempted for an older request in this loop
            if budget <= 0:
                break
            left = len(req.tokens) - req.num_computed
            k = min(left, budget)
            room = min(spare, budget - 1)
            req.drafts = []
            if left == 1 and self.draft is None:
                req.drafts = self._draft(req, room)
            elif left == 1:
                want = self._plan_model_draft(req, room)
                if want is not None:
                    # Drafted after planning, in batched draft forwards (_run_drafts).
                    wants[req] = want
                    spare -= want[1] + want[2]
                    k += want[2]
            spare -= len(req.drafts)
            k += len(req.drafts)
            at = self._prompt_snapshot_at(req)
            if at is not None and req.num_computed < at < req.num_computed + k:
                k = at - req.num_computed
            if req.num_computed + k > len(req.block_table) * pt and not self._grow(req, k):
                req.drafts = []
                continue  # preempted itself: nothing younger to take from
            plan.append((req, k))
            budget -= k
        plan = [(r, k) for r, k in plan if r.block_table]
        if wants:
            wants = {r: w for r, w in wants.items() if r.block_table}
            self._run_drafts(wants)
            plan = [(r, 1 + len(r.drafts) if r in wants else k) for r, k in plan]
        if not plan:
            return
        batch = []
        for req, k in plan:
            nc = req.num_computed
            if req.drafts:
                # Verify: the last token, then the drafts; one row of logits each.
                chunk = [req.tokens[nc], *req.drafts]
                batch.append(SeqChunk(chunk, nc, req.block_table, slot=req.slot, logits="all"))
                continue
            done = nc + k == len(req.tokens)
            batch.append(
                SeqChunk(
                    req.tokens[nc : nc + k],
                    nc,
                    req.block_table,
                    slot=req.slot,
                    logits="last" if done else "none",
                )
            )
        logits = self.runner.forward(batch)
        # Requests that get logits: (request, its first logits row, its number of rows).
        rows: list[tuple[Request, int, int]] = []
        first = 0
        for req, k in plan:
            if req.drafts:
                rows.append((req, first, k))
                first += k
                continue  # num_computed moves once the drafts are judged
            if req.num_computed + k == len(req.tokens):
                rows.append((req, first, 1))
                first += 1
            req.num_computed += k
            if k > 1 and not self.stateful:
                self._share_prefill(req)
            if self.stateful and req.num_computed == self._prompt_snapshot_at(req):
                self._prompt_snapshot(req)
        if not rows:
            return
        params: list[SamplingParams] = []
        draw_ids: list[int] = []
        contexts: list[Context | None] = []
        for req, _, n in rows:
            for j in range(n):
                params.append(req.params)
                draw_ids.append(req.num_output + j)
                contexts.append(self._context(req, req.drafts[:j]))
        picked = sample(
            logits,
            params,
            draw_ids,
            contexts if any(c is not None for c in contexts) else None,
        )
        now = time.perf_counter()
        m = self.metrics
        for req, start, n in rows:
            verified = picked[start : start + n]
            # Greedy or sampled alike: row j yields the token plain decoding would produce
            # at that position (same context, same draw index), so a draft is accepted while
            # it equals that token; the first mismatch is replaced by it.
            accepted = 1
            while accepted < n and req.drafts[accepted - 1] == verified[accepted - 1]:
                accepted += 1
            if n > 1:
                m.spec_drafts.inc()
                m.spec_draft_tokens.inc(n - 1)
                m.spec_accepted_tokens.inc(accepted - 1)
            reason = None
            sent = 0
            for j, tok in enumerate(verified[:accepted]):
                lp = None
                if req.num_logprobs is not None:
                    lp = logprobs(logits, start + j, tok, req.num_logprobs)
                req.tokens.append(tok)
                req.num_output += 1
                sent += 1
                if req.grammar is not None and not req.grammar.accept(tok):
                    # The mask allowed only what the grammar accepts: a refusal is a bug.
                    log.error("the structured-output grammar refused token %d; ending", tok)
                    reason = "abort"
                elif tok in req.stop_ids or (tok in self.eos and not req.ignore_eos):
                    reason = "stop"
                elif req.num_output >= req.max_tokens:
                    reason = "length"
                events.append((req, (tok, lp, None)))
                if reason is not None:
                    break  # tokens accepted past a stop are never sent
            if reason is not None and sent < accepted:
                log.debug(
                    "%d accepted tokens after a %r finish not sent; state rewound to the last "
                    "token sent",
                    accepted - sent,
                    reason,
                )
            if n > 1:
                # The KV and state now hold the last token and the drafts that were sent; the
                # rest (rejected, or accepted past a stop) is never read: the next chunk
                # starts at num_computed and overwrites it, and the state is rewound to the
                # row of the last token sent, exactly where rows 1 would leave it.
                req.num_computed += sent
                if self.stateful:
                    assert req.slot is not None
                    self.runner.keep_rows(req.slot, sent)
                if req in wants:
                    # The draft computed its drafts but the last: keep those accepted. A
                    # stateful draft past a rejected one goes back to its saved state and
                    # sees the accepted tokens again in its next catch-up.
                    kept = min(accepted - 1, n - 2)
                    if req.draft_slot is not None and kept < n - 2:
                        assert self.draft is not None and req.draft_saved is not None
                        self.draft.copy_slots([req.draft_saved], [req.draft_slot])
                        kept = 0
                    req.draft_computed += kept
            req.drafts = []
            m.generation_tokens.inc(sent)
            if req.num_output == sent:
                req.t_first = now
                m.ttft.observe(now - req.t_submit)
                m.prefill_time.observe(now - req.t_admit)
            else:
                m.itl.observe(now - req.t_last)
            req.t_last = now
            if reason is not None:
                self._running.remove(req)
                self._finish(req, reason, events)

    def _draft(self, req: Request, room: int) -> list[int]:
        """The tokens ``req``'s next decode step verifies after its last one: up to
        ``rows - 1`` n-gram drafts, fewer near ``max_tokens`` (nothing past it is ever
        computed) or than ``room`` (what the step's budget leaves), none for a request whose
        logits processing depends on state the drafts would have to advance (a grammar's
        matcher), which decodes one row at a time."""
        k = min(self.rows - 1, req.max_tokens - req.num_output - 1, room)
        if k <= 0 or req.num_output == 0 or req.grammar is not None:
            return []
        if req.drafter is None:
            req.drafter = NgramDrafter(req.tokens)
        else:
            req.drafter.sync(req.tokens)
        return req.drafter.draft(k)

    def _plan_model_draft(self, req: Request, room: int) -> tuple[int, int, int] | None:
        """What the draft checkpoint does for ``req`` this step: (its ``draft_computed`` now,
        tokens of catch-up, drafts), or None. The catch-up (every token the draft has not
        seen: the prompt at its first decode step, then what the last verify accepted)
        counts against ``room`` with the drafts; a catch-up longer than the room is done in
        part, drafting nothing, as a prompt is chunked. The same limits as n-gram drafts."""
        num = min(self.rows - 1, req.max_tokens - req.num_output - 1)
        if num <= 0 or req.num_output == 0 or req.grammar is not None or room <= 0:
            return None
        catch = len(req.tokens) - req.draft_computed
        if catch + num <= room:
            return req.draft_computed, catch, num
        if catch < room:
            return req.draft_computed, catch, room - catch
        return req.draft_computed, room, 0

    def _run_drafts(self, wants: dict[Request, tuple[int, int, int]]) -> None:
        """Run the draft checkpoint for ``wants`` (see :meth:`_plan_model_draft`): take its
        pages from the pool (making room, never preempting: a request whose pages cannot be
        had, or whose draft KV was dropped since it was planned, decodes one row this step),
        one forward of catch-up chunks, then one 1-row step per further draft, batched across
        requests; set each request's ``drafts`` (greedy, see kern.engine.draft)."""
        draft = self.draft
        assert draft is not None
        dpt = draft.page_tokens
        go: list[tuple[Request, int, int]] = []
        for req, (computed, catch, num) in wants.items():
            if req.draft_computed != computed:
                continue  # dropped for a target page since planned
            end = computed + catch + max(num - 1, 0)  # positions the draft writes
            need = -(-end // dpt) - len(req.draft_table)
            if need > 0:
                pages = self._alloc_pages(need, take_drafts=False)
                if pages is None:
                    continue
                req.draft_table.extend(pages)
            if draft.stateful:
                if req.draft_slot is None:
                    req.draft_slot = self._alloc_slot(take_drafts=False)
                    if req.draft_slot is None:
                        continue
                if num > 1 and req.draft_saved is None:
                    req.draft_saved = self._alloc_slot(take_drafts=False)
                    if req.draft_saved is None:
                        num = 1  # one draft needs no rollback
            go.append((req, catch, num))
        if not go:
            return
        batch = [
            SeqChunk(
                req.tokens[req.draft_computed : req.draft_computed + catch],
                req.draft_computed,
                req.draft_table,
                slot=req.draft_slot,
                logits="last" if num else "none",
            )
            for req, catch, num in go
        ]
        picked = argmax(draft.forward(batch))
        drafting = []
        for req, catch, num in go:
            req.draft_computed += catch
            if num:
                req.drafts = [picked[len(drafting)]]
                drafting.append((req, num))
        if draft.stateful:
            # The state at the last accepted token, restored if a verify rejects a draft the
            # draft computed past it (see _forward).
            saved = [(r.draft_slot, r.draft_saved) for r, num in drafting if num > 1]
            draft.copy_slots([s for s, _ in saved], [d for _, d in saved])
        for j in range(1, max((num for _, num in drafting), default=0)):
            more = [r for r, num in drafting if num > j]
            batch = [
                SeqChunk([r.drafts[-1]], r.draft_computed + j - 1, r.draft_table, r.draft_slot)
                for r in more
            ]
            for r, tok in zip(more, argmax(draft.forward(batch)), strict=True):
                r.drafts.append(tok)

    def _drop_drafts(self) -> bool:
        """Free every running request's draft pages (their drafts start over from the whole
        context): target pages come first. True if any were held."""
        held = [r for r in self._running if r.draft_table or r.draft_slot is not None]
        for r in held:
            self._free_draft(r)
        return bool(held)

    def _free_draft(self, req: Request) -> None:
        """Give back ``req``'s draft pages and slots (never cached: private to it)."""
        if req.draft_table:
            self.cache.free_pages(_u32(req.draft_table))
        for slot in (req.draft_slot, req.draft_saved):
            if slot is not None:
                self.cache.free_slot(slot)
        req.draft_table = []
        req.draft_computed = 0
        req.draft_slot = req.draft_saved = None

    def _prompt_snapshot_at(self, req: Request) -> int | None:
        """Where ``req``'s prompt-end snapshot goes (see the design notes), if it still needs
        one: one token short of the prompt, past its hit, before its first output."""
        if not self.stateful or req.prompt_snapshot_done or req.num_output:
            return None
        at = len(req.prompt_ids) - 1
        if at <= 0 or at <= (req.cached_tokens or 0):
            req.prompt_snapshot_done = True  # a repeat resumed there: the tree has it
            return None
        return at

    def _prompt_snapshot(self, req: Request) -> None:
        """Give the tree the state ``req`` has now (its prompt but the last token computed)
        with the pages that hold those tokens; the request then reads the tree's full pages
        under a lock, and keeps its own partial last page."""
        req.prompt_snapshot_done = True
        cache, pt, n = self.cache, self.pt, req.num_computed
        full = n // pt
        slot = self._alloc_slot()
        if slot is None:
            return
        pages = req.block_table[:full]
        if n % pt:
            copy = self._alloc_pages(1)
            if copy is None:
                cache.free_slot(slot)
                return
            self.runner.copy_pages([req.block_table[full]], copy)
            pages = pages + copy
        assert req.slot is not None
        self.runner.copy_slots([req.slot], [slot])
        key = _u32(req.tokens[:n])
        ins = cache.insert(key, _u32(pages), slot)
        if ins.woken:
            self.metrics.woken.inc(ins.woken)
        m = cache.match(key)  # locks the path, now all resident, its snapshot at n
        assert m.node is not None and m.resident_len == n and m.state_len == n
        req.block_table[:full] = _ids(m.pages)[:full]
        if req.node is not None:
            cache.unlock(req.node)
        req.node = m.node

    def _context(self, req: Request, drafts: list[int]) -> Context | None:
        """What the sampler's logits processing needs of ``req``'s next token after
        ``drafts`` (a verify row's context: the drafts before it, as if accepted), or None
        if it needs none."""
        banned: frozenset[int] = frozenset()
        if req.num_output + len(drafts) < req.min_tokens:
            banned = req.stop_ids | self.eos
        if not banned and not req.params.processes and req.grammar is None:
            return None
        if drafts:
            # A row behind drafts sees them as its tokens: a new list, converted whole.
            return Context(req.tokens + drafts, len(req.prompt_ids), banned, req.grammar)
        if req.token_log is None and req.params.processes:
            req.token_log = TokenLog()
        return Context(req.tokens, len(req.prompt_ids), banned, req.grammar, req.token_log)

    def _grow(self, req: Request, k: int) -> bool:
        """Pages for ``req``'s next ``k`` tokens, preempting the youngest running requests
        when nothing can be evicted. False when ``req`` itself was preempted."""
        need = -(-(req.num_computed + k) // self.pt) - len(req.block_table)
        while True:
            pages = self._alloc_pages(need)
            if pages is not None:
                req.block_table.extend(pages)
                return True
            victim = max(self._running, key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False

    def _preempt(self, req: Request) -> None:
        self._running.remove(req)
        self._release(req, snapshot=True)
        self._waiting.appendleft(req)
        self.metrics.preemptions.inc()


def start_scheduler(make: Callable[[], Scheduler]) -> Scheduler:
    """Call ``make`` (load the checkpoint, build the runner, cache and scheduler) on a new
    thread, run the scheduler's loop there, and return the scheduler once built (``make``'s
    exception, if it raised).

    Why one thread for every torch op of the process: libgomp keeps a worker pool per thread
    that starts parallel regions, and with two such pools on 2 cores it stops spinning and
    wakes its workers by futex for every op. Measured at 2 threads: an add of 64 x 3072 took
    17 us from one thread and 86 us once another had run torch ops; a batch-64 decode step of
    the ~30M bench model, 44 ms when loaded and run on one thread, 118 ms when loaded on
    another.
    """
    built: queue.Queue[Scheduler | BaseException] = queue.Queue(maxsize=1)

    def main() -> None:
        try:
            sched = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, re-raised there
            built.put(e)
            return
        built.put(sched)
        sched.run()

    threading.Thread(target=main, name="kern-scheduler", daemon=True).start()
    got = built.get()
    if isinstance(got, BaseException):
        raise got
    return got


def _decode_first(req: Request) -> tuple[int, int]:
    return (len(req.tokens) - req.num_computed > 1, req.order)


def _u32(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.uint32)


def _ids(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype=np.uint32).tolist()
